"""configs/tiny_1m.yaml, whose last stage is 1,048,576 positions per row: its data plan cuts and
packs documents into full rows, and tools/run_1m.py's pipeline (train, stop inside the last
stage, resume, compare bit for bit, evaluate; peak RSS and s/step) holds at a short last stage.
The 1M run itself takes minutes on a 2-core CPU: its numbers are in docs/schedule.md, from
`python tools/run_1m.py --json`."""

import json
import os
import subprocess
import sys

import pytest

from maxlm import config as config_lib
from maxlm.data import ledger, loader
from limits import HANG_S

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "tiny_1m.yaml")


def test_the_1m_stage_packs_many_documents_into_full_rows(demo_data):
  cfg = config_lib.load(CONFIG, [f"data.dir={demo_data}"])
  last = cfg.stages[-1]
  assert last.seq_len == 2**20 and last.sparse.mode == "sparse"
  assert cfg.model.remat == "full" and cfg.model.loss_chunk < last.seq_len
  assert [st.seq_len for st in cfg.stages[:-1]] == [4096, 4096]  # earlier stages are short
  stage = ledger.stage_ledger(loader.Data(cfg).planner, len(cfg.stages) - 1)
  assert stage["seq_len"] == 2**20 and stage["rows"] == last.batch * last.num_steps
  assert stage["padding"] < 0.01 * stage["positions"]
  assert sum(e["documents"] for e in stage["sources"].values()) > 100


@pytest.mark.slow  # four processes, each compiling three stages
def test_run_1m_resumes_bitwise_and_reports_memory_at_a_short_last_stage(demo_data, tmp_path):
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "tools", "run_1m.py"), "--json", "--data",
       str(demo_data), "--workdir", str(tmp_path), "--set", "stages.2.seq_len=8192",
       "stages.0.steps=1", "stages.0.seq_len=1024", "stages.1.seq_len=1024"],
      capture_output=True, text=True, timeout=HANG_S)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout)
  assert out["seq_len"] == 8192 and out["resume"]["bitwise"], out["resume"]
  assert out["resume"]["rows_compared"] == 4 and out["resume"]["tensors_compared"] > 10
  assert [s["stage_step"] for s in out["steps_1m"]] == [0, 1]
  assert all(s["s_per_step"] > 0 for s in out["steps_1m"])
  assert set(out["runs"]) == {"train", "train_stopped", "train_resumed", "eval"}
  assert all(0 < r["peak_rss_gib"] < 24 for r in out["runs"].values())
  assert out["eval"]["seq_len"] == 8192 and out["eval"]["positions"]

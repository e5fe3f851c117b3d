"""configs/tiny_1m.yaml, whose last stage is 1,048,576 positions per row: its data plan cuts and
packs documents into full rows. The run itself (train, stop inside the last stage, resume,
compare bit for bit, evaluate; peak RSS and s/step) takes many minutes on a 2-core CPU, even
scaled down (11 min under load), too long for the suite: its numbers are in docs/schedule.md,
from `python tools/run_1m.py --json`; resumes across sparse stages are tested at small L in
tests/test_train_sparse.py."""

import os

from maxlm import config as config_lib
from maxlm.data import ledger, loader

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

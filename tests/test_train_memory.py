"""The memory estimate (maxlm/train/memory.py) against XLA's accounting of the compiled train
step on fake CPU devices, and the `maxlm memory` command."""

import json
import pathlib
import subprocess
import sys

import pytest

from maxlm import cli, config as config_lib
from maxlm.train import memory

ROOT = pathlib.Path(__file__).resolve().parents[1]
BASE = ["model.size=demo", "model.dtype=float32", "model.vocab_size=1024", "model.loss_chunk=256",
        "stages.0.seq_len=256", "stages.0.batch=16", "stages.0.block_q=128",
        "stages.0.block_k=128", "model.n_layers=2"]


@pytest.mark.parametrize("devices, overrides", [
    (1, ["model.remat=none"]),
    (4, ["model.remat=full", "stages.0.mesh.data=1", "stages.0.mesh.fsdp=4"]),
    (4, ["model.remat=dots", "stages.0.mesh.data=2", "stages.0.mesh.tensor=2"]),
    (4, ["model.remat=full", "stages.0.mesh.data=2", "stages.0.mesh.context=2"]),
    (4, ["model.remat=full", "stages.0.mesh.data=1", "stages.0.mesh.fsdp=4",
         "model.mhc.streams=4"]),
], ids=["none", "fsdp4-full", "tensor2-dots", "context2-full", "fsdp4-full-mhc4"])
def test_estimate_is_within_a_quarter_of_xla(devices, overrides):
  cfg = config_lib.load(str(ROOT / "configs/demo.yaml"), [*BASE, *overrides])
  xla = memory.compiled(cfg, 0, devices, 1024)
  est = memory.estimate(cfg, 0, devices, 1024, platform="cpu")
  assert 0.75 <= est["total"] / xla["total"] <= 1.25, (est, xla)
  # the state is exact: the arguments are the parameters and AdamW's moments, sharded alike
  # (under fsdp XLA had replicated the moments, tripling the state a device holds)
  assert est["params"] + est["optimizer"] == pytest.approx(xla["arguments"], rel=0.01)


def test_memory_command_prints_every_stage(tmp_path, capsys, monkeypatch):
  proc = subprocess.run([sys.executable, "-m", "maxlm.cli", "memory", "configs/demo.yaml",
                         "model.vocab_size=4096", "--devices", "2", "--platform", "cpu",
                         "--json"], capture_output=True, text=True, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr
  out = json.loads(proc.stdout)
  assert out["devices"] == 2 and len(out["stages"]) == 3
  for entry in out["stages"]:
    est = entry["estimate"]
    assert set(est) >= {*memory.PARTS, "total"} and est["total"] > est["params"] > 0
  # the table and a refusal through cli.main in this process (the JSON run above is a process)
  monkeypatch.chdir(ROOT)
  capsys.readouterr()
  code = cli.main(["memory", "configs/demo.yaml", "model.vocab_size=4096", "--devices", "2"])
  table = capsys.readouterr().out
  assert code == 0 and "s1024" in table and "activations" in table
  code = cli.main(["memory", "configs/demo.yaml", f"data.dir={tmp_path}"])
  assert code == 2 and "vocabulary size is unknown" in capsys.readouterr().err
  code = cli.main(["memory", "configs/demo.yaml", "model.vocab_size=4096", "model.moe.experts=6",
                   "stages.0.mesh.data=1", "stages.0.mesh.expert=-1", "--devices", "4"])
  assert code == 2 and "6 experts do not split over mesh expert=4" in capsys.readouterr().err


def test_each_stage_is_estimated_and_compiled_as_its_own_objective():
  """An lm -> dpo schedule: the dpo stage holds a frozen reference copy of the parameters
  (the estimate used to read train.objective, the run's default, for every stage: lm for
  both), and `compiled` builds the dpo step, whose reference copy is an argument XLA counts."""
  raw = config_lib.to_dict(config_lib.load(str(ROOT / "configs/demo.yaml"), BASE))
  raw["stages"] = [raw["stages"][0], {**raw["stages"][0], "objective": "dpo"}]
  raw["init"] = {**raw["init"], "from": "runs/sft"}  # dpo needs one; nothing is read here
  cfg = config_lib.from_dict(raw)
  lm, dpo = (memory.estimate(cfg, s, 1, 1024, platform="cpu") for s in (0, 1))
  assert dpo["params"] == pytest.approx(2 * lm["params"])
  assert dpo["optimizer"] == lm["optimizer"]
  xla_lm, xla_dpo = (memory.compiled(cfg, s, 1, 1024) for s in (0, 1))
  assert xla_dpo["arguments"] == pytest.approx(xla_lm["arguments"] + lm["params"], rel=0.02)
  assert 0.75 <= dpo["total"] / xla_dpo["total"] <= 1.25, (dpo, xla_dpo)

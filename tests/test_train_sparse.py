"""Dense -> indexer warm-up -> sparse stages in one schedule (maxlm/train/sparse_stage.py)."""

import os
import pathlib
import subprocess
import sys
import tempfile

import jax
import numpy as np
import pytest

from maxlm import MaxlmError, config as config_lib
from maxlm.train import metrics, verify

from limits import HANG_S
from smallrun import small_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
LADDER = ["stages.0.steps=4", "stages.1.steps=4", "stages.1.sparse.mode=indexer_warmup",
          "stages.1.sparse.indexer_heads=2", "stages.1.sparse.indexer_dim=8",
          "stages.1.sparse.topk=8", "stages.1.sparse.kl_weight=1.0",
          "stages.2.sparse.indexer_heads=2", "stages.2.sparse.indexer_dim=8",
          "stages.2.sparse.topk=16", "stages.2.sparse.block=8", "stages.2.sparse.mode=sparse"]


def three_stages_file(tmp_path, data_dir):
  import yaml
  path = small_config(tmp_path, data_dir)
  raw = yaml.safe_load(path.read_text())
  raw["stages"].append({"seq_len": 64, "batch": 8, "steps": 4})
  raw["train"].update(checkpoint_every=2, eval_every=0)
  path.write_text(yaml.safe_dump(raw))
  return path


def three_stages(tmp_path, data_dir, extra=()):
  return config_lib.load(str(three_stages_file(tmp_path, data_dir)), LADDER + list(extra))


def test_dense_warmup_sparse_trains_and_resumes_exactly(tmp_path, data_dir):
  from maxlm.ckpt import checkpoint
  from maxlm.train import loop
  cfg = three_stages(tmp_path, data_dir)
  assert loop.train(cfg, log=lambda *_: None)["step"] == 12
  rows = metrics.read_jsonl(cfg.run_dir)
  assert [r["stage"] for r in rows] == [0] * 4 + [1] * 4 + [2] * 4
  assert all(np.isfinite(r["loss"]) for r in rows)
  assert all("indexer_kl" not in r for r in rows[:4])
  warm, sparse = rows[4:8], rows[8:]
  assert all({"indexer_kl", "indexer_recall", "selected_keys"} <= set(r) for r in warm)
  assert all({"indexer_kl", "selected_keys", "indexer_recall"} <= set(r) for r in sparse)
  assert all(0 < r["indexer_recall"] <= 1 + 1e-6 for r in sparse)
  assert warm[-1]["indexer_kl"] < warm[0]["indexer_kl"]
  assert all(0 < r["indexer_recall"] <= 1 + 1e-6 for r in warm)
  assert all(0 < r["selected_keys"] <= 16 for r in sparse)
  # warm-up moves no main parameter: the main part of param_norm is constant there
  main = [r["param_norm"] for r in warm]
  assert max(main) - min(main) < 1e-3 * main[0]

  # stop in each stage and resume: every row and the final state are bit for bit the same
  cut = three_stages(tmp_path, data_dir, [f"run_dir={tmp_path / 'cut'}"])
  for stop in (2, 3, 4, 3):
    loop.train(cut, stop_after=stop, log=lambda *_: None)
  got = metrics.read_jsonl(cut.run_dir)
  for a, b in zip(rows, got):
    for key in ("loss", "grad_norm", "param_norm", "indexer_kl", "selected_keys"):
      assert a.get(key) == b.get(key), (a["step"], key)

  def final(run_dir):
    ck = checkpoint.Checkpoints(run_dir, 3, False, lambda *_: None)
    return ck.steps()[-1]
  assert final(cfg.run_dir) == final(cut.run_dir) == 12


def test_warmup_freezes_the_main_model_exactly(tmp_path, data_dir):
  from maxlm.model import build
  from maxlm.train import stage as stage_lib, step as step_lib
  cfg = three_stages(tmp_path, data_dir)
  parts = stage_lib.parts(cfg, 1, 300)
  with parts.mesh:
    state = step_lib.init_state(parts.model, parts.opt, parts.mesh, cfg.rules, 0, 64)
  before = jax.device_get(state["params"])
  rng = np.random.default_rng(0)
  seg = np.repeat(np.arange(1, 5), 16)[None].repeat(8, 0).astype(np.int32)
  tokens = rng.integers(0, 300, (8, 64)).astype(np.int32)
  batch = {"inputs": tokens, "targets": np.roll(tokens, -1, 1), "segment_ids": seg,
           "positions": np.tile(np.arange(16), 4)[None].repeat(8, 0).astype(np.int32),
           "loss_mask": (seg > 0).astype(np.float32)}
  with parts.mesh:
    kls = []
    for _ in range(5):
      state, m = parts.step(state, batch)
      kls.append(float(m["indexer_kl"]))
  after = jax.device_get(state["params"])
  moved = []
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(before),
                          jax.tree_util.tree_leaves(after)):
    name = jax.tree_util.keystr(path)
    if "indexer" in name:
      moved.append(not np.array_equal(a, b))
    else:
      np.testing.assert_array_equal(a, b, err_msg=name)
  assert moved and all(moved)
  assert kls[-1] < kls[0], kls
  assert build.count_params(after) > build.count_params(
      {k: v for k, v in after.items() if k != "layers"})


def assert_same_indexer_metrics(one_dir, other_dir, keys=("loss", "indexer_kl",
                                                          "selected_keys", "indexer_recall")):
  """Row by row (matched by step): the same metrics present, equal to 1e-4; a row that lacks
  one is shown whole, with its stage."""
  want = {r["step"]: r for r in metrics.read_jsonl(one_dir)}
  got = {r["step"]: r for r in metrics.read_jsonl(other_dir)}
  assert sorted(want) == sorted(got) == list(range(12))
  assert all("indexer_recall" in want[s] for s in range(4, 12))  # warm-up and sparse rows
  for step, a in want.items():
    b = got[step]
    assert [k for k in keys if k in a] == [k for k in keys if k in b], (step, a, b)
    for key in (k for k in keys if k in a):
      assert b[key] == pytest.approx(a[key], rel=1e-4), (step, key)


def test_sparse_with_context_parallelism_matches_one_device(tmp_path, data_dir):
  from maxlm.train import loop, stage as stage_lib
  assert len(jax.devices()) >= 4
  one = three_stages(tmp_path, data_dir)
  loop.train(one, log=lambda *_: None)
  cp = three_stages(tmp_path, data_dir, [f"run_dir={tmp_path / 'cp'}"] + [
      f"stages.{s}.mesh.{k}" for s in (1, 2) for k in ("context=2", "data=-1")])
  loop.train(cp, log=lambda *_: None)
  assert_same_indexer_metrics(one.run_dir, cp.run_dir)
  bad = three_stages(tmp_path, data_dir, ["stages.2.mesh.context=2", "stages.2.mesh.data=-1",
                                          "stages.2.sparse.select=token"])
  with pytest.raises(MaxlmError, match="context parallelism .* needs select=block"):
    stage_lib.validate(bad)


def _train_in_a_fresh_process(tmp_path, data_dir, extra):
  """`maxlm train` on three_stages' config, on this session's 8 fake devices: after some
  hundred tests in one process, XLA:CPU has crashed (SIGSEGV) compiling the fsdp step below,
  three runs out of three, while a fresh process compiles it every time."""
  path = three_stages_file(tmp_path, data_dir)
  proc = subprocess.run([sys.executable, "-m", "maxlm.cli", "train", str(path), *LADDER,
                         *extra], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S,
                        env={**os.environ, "PYTHONPATH": str(ROOT)})
  assert proc.returncode == 0, proc.stderr[-3000:]
  return config_lib.load(str(path), LADDER + list(extra)).run_dir


def test_sparse_under_fsdp_matches_one_device(tmp_path, data_dir):
  """The sampled recall's loop runs under GSPMD (no shard_map) with sharded params."""
  one = _train_in_a_fresh_process(tmp_path, data_dir, [f"run_dir={tmp_path / 'one'}"])
  sharded = _train_in_a_fresh_process(tmp_path, data_dir, [f"run_dir={tmp_path / 'fsdp'}"] + [
      f"stages.{s}.mesh.{k}" for s in (0, 1, 2) for k in ("fsdp=2", "data=-1")])
  assert_same_indexer_metrics(one, sharded)


def test_ladder_errors():
  base = {"stages": [{"seq_len": 32, "batch": 8, "steps": 1, "sparse": {"mode": "sparse"}},
                     {"seq_len": 32, "batch": 8, "steps": 1}]}
  with pytest.raises(config_lib.ConfigError, match="stages.1.sparse.mode: dense after stage 0"):
    config_lib.from_dict(base)
  base["stages"][1]["sparse"] = {"mode": "sparse", "indexer_heads": 2}
  with pytest.raises(config_lib.ConfigError, match="indexer_heads/indexer_dim"):
    config_lib.from_dict(base)
  with pytest.raises(config_lib.ConfigError, match="stages.0.sparse.mode: expected one of"):
    config_lib.from_dict({"stages": [{"seq_len": 32, "batch": 8, "steps": 1,
                                      "sparse": {"mode": "spars"}}]})
  with pytest.raises(config_lib.ConfigError, match="stages.0.sparse.indexer_dim: must be even"):
    config_lib.from_dict({"stages": [{"seq_len": 32, "batch": 8, "steps": 1,
                                      "sparse": {"indexer_dim": 7}}]})


@pytest.mark.slow
def test_verify_restart_kills_across_dense_warmup_sparse_and_catches_a_corrupt_checkpoint(
    tmp_path, demo_data, monkeypatch):
  """`maxlm verify-restart --kills 3 --corrupt` on the demo's three stages made dense, indexer
  warm-up and sparse: the proof every other restart test leans on, run once."""
  assert "device_count=8" in os.environ["XLA_FLAGS"]  # the subprocesses inherit 8 devices
  shorter = [f"data.dir={demo_data}", "model.size=tiny", "stages.0.steps=4", "stages.1.steps=4",
             "stages.2.steps=4", "stages.2.seq_len=256", "stages.2.batch=8",
             "train.checkpoint_every=2", "train.eval_every=0",
             "stages.1.sparse.mode=indexer_warmup", "stages.1.sparse.topk=32",
             "stages.2.sparse.mode=sparse", "stages.2.sparse.topk=32",
             "stages.2.sparse.block=16"]
  lines = []
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where its temporary work dir goes
  assert verify.verify(str(ROOT / "configs" / "demo.yaml"), shorter, kills=3,
                       log=lines.append, corrupt=True)
  # each resume compared bitwise (params and optimizer state at the end); SIGKILLs land
  # mid-stage, at a stage boundary and during a save (here: steps 4, 7, about 9 of 0..11),
  # every one of them: each job pauses where it is to be killed
  assert sum("(killed)" in line for line in lines) == 3, lines
  assert any("corrupted and caught" in line for line in lines), lines
  assert lines[-1].endswith("removed") and not list(tmp_path.glob("maxlm-verify-*")), lines

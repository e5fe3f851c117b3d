"""Nothing corrupts silently: flipped checkpoint bytes, edited metadata or iterator state,
changed data, non-finite steps and failed writes are each caught, and a resume past them is
bitwise the uninterrupted run."""

import json
import os
import pathlib
import resource
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from maxlm import MaxlmError, config as config_lib
from maxlm.ckpt import checkpoint, integrity
from maxlm.data import plan
from maxlm.train import loop, metrics, verify

import datagen
from smallrun import ROOT, small_config
from limits import HANG_S


def quiet(*_):
  pass


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_dir):
  """An uninterrupted run, and the same run stopped after 8 steps (checkpoints 3, 6, 8)."""
  root = tmp_path_factory.mktemp("runs")
  path = small_config(root, data_dir)
  full = config_lib.load(str(path), [f"run_dir={root / 'full'}"])
  loop.train(full, log=quiet)
  stopped = config_lib.load(str(path), [f"run_dir={root / 'stopped'}"])
  loop.train(stopped, stop_after=8, log=quiet)
  return path, root / "full", root / "stopped"


def resume_copy(runs, tmp_path, *overrides):
  """Copies the stopped run to tmp_path/run; returns (config, log lines)."""
  path, _, stopped = runs
  shutil.copytree(stopped, tmp_path / "run")
  return config_lib.load(str(path), [f"run_dir={tmp_path / 'run'}", *overrides]), []


def assert_same_as_uninterrupted(runs, run_dir, from_step):
  _, full, _ = runs
  want = {r["step"]: r for r in metrics.read_jsonl(str(full))}
  got = [r for r in metrics.read_jsonl(str(run_dir)) if r["step"] >= from_step]
  assert got and all(r["fingerprint"] == want[r["step"]]["fingerprint"]
                     and r["loss"] == want[r["step"]]["loss"] for r in got)
  step_a, state_a = verify._final_state(str(full))
  step_b, state_b = verify._final_state(str(run_dir))
  assert step_a == step_b and verify._compare_states(state_a, state_b)[1] == []


def largest_file(folder):
  return max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def flip_middle(path):
  """One flipped bit in the middle of a data file: array bytes, which the digests must catch
  (a 64-byte flip could reach into an OCDBT node packed in the same file, which makes the
  checkpoint unreadable rather than provably corrupt: another code path, tested elsewhere)."""
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0x01
  path.write_bytes(bytes(data))


def test_bit_flipped_checkpoint_is_caught_and_the_resume_is_bitwise(runs, tmp_path):
  cfg, lines = resume_copy(runs, tmp_path)
  flip_middle(largest_file(tmp_path / "run" / "checkpoints" / "8" / "state"))
  summary = loop.train(cfg, log=lines.append)
  assert any(line.startswith("checkpoint 8 is corrupt (") for line in lines), lines
  assert summary["resumed_from"] == 6
  assert_same_as_uninterrupted(runs, cfg.run_dir, from_step=6)
  ckpts = checkpoint.Checkpoints(cfg.run_dir, 3, False, quiet, read_only=True)
  try:
    for step in ckpts.steps():  # every checkpoint left verifies
      ckpts.meta(step)
  finally:
    ckpts.close()


def test_all_checkpoints_corrupt_starts_over_and_says_so(runs, tmp_path):
  cfg, lines = resume_copy(runs, tmp_path)
  for step in ("3", "6", "8"):
    flip_middle(largest_file(tmp_path / "run" / "checkpoints" / step / "state"))
  summary = loop.train(cfg, log=lines.append)
  assert summary["resumed_from"] is None
  assert any(line.startswith("every checkpoint in ") and "(3, 6, 8); starting from step 0"
             in line for line in lines), lines
  assert_same_as_uninterrupted(runs, cfg.run_dir, from_step=0)


def test_edited_metadata_is_caught(runs, tmp_path):
  cfg, lines = resume_copy(runs, tmp_path)
  meta_file = tmp_path / "run" / "checkpoints" / "8" / "meta" / "metadata"
  meta = json.loads(meta_file.read_text())
  meta["stage_step"] = 0  # still valid JSON, and still a plausible position
  meta_file.write_text(json.dumps(meta))
  summary = loop.train(cfg, log=lines.append)
  assert "checkpoint 8 is corrupt (its metadata does not match its checksum); trying the one " \
         "before" in lines
  assert summary["resumed_from"] == 6
  assert_same_as_uninterrupted(runs, cfg.run_dir, from_step=6)


def test_rewound_grain_state_is_rebuilt_from_the_step(runs, tmp_path):
  cfg, lines = resume_copy(runs, tmp_path)
  state_file = tmp_path / "run" / "checkpoints" / "8" / "data" / "process_0-of-1.json"
  assert json.loads(state_file.read_text()) == {"next_index": 2}
  state_file.write_text(json.dumps({"next_index": 0}))
  summary = loop.train(cfg, log=lines.append)
  assert summary["resumed_from"] == 8
  assert any("Grain iterator state in checkpoint 8 disagrees with its step" in line
             and "rebuilding the iterator at step 2" in line for line in lines), lines
  assert_same_as_uninterrupted(runs, cfg.run_dir, from_step=8)


def test_the_checkpoint_a_run_resumed_from_survives_rotation(runs, tmp_path):
  cfg, lines = resume_copy(runs, tmp_path, "train.keep=1")
  loop.train(cfg, log=lines.append)
  steps = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir()
                 if p.name.isdigit())
  assert steps == [8, 11]  # the verified anchor and the newest


def test_resume_on_changed_data_is_refused_unless_allowed(runs, tmp_path):
  other = datagen.write_data_dir(tmp_path / "other", datagen.make_docs(
      [30 + i % 50 for i in range(200)], ["prose" if i % 2 else "code" for i in range(200)],
      seed=1), val_fraction=0.1)
  cfg, lines = resume_copy(runs, tmp_path, f"data.dir={other}")
  before = len(metrics.read_jsonl(cfg.run_dir))
  with pytest.raises(MaxlmError, match="checkpoint 8 was trained on other data than .* "
                                       "set data.allow_changed=true"):
    loop.train(cfg, log=lines.append)
  assert len(metrics.read_jsonl(cfg.run_dir)) == before
  assert other not in (tmp_path / "run" / "config.yaml").read_text()  # a refusal writes nothing
  allowed = config_lib.load(str(runs[0]), [f"run_dir={cfg.run_dir}", f"data.dir={other}",
                                           "data.allow_changed=true"])
  assert loop.train(allowed, stop_after=1, log=lines.append)["resumed_from"] == 8
  assert metrics.read_jsonl(cfg.run_dir)[-1]["data_changed"] == 1
  assert any("data changed since checkpoint 8" in line for line in lines)


def test_non_finite_step_stops_before_saving(runs, tmp_path):
  cfg, lines = resume_copy(runs, tmp_path, "train.lr=1.0e+30", "train.checkpoint_every=1")
  with pytest.raises(MaxlmError, match=r"step \d+: non-finite values \(loss .*stopped without "
                                       r"saving, checkpoint \d+ is the last good one. Likely "
                                       r"cause: train.lr=1e\+30"):
    loop.train(cfg, log=lines.append)
  rows = metrics.read_jsonl(cfg.run_dir)
  bad = next(r["step"] for r in rows if not np.isfinite(r["loss"]) or
             not np.isfinite(r["param_norm"]) or not np.isfinite(r["grad_norm"]))
  steps = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir()
                 if p.name.isdigit())
  assert max(steps) <= bad  # checkpoint `bad` holds the state before the bad step
  ckpts = checkpoint.Checkpoints(cfg.run_dir, 3, False, quiet, read_only=True)
  try:
    for step in steps:
      assert ckpts.meta(step)["finite"]
  finally:
    ckpts.close()


def train_with_file_size_limit(path, run_dir, limit=None, *args):
  """`maxlm train` in a child whose writes past `limit` bytes fail (EFBIG), as on a full disk."""
  def apply():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
  env = {**os.environ, "MAXLM_COMPILE_CACHE": "off"}
  return subprocess.run(
      [sys.executable, "-m", "maxlm.cli", "train", str(path), f"run_dir={run_dir}", *args],
      cwd=ROOT, capture_output=True, text=True, env=env, preexec_fn=apply if limit else None)


def test_failed_checkpoint_write_stops_training_at_once(runs, tmp_path):
  path, _, _ = runs
  proc = train_with_file_size_limit(path, tmp_path / "run", 60_000)
  assert proc.returncode == 2, proc.stderr
  assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
  assert "could not write checkpoint 3 to" in proc.stderr
  assert "earlier checkpoints are intact" in proc.stderr
  rows = metrics.read_jsonl(str(tmp_path / "run"))
  assert [r["step"] for r in rows][-1] <= 4  # at most the step in flight when it failed
  rerun = train_with_file_size_limit(path, tmp_path / "run", None, "--stop-after", "1")
  assert rerun.returncode == 0, rerun.stderr
  leftovers = [n for n in os.listdir(tmp_path / "run" / "checkpoints") if "tmp" in n]
  assert leftovers == []


def test_a_run_dir_that_cannot_be_written_at_start_is_one_line(runs, tmp_path):
  path, _, _ = runs
  proc = train_with_file_size_limit(path, tmp_path / "run", 16)
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
  assert f"cannot write to run_dir {tmp_path / 'run'}: File too large" in proc.stderr


def test_free_space_is_checked_before_the_first_save(runs, tmp_path, monkeypatch):
  path, _, _ = runs
  cfg = config_lib.load(str(path), [f"run_dir={tmp_path / 'run'}"])
  real = shutil.disk_usage
  monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
  with pytest.raises(MaxlmError, match="has 1000 B free, and a checkpoint of this model needs "
                                       "about"):
    loop.train(cfg, log=quiet)
  assert metrics.read_jsonl(cfg.run_dir) == []


def test_array_digests_see_one_flipped_bit():
  tree = {"a": np.arange(1000, dtype=np.float32), "b": np.ones((3, 4), np.int32)}
  before = integrity.array_digests(tree)
  tree["a"].view(np.uint32)[517] ^= 1 << 9
  after = integrity.array_digests(tree)
  assert before["['a']"] != after["['a']"] and before["['b']"] == after["['b']"]
  meta = integrity.seal({"stage": 0}, tree, {"next_index": 3})
  integrity.check_meta(5, json.loads(json.dumps(meta)))
  with pytest.raises(integrity.CorruptCheckpoint, match="checkpoint 5 is corrupt"):
    integrity.check_meta(5, {**meta, "stage": 1})
  legacy = {"stage": 0, "config": {}}
  integrity.check_meta(5, legacy)  # written before checksums: accepted
  stripped = {k: v for k, v in {**meta, "finite": True}.items() if k != "integrity"}
  with pytest.raises(integrity.CorruptCheckpoint, match="its metadata lost its checksums"):
    integrity.check_meta(5, stripped)  # a renamed key must not switch checking off
  assert integrity.check_iterator(meta, {"next_index": 3}, 3) is None
  assert "differs from the one recorded" in integrity.check_iterator(meta, {"next_index": 0}, 3)
  assert integrity.check_iterator({}, {"next_index": 0}, 3) == (
      "it says next_index 0 where the step says 3")


def _block_sigint():
  signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT,))


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.15, 0.3, 0.6, 1.2])
def test_sigint_at_any_moment_of_start_up_ends_without_a_traceback(runs, tmp_path, delay):
  """The child starts with SIGINT blocked and `signals.install_early` unblocks it: a signal sent
  while the interpreter itself starts (before any line of ours) waits for our handler instead of
  racing it, so every delay lands on our start-up or later, on any machine."""
  import time
  path, _, _ = runs
  proc = subprocess.Popen([sys.executable, "-m", "maxlm.cli", "train", str(path),
                           f"run_dir={tmp_path / 'run'}"], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, preexec_fn=_block_sigint)
  time.sleep(delay)
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=HANG_S)
  assert "Traceback" not in err, err
  assert proc.returncode in (0, 130, -signal.SIGINT), (proc.returncode, err)  # 0: saved
  assert err.count("\n") <= 1, err


def test_a_checkpoint_of_the_previous_data_plan_is_refused(runs, tmp_path):
  cfg, lines = resume_copy(runs, tmp_path)
  meta_file = tmp_path / "run" / "checkpoints" / "8" / "meta" / "metadata"
  meta = json.loads(meta_file.read_text())
  assert meta["planner"]["version"] == plan.VERSION == 3
  del meta["planner"]["version"]  # as plan v1 wrote it
  meta["integrity"]["meta"] = integrity._meta_hash(meta)  # a sound checkpoint, not a corrupt one
  meta_file.write_text(json.dumps(meta))
  before = len(metrics.read_jsonl(cfg.run_dir))
  with pytest.raises(MaxlmError, match="checkpoint 8 was planned with data plan v1; this maxlm "
                                       r"\(.*\) plans v3.*finish the run with the maxlm that "
                                       "started it, or start over in a new run_dir"):
    loop.train(cfg, log=lines.append)
  assert len(metrics.read_jsonl(cfg.run_dir)) == before

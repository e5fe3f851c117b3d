"""verify-restart's parts (maxlm/train/verify.py) and the pause its kills rely on
(maxlm/train/pause.py): where a job pauses to be killed, that the pause holds until the file
or a stop, and that --corrupt flips one bit that provably fails the checksums, or says why not."""

import pathlib
import shutil
import types

import pytest

from maxlm import MaxlmError, config as config_lib
from maxlm.train import loop, pause, verify

from smallrun import small_config


class _Stop:
  multi, signal = False, None


def test_pause_holds_until_a_stop_or_the_file(tmp_path, monkeypatch):
  go = tmp_path / "go"
  monkeypatch.setenv(pause.ENV, f"3:{go}")
  assert pause.parse() == (3, str(go))
  stop, polls = _Stop(), []

  def sleep(_):  # the third poll: Ctrl-C arrives
    polls.append(1)
    if len(polls) == 3:
      stop.signal = "SIGINT"
  monkeypatch.setattr(pause, "time", types.SimpleNamespace(sleep=sleep))  # pause's polls only
  pause.maybe_wait(2, stop)  # another step: no pause
  assert polls == []
  pause.maybe_wait(3, stop)
  assert len(polls) == 3  # it waited until the signal, and no longer
  stop.signal = None
  go.touch()
  pause.maybe_wait(3, stop)  # the file: goes on at once
  assert len(polls) == 3
  monkeypatch.delenv(pause.ENV)
  assert pause.parse() is None


def test_kill_steps_pause_where_the_moment_is_and_after_a_save_for_corrupt():
  boundaries = {3, 6, 8}  # stages of 4, 3 and 2 steps
  saves = [1, 3, 5, 6, 7, 8]  # checkpoint_every 2, and every stage's end
  assert [verify.kill_step(m, -1, boundaries, saves) for m in verify.MOMENTS] == [2, 3, 3]
  assert [verify.kill_step(m, 5, boundaries, saves) for m in verify.MOMENTS] == [7, 6, 7]
  assert [verify.kill_step(m, 8, boundaries, saves) for m in verify.MOMENTS] == [None] * 3
  late = [3, 6, 7, 8]  # checkpoint_every 4: the first save is after step 3
  assert verify.kill_step("mid-stage", -1, boundaries, late) == 2
  assert verify.kill_step("mid-stage", -1, boundaries, late, need_checkpoint=True) == 3


@pytest.fixture(scope="module")
def finished(tmp_path_factory, data_dir):
  root = tmp_path_factory.mktemp("finished")
  path = small_config(root, data_dir, eval_every=0)
  loop.train(config_lib.load(str(path)), log=lambda *_: None)
  return path, root / "run"


def largest(run_dir, step):
  files = (pathlib.Path(run_dir) / "checkpoints" / str(step) / "state").rglob("*")
  return max((f for f in files if f.is_file()), key=lambda f: f.stat().st_size)


def test_corrupt_flips_one_bit_that_fails_the_checksums_and_the_resume_catches(finished,
                                                                              tmp_path):
  path, run = finished
  shutil.copytree(run, tmp_path / "run")
  steps = verify._committed(str(tmp_path / "run"))
  assert steps == [6, 9, 11]
  before = largest(tmp_path / "run", 11).read_bytes()
  assert verify.corrupt_latest(str(tmp_path / "run")) == 11
  after = largest(tmp_path / "run", 11).read_bytes()
  flipped = [a ^ b for a, b in zip(before, after) if a != b]
  assert len(before) == len(after) and flipped == [1]  # one bit, nothing else
  assert [verify._fails_its_checksums(str(tmp_path / "run"), s) for s in steps] == [
      False, False, True]
  lines = []
  cfg = config_lib.load(str(path), [f"run_dir={tmp_path / 'run'}"])
  assert loop.train(cfg, log=lines.append)["resumed_from"] == 9
  assert any(line.startswith("checkpoint 11 is corrupt (1 of ") for line in lines), lines


def test_corrupt_without_a_checkpoint_fails_loudly(tmp_path, finished):
  with pytest.raises(MaxlmError, match="has no committed checkpoint to corrupt"):
    verify.corrupt_latest(str(tmp_path))
  with pytest.raises(MaxlmError, match="--corrupt needs --kills >= 1"):
    verify.verify(str(finished[0]), kills=0, corrupt=True, workdir=str(tmp_path))


@pytest.mark.parametrize("holds, what", [("config.yaml", "a run dir"),
                                         ("manifest.json", "a data dir"),
                                         ("notes.txt", "not empty")])
def test_a_workdir_that_holds_anything_is_refused_before_any_run(tmp_path, holds, what):
  """Its runs would resume what is there (a run dir's checkpoints) or write into it."""
  (tmp_path / "cfg.yaml").write_text("stages: [{seq_len: 32, batch: 2, steps: 1}]\n")
  work = tmp_path / "work"
  work.mkdir()
  (work / holds).write_text("{}")
  with pytest.raises(MaxlmError, match=f"--workdir {work} is {what}: verify-restart writes"):
    verify.verify(str(tmp_path / "cfg.yaml"), kills=1, workdir=str(work))
  assert sorted(p.name for p in work.iterdir()) == [holds]

"""An object-store run_dir (memory:// takes the same code path as gs://): the small files are
mirrored locally and copied up whole; readers read them through maxlm.io."""

import pytest

from maxlm import MaxlmError, io
from maxlm.train import metrics, plot, rundir


def test_remote_run_dir_round_trip(tmp_path, monkeypatch):
  monkeypatch.setenv("MAXLM_CACHE", str(tmp_path / "cache"))
  path = "memory://bucket/runs/r1"
  first = rundir.RunDir(path)
  assert first.remote and first.local.startswith(str(tmp_path / "cache"))
  first.check_writable()
  assert not io.exists(io.join(path, ".maxlm-write-check"))
  first.pull()
  writer = metrics.Writer(first.local)
  writer.write(0, {"loss": 3.0, "stage": 0})
  writer.write(1, {"loss": 2.5, "stage": 0})
  writer.close()
  first.push()
  assert [r["loss"] for r in metrics.read_jsonl(path)] == [3.0, 2.5]

  (tmp_path / "cache").rename(tmp_path / "gone")  # a new machine: nothing local
  second = rundir.RunDir(path)
  second.pull()
  writer = metrics.Writer(second.local)
  writer.write(2, {"loss": 2.0, "stage": 1})
  writer.close()
  second.push()
  assert [r["step"] for r in metrics.read_jsonl(path)] == [0, 1, 2]
  plot.save(path, io.join(path, "curves.png"))
  assert io.read_bytes(io.join(path, "curves.png"))[:4] == b"\x89PNG"


def test_local_run_dir_is_used_in_place(tmp_path):
  run = rundir.RunDir(str(tmp_path / "run"))
  assert not run.remote and run.local == str(tmp_path / "run")
  run.check_writable()
  (tmp_path / "file").write_text("")
  with pytest.raises(MaxlmError, match="is not writable"):
    rundir.RunDir(str(tmp_path / "file" / "run")).check_writable()


def test_metrics_tolerate_only_a_cut_last_line(tmp_path):
  (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n{"ste')
  assert [r["step"] for r in metrics.read_jsonl(str(tmp_path))] == [0, 1]
  (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"ste\n{"step": 2}\n')
  with pytest.raises(MaxlmError, match="line 2 is not JSON"):
    metrics.read_jsonl(str(tmp_path))

"""One writer per run_dir: a second trainer is refused before it writes anything; a dead
holder's lease is taken over; an object-store lease expires, is renewed, and can be lost."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import types

import pytest

from limits import HANG_S
from maxlm import MaxlmError, io
from maxlm.train import lease, metrics

from smallrun import ROOT, small_config

HOLD = ("import sys, time; from maxlm.train import lease; "
        "held = lease.Lease(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(600)")


def hold_in_child(run_dir):
  proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE,
                          text=True, cwd=ROOT)
  assert proc.stdout.readline().strip() == "held"
  return proc


def test_second_trainer_exits_2_naming_the_holder_and_writes_nothing(tmp_path, data_dir):
  path = small_config(tmp_path, data_dir)
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  holder = hold_in_child(run_dir)
  try:
    proc = subprocess.run([sys.executable, "-m", "maxlm.cli", "train", str(path)], cwd=ROOT,
                          capture_output=True, text=True)
  finally:
    holder.kill()
    holder.wait()
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
  assert (f"run_dir {run_dir} is in use by pid {holder.pid} on host {socket.gethostname()} "
          "(started ") in proc.stderr
  assert "rerun with --force" in proc.stderr
  assert sorted(os.listdir(run_dir)) == ["lease.json"]  # no config, metrics or checkpoints


def test_a_sigkilled_holders_lease_is_taken_over(tmp_path):
  holder = hold_in_child(tmp_path)
  holder.send_signal(signal.SIGKILL)
  holder.wait()
  taken = lease.Lease(tmp_path).acquire()
  try:
    assert json.loads((tmp_path / "lease.json").read_text())["pid"] == os.getpid()
  finally:
    taken.release()


def test_force_does_not_take_over_from_a_live_local_holder(tmp_path):
  holder = hold_in_child(tmp_path)
  try:
    with pytest.raises(MaxlmError, match="alive on this host: --force takes over only from a "
                                         "dead run"):
      lease.Lease(tmp_path).acquire(force=True)
  finally:
    holder.kill()
    holder.wait()


def test_two_trainers_in_one_run_dir_one_is_refused(tmp_path, data_dir):
  path = small_config(tmp_path, data_dir)
  cmd = [sys.executable, "-m", "maxlm.cli", "train", str(path)]
  procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True) for _ in range(2)]
  results = [(p.wait(timeout=HANG_S), p.stderr.read()) for p in procs]
  codes = sorted(code for code, _ in results)
  assert codes == [0, 2], results
  rows = metrics.read_jsonl(str(tmp_path / "run"))
  assert [r["step"] for r in rows] == list(range(11))  # one loss per step


def test_object_store_lease_refuses_renews_expires_and_is_lost(monkeypatch):
  monkeypatch.setenv("MAXLM_LEASE_TTL", "2")
  path = "memory://bucket/lease-test"
  first = lease.Lease(path).acquire()
  with pytest.raises(MaxlmError, match=r"is in use by pid \d+ on host .*, lease expires in"):
    lease.Lease(path).acquire()
  expires = [json.loads(io.read_bytes(f"{path}/lease.json"))["expires"]]
  deadline = time.time() + 60
  while len(set(expires)) < 3 and time.time() < deadline:  # two beats renewed it
    time.sleep(0.05)
    expires.append(json.loads(io.read_bytes(f"{path}/lease.json"))["expires"])
  assert len(set(expires)) == 3 and expires == sorted(expires)
  with pytest.raises(MaxlmError, match="is in use by"):
    lease.Lease(path).acquire()
  second = lease.Lease(path).acquire(force=True)
  deadline = time.time() + 60
  while first.lost is None and time.time() < deadline:
    time.sleep(0.05)
  with pytest.raises(MaxlmError, match="lost the lease on run_dir memory://bucket/lease-test"):
    first.check()
  first.release()
  assert json.loads(io.read_bytes(f"{path}/lease.json"))["token"] == second.holder["token"]
  second.release()
  assert not io.exists(f"{path}/lease.json")
  stale = {"host": "elsewhere", "pid": 1, "start": "then", "token": "x",
           "expires": time.time() - 1}
  io.write_bytes(f"{path}/lease.json", json.dumps(stale).encode())
  lease.Lease(path).acquire().release()  # expired: taken over without --force
  dead_here = {**stale, "host": socket.gethostname(), "pid": _dead_pid(),
               "expires": time.time() + 60}
  io.write_bytes(f"{path}/lease.json", json.dumps(dead_here).encode())
  lease.Lease(path).acquire().release()  # its holder died on this host


def _dead_pid():
  proc = subprocess.Popen([sys.executable, "-c", "pass"])
  proc.wait()
  return proc.pid


def test_local_takeover_is_seen_by_the_holder_and_garbage_is_no_licence(tmp_path):
  first = lease.Lease(tmp_path).acquire()
  try:
    first.check()
    other = {"host": "elsewhere", "pid": 7, "start": "now", "token": "theirs"}
    (tmp_path / "lease.json").write_text(json.dumps(other))  # as --force from another host
    with pytest.raises(MaxlmError, match="lost the lease on run_dir .* to pid 7 on host "
                                         "elsewhere"):
      first.check()
  finally:
    first.release()
  holder = hold_in_child(tmp_path)
  try:
    (tmp_path / "lease.json").write_text("garbage{")
    with pytest.raises(MaxlmError, match="in use by another process .*alive on this host"):
      lease.Lease(tmp_path).acquire(force=True)
  finally:
    holder.kill()
    holder.wait()


def test_a_lease_file_that_is_a_symlink_is_refused_and_its_target_untouched(tmp_path):
  target = tmp_path / "precious.txt"
  target.write_text("keep me")
  (tmp_path / "run").mkdir()
  (tmp_path / "run" / "lease.json").symlink_to(target)
  with pytest.raises(MaxlmError, match="cannot be opened as the run_dir's lease"):
    lease.Lease(tmp_path / "run").acquire()
  assert target.read_text() == "keep me"


def test_a_forced_take_over_wins_over_a_beat_between_its_read_and_write(monkeypatch):
  path = "memory://bucket/lease-race"
  alive = {"host": "elsewhere", "pid": 1, "start": "then", "token": "beat",
           "expires": time.time() + 60}
  io.write_bytes(f"{path}/lease.json", json.dumps(alive).encode())
  opened = lease.Lease._kv

  class Racing:  # the store, with the holder's heartbeat landing right after our first read
    def __init__(self, kv):
      self.kv, self.beats = kv, 0

    def read(self, key):
      found = self.kv.read(key).result()
      if not self.beats:
        self.beats += 1
        self.kv.write(key, json.dumps({**alive, "expires": time.time() + 60}).encode()).result()
      return types.SimpleNamespace(result=lambda: found)

    def write(self, *args, **kw):
      return self.kv.write(*args, **kw)

  monkeypatch.setattr(lease.Lease, "_kv", lambda self: Racing(opened(self)))
  with pytest.raises(MaxlmError, match="is in use by"):
    lease.Lease(path).acquire()
  taken = lease.Lease(path).acquire(force=True)
  assert json.loads(io.read_bytes(f"{path}/lease.json"))["token"] == taken.holder["token"]
  taken.release()


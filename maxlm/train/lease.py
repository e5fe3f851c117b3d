"""One writer per run_dir: a lease taken before anything is written, released at exit.

Two trainers on one run_dir overwrite each other's checkpoints and interleave their metrics,
and both may exit 0. So `maxlm train` first takes the run_dir's lease (process 0 of a
multi-host job takes it for all):
  local    `RUN_DIR/lease.json` held open under an exclusive `flock`. The kernel drops the lock
           when the holder dies, even by SIGKILL, so a dead run's lease is taken over at once;
           the file then names the holder (host, pid, start time) for the refusal message.
  gs://    the object `RUN_DIR/lease.json`, created and renewed with a generation
           precondition (a write succeeds only over the version this holder last saw) by a
           heartbeat thread every ttl/4, and valid until its `expires` time. An expired lease,
           or one left by a dead pid on this same host, is taken over; a renewal that finds
           another holder's version marks this one lost, and the loop stops at the next step.
A refused start exits 2 with one line naming the holder and `--force`, for when the holder is
known to be dead (another host's process on a shared file system, or an unexpired object).
Locally `--force` never takes over from a lock this kernel holds for a live process; a holder
on another host sharing the file system sees the new holder's token at its next step (it
re-reads lease.json then) and stops without writing more.
"""

import datetime
import fcntl
import json
import os
import socket
import threading
import time
import uuid

import tensorstore as ts

from maxlm import MaxlmError, io
from maxlm.parallel import distributed

NAME = "lease.json"
_MISSING = b"\x02"  # the generation TensorStore reports for a key with no value
FORCE_TRIES = 8  # a forced take-over re-reads and writes again if the lease changed between


def ttl_seconds():
  return float(os.environ.get("MAXLM_LEASE_TTL", "120"))


def _holder():
  return {"host": socket.gethostname(), "pid": os.getpid(), "token": uuid.uuid4().hex,
          "start": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _read_holder(text):
  try:
    holder = json.loads(text or "{}")
  except ValueError:
    return {}
  return holder if isinstance(holder, dict) else {}


def _describe(holder):
  if not holder.get("pid"):
    return "another process (its lease.json does not say which)"
  return (f"pid {holder.get('pid')} on host {holder.get('host')} (started "
          f"{holder.get('start')})")


def _refuse(run_dir, holder, extra=""):
  raise MaxlmError(f"run_dir {run_dir} is in use by {_describe(holder)}{extra}; stop that run "
                   "first, or, if it is dead, rerun with --force to take the run_dir over")


class Lease:
  """Held from `acquire()` until `release()`; `lost` is set if another holder took it."""

  def __init__(self, run_dir):
    self.run_dir = str(run_dir)
    self.holder = _holder()
    self.lost = None
    self._file = None
    self._generation = None
    self._stop = threading.Event()
    self._thread = None

  def acquire(self, force=False):
    if io.is_local(self.run_dir):
      self._acquire_local(force)
    else:
      self._acquire_object(force)
    return self

  def check(self):
    if self._file is not None and not self.lost:
      self._check_local()
    if self.lost:
      raise MaxlmError(f"lost the lease on run_dir {self.run_dir} to {self.lost}; this run "
                       "stopped without saving so as not to overwrite the other's checkpoints")

  def release(self):
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=5)
    if self._file is not None:
      fcntl.flock(self._file, fcntl.LOCK_UN)
      self._file.close()
      self._file = None
    elif self._generation is not None and not self.lost:
      try:  # delete only our own version
        self._kv().write(NAME, None, if_equal=self._generation).result()
      except Exception:  # the lease expires by itself
        pass
    self._generation = None

  # local: an flock the kernel releases when the holder dies
  def _acquire_local(self, force):
    path = os.path.join(self.run_dir, NAME)
    try:
      fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
      raise MaxlmError(f"{path} cannot be opened as the run_dir's lease ({e.strerror}); it must "
                       "be a regular file: remove it if it is not") from None
    f = os.fdopen(fd, "r+")
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      holder = _read_holder(f.read())
      f.close()
      if not force:
        _refuse(self.run_dir, holder)
      if holder.get("host") in (None, socket.gethostname()):  # the kernel says it is alive
        raise MaxlmError(f"run_dir {self.run_dir} is in use by {_describe(holder)}, which is "
                         "alive on this host: --force takes over only from a dead run")
      f = os.fdopen(os.open(path, os.O_RDWR | os.O_NOFOLLOW), "r+")  # another host's, on a
      # shared file system whose locks do not reach us: that holder sees the new token and stops
    f.seek(0)
    f.truncate()
    f.write(json.dumps(self.holder))
    f.flush()
    self._file = f

  def _check_local(self):
    """Sets `lost` when lease.json names another holder (taken over with --force)."""
    try:
      with open(os.path.join(self.run_dir, NAME)) as f:
        now = _read_holder(f.read())
    except OSError:
      return
    if now.get("token") not in (None, self.holder["token"]):
      self.lost = _describe(now)

  # object store: a conditionally written object with an expiry, renewed by a heartbeat
  def _kv(self):
    return ts.KvStore.open(self.run_dir.rstrip("/") + "/", context=io.CONTEXT).result()

  def _record(self):
    return json.dumps({**self.holder, "expires": time.time() + ttl_seconds()}).encode()

  def _acquire_object(self, force):
    kv = self._kv()
    for _ in range(FORCE_TRIES if force else 1):  # forced: a live holder's beat may land
      found = kv.read(NAME).result()               # between our read and our write
      if found.state == "value":
        other = _read_holder(found.value) or {"expires": 0}
        left = float(other.get("expires", 0)) - time.time()
        dead_here = (other.get("host") == socket.gethostname()
                     and not io.process_alive(int(other.get("pid", -1))))
        if left > 0 and not dead_here and not force:
          _refuse(self.run_dir, other, f", lease expires in {left:.0f} s")
      written = kv.write(NAME, self._record(), if_equal=found.stamp.generation).result()
      if written.generation:
        break
    else:
      now = kv.read(NAME).result()
      holder = _read_holder(now.value) if now.state == "value" else {}
      _refuse(self.run_dir, holder, " (it took the lease at the same moment)")
    self._generation = written.generation
    self._thread = threading.Thread(target=self._heartbeat, daemon=True, name="maxlm-lease")
    self._thread.start()

  def _heartbeat(self):
    kv = self._kv()
    while not self._stop.wait(ttl_seconds() / 4):
      try:
        written = kv.write(NAME, self._record(), if_equal=self._generation).result()
      except Exception:  # a transient store error: try again at the next beat
        continue
      if not written.generation:
        now = kv.read(NAME).result()
        self.lost = _describe(_read_holder(now.value)) if now.state == "value" else "nobody"
        return
      self._generation = written.generation


def acquire(run_dir, primary, force=False):
  """The run_dir's lease for process 0 (an inert one for the others). In a multi-process job
  the others wait for process 0's verdict, and stop with its one line when it was refused
  (rather than wait in the first collective for a process 0 that has left)."""
  lease = Lease(run_dir)
  if primary:
    distributed.agree("lease", lambda: lease.acquire(force))
  else:
    distributed.agree("lease", None)
  return lease

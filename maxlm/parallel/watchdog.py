"""Peer death: when a process of a multi-process job dies, the others exit in bounded time with
one line naming it, instead of waiting in a collective forever.

Each process runs a thread that every few seconds writes its own heartbeat counter into the
JAX distributed client's key-value store and reads its peers'. A peer whose counter has not
moved for MAXLM_PEER_TIMEOUT seconds (default 100; at most one 5 s beat more) is lost: it prints
  maxlm train: error: lost process 1 of 2 (no heartbeat for 100 s; MAXLM_PEER_TIMEOUT=100) ...
and exits at once with EXIT_LOST (75, EX_TEMPFAIL: rerun to resume), without the atexit
shutdown barrier that would wait for the dead peer. A process that stops on an error
publishes that error first, and its peers exit with it at their next beat
("process 1 stopped: ...") rather than waiting out the timeout; one that finishes normally
says so, and is not missed. Leaving on an error, process 0 goes last (the others say they are
leaving; it waits a few seconds at most), since its exit would make JAX abort the others.

Why a thread of our own rather than JAX's heartbeat (`heartbeat_timeout_seconds`): JAX does
detect a dead peer, but ends the survivors with SIGABRT, a C++ fatal log and a stack trace;
ours fires first (JAX's timeout is set to ours plus a margin in `distributed.initialize`) and
says which process was lost. Liveness is judged from a thread, not from step progress, so a
long compile or checkpoint save is never mistaken for a death.

Process 0 is the exception: it hosts the coordination service, and when it dies JAX's client
in every other process ends that process itself within a second (SIGABRT, exit 134, with
JAX's "Terminating process because the JAX distributed service detected fatal errors" log).
That is bounded, but not our one line: the client's `missed_heartbeat_callback`, which would
replace it, cannot be used from Python in this jaxlib (calling it fails converting the status,
std::bad_cast). Should the store stop answering without that (a hung coordinator), the
watchdog reports the coordinator lost after four beats.
"""

import atexit
import contextlib
import os
import sys
import threading
import time

import jax

from maxlm import MaxlmError
from maxlm.parallel import distributed

EXIT_LOST = 75
_PREFIX = "maxlm/watchdog/"


class Watchdog:

  def __init__(self, timeout, log_prefix="maxlm train"):
    self.timeout = timeout
    self.beat = max(0.5, min(5.0, timeout / 4))
    self.me, self.n = jax.process_index(), jax.process_count()
    self.prefix = log_prefix
    self.client = distributed.client()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True, name="maxlm-watchdog")

  def start(self):
    self._set("alive", "0")
    self._thread.start()
    return self

  def _set(self, what, value):
    self.client.key_value_set(f"{_PREFIX}{what}/{self.me}", value, allow_overwrite=True)

  def _run(self):
    seen = {p: (None, time.monotonic()) for p in range(self.n) if p != self.me}
    failing_since = None
    count = 0
    while not self._stop.wait(self.beat):
      count += 1
      try:
        self._set("alive", str(count))
        ended = dict(self.client.key_value_dir_get(f"{_PREFIX}end/"))
        for p in list(seen):
          verdict = ended.get(f"{_PREFIX}end/{p}")
          if verdict == "done":
            del seen[p]
          elif verdict is not None:
            self._exit(f"process {p} of {self.n} stopped: {verdict}", announce=True)
          value = self.client.key_value_try_get(f"{_PREFIX}alive/{p}")
          if value != seen[p][0]:
            seen[p] = (value, time.monotonic())
        failing_since = None
      except Exception as e:  # noqa: BLE001 (the store is process 0's: it may be gone)
        if self._stop.is_set():
          return
        if "NOT_FOUND" in str(e):
          continue
        failing_since = failing_since or time.monotonic()
        if time.monotonic() - failing_since >= min(self.timeout, 4 * self.beat):
          self._exit(f"lost the coordinator, process 0 of {self.n} (its key-value store stopped "
                     f"answering: {str(e).splitlines()[0][:120]})")
        continue
      now = time.monotonic()
      for p, (_, since) in seen.items():
        if now - since > self.timeout:
          self._exit(f"lost process {p} of {self.n} (no heartbeat for {now - since:.0f} s; "
                     f"MAXLM_PEER_TIMEOUT={self.timeout:g})", announce=True, lost=(p,))

  def _exit(self, what, announce=False, lost=()):
    if self._stop.is_set():
      return
    print(f"{self.prefix}: error: {what}; process {self.me} exits: rerun the job to resume "
          "from the last checkpoint", file=sys.stderr, flush=True)
    self.leave(EXIT_LOST, announce, lost)

  def leave(self, code, announce=True, lost=()):
    """Exits now, skipping JAX's shutdown barrier. Process 0 hosts the coordination service,
    and JAX aborts every process still connected when it goes (SIGABRT and a C++ log): so
    the others say they are leaving, and process 0 waits for that (a few seconds at most)
    before it leaves last."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
      if self.me and announce:
        self._set("exited", "1")
      elif not self.me:
        end = time.monotonic() + min(self.timeout, 30)
        want = {f"{_PREFIX}exited/{p}" for p in range(1, self.n) if p not in lost}
        while time.monotonic() < end:
          if want <= {k for k, _ in self.client.key_value_dir_get(f"{_PREFIX}exited/")}:
            break
          time.sleep(0.05)
    except Exception:  # noqa: BLE001 (the service is gone: nothing left to wait for)
      pass
    os._exit(code)

  def join(self, seconds):
    """Waits up to `seconds` for the watchdog to end this process over a lost peer."""
    self._thread.join(timeout=seconds)

  def finish(self, error=None):
    """Says how this process ends (done, or the error's one line) and stops beating."""
    self._stop.set()
    try:
      self._set("end", "done" if error is None else error)
    except Exception:  # noqa: BLE001 (the coordinator is gone: the peers find out themselves)
      pass
    if self._thread.is_alive() and self._thread is not threading.current_thread():
      self._thread.join(timeout=2 * self.beat)


def _exit_code(e):  # as maxlm.cli reports it
  if isinstance(e, MaxlmError):
    return 2
  return 130 if isinstance(e, KeyboardInterrupt) else 1


def _describe(e):
  if isinstance(e, MaxlmError):
    return str(e).splitlines()[0] if str(e) else type(e).__name__
  if isinstance(e, KeyboardInterrupt):
    return "interrupted"
  return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


@contextlib.contextmanager
def watched():
  """The watchdog for the duration of a multi-process command (nothing for one process). On
  an error, the peers are told, and this process skips JAX's shutdown barrier at exit, which
  would wait for peers that are already leaving."""
  if not distributed.multi():
    yield
    return
  dog = Watchdog(distributed.peer_timeout()).start()
  try:
    yield
  except BaseException as e:
    if not isinstance(e, (MaxlmError, KeyboardInterrupt)):
      # a collective that failed because a peer died (gloo: "connection reset"): let the
      # watchdog name the peer, which it does within the timeout, rather than report this
      dog.join(dog.timeout + 2 * dog.beat)
    dog.finish(_describe(e))
    code = _exit_code(e)
    atexit.register(dog.leave, code)  # after maxlm.cli printed the error
    raise
  dog.finish()

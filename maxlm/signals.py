"""How maxlm's commands end on signals and stray exceptions: one line, never a traceback.

1. From the first line of `maxlm.cli`, when run as the command, Ctrl-C or SIGTERM exits at
   once with one line (`install_early`): heavy imports run under this, since a
   KeyboardInterrupt inside a C extension's import could crash the interpreter at exit.
2. While a command runs (`running`), Ctrl-C raises KeyboardInterrupt and SIGTERM does too
   (training installs its own handlers that save first); the CLI prints "interrupted". A
   Python handler runs only once the main thread is back in the interpreter, which a long XLA
   compile, a device wait or a library's native lock can delay for minutes: so a SIGTERM that
   the main thread has not taken within GRACE_S ends the process from a watcher thread (woken
   by the signal's wakeup fd), with the same line and exit code. Not while training (its own
   handler saves first), and not once the handler has run (cleanup is then under way).
3. Orbax's background threads, after a failed checkpoint write, leave "Event loop is closed"
   errors and abandoned coroutines that Python would print as tracebacks; the failure itself
   is reported as one line, so these are dropped (MAXLM_DEBUG=1 keeps them). A Ctrl-C that
   lands in a garbage-collector callback, which would swallow it, is delivered again.
"""

import _thread
import contextlib
import inspect
import os
import signal
import sys
import threading
import time

_finished = False
_taken = False  # the main thread has run the SIGTERM handler (a KeyboardInterrupt is on its way)
GRACE_S = 5.0  # how long a SIGTERM waits for the main thread before the watcher ends the process
INTERRUPTED = 130  # the exit code of an interrupted command (cli._dispatch's, for Ctrl-C too)
PAUSE_ENV = "MAXLM_PAUSE_NATIVE"  # tests only: `pause_native`


def _interrupted_early(signum, _):
  if _finished:  # the command is only exiting
    return
  print(f"maxlm: interrupted by {signal.Signals(signum).name} while starting", file=sys.stderr)
  os._exit(128 + signum)


def install_early():
  """Also unblocks the two signals: one that a launcher held back until now (as the tests do,
  to aim a signal at our start-up rather than at the interpreter's) arrives here, handled."""
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, _interrupted_early)
  signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM))


def _terminated(signum, _):
  global _taken
  _taken = True
  raise KeyboardInterrupt  # SIGTERM outside training (which saves first) ends like Ctrl-C


class _Watcher:
  """Reads the signals' wakeup fd in a thread of its own; see step 2 of the docstring."""

  def __init__(self, name):
    self.name = name
    self.read_fd, self.write_fd = os.pipe()
    os.set_blocking(self.write_fd, False)
    self.old_fd = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
    threading.Thread(target=self._watch, daemon=True, name="maxlm-sigterm").start()

  def _watch(self):
    try:
      while data := os.read(self.read_fd, 64):
        if signal.SIGTERM in data and signal.getsignal(signal.SIGTERM) is _terminated:
          self._end_unless_taken()
    finally:
      os.close(self.read_fd)

  def _end_unless_taken(self):
    give_up = time.monotonic() + GRACE_S
    while not _taken and time.monotonic() < give_up:
      time.sleep(0.05)
    if not _taken and not _finished:
      print(f"maxlm {self.name}: interrupted", file=sys.stderr, flush=True)
      os._exit(INTERRUPTED)

  def close(self):
    signal.set_wakeup_fd(self.old_fd)
    os.close(self.write_fd)  # the watcher reads the end of its pipe and closes the other end


def _closed_loop_noise(value):
  return isinstance(value, RuntimeError) and "Event loop is closed" in str(value)


def _quiet_excepthook(kind, value, tb, _default=sys.excepthook):
  if not _closed_loop_noise(value):
    _default(kind, value, tb)


def _quiet_unraisablehook(unraisable, _default=sys.unraisablehook):
  if isinstance(unraisable.exc_value, KeyboardInterrupt):  # swallowed by a gc callback:
    threading.Timer(0.01, _thread.interrupt_main).start()  # deliver it once this returns
  elif not (_closed_loop_noise(unraisable.exc_value)
            or inspect.iscoroutine(unraisable.object)):
    _default(unraisable)


@contextlib.contextmanager
def running(name="command", watch=True):
  """Step 2 and 3 for the duration of command `name`; the previous handlers after it. `watch`:
  end the process on a SIGTERM the main thread does not take (off for training)."""
  global _finished, _taken
  handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
  signal.signal(signal.SIGINT, signal.default_int_handler)
  signal.signal(signal.SIGTERM, _terminated)
  _finished = _taken = False
  watcher = _Watcher(name) if watch and threading.current_thread() is threading.main_thread() \
      else None
  if not os.environ.get("MAXLM_DEBUG"):
    sys.excepthook, sys.unraisablehook = _quiet_excepthook, _quiet_unraisablehook
  try:
    yield
  finally:
    _finished = True
    if watcher is not None:
      watcher.close()
    for sig, handler in handlers.items():
      signal.signal(sig, handler)


def pause_native(seconds=600):
  """Tests only: with MAXLM_PAUSE_NATIVE=FILE, blocks the main thread in native code (a mutex
  another thread holds: no signal interrupts the wait, as in a long XLA call) after creating
  FILE, for at most `seconds`; then creates FILE.over and returns."""
  path = os.environ.get(PAUSE_ENV)
  if not path:
    return
  import ctypes
  libc = ctypes.CDLL(None, use_errno=True)
  mutex, held = ctypes.create_string_buffer(64), threading.Event()  # zeros: an unlocked mutex

  def hold():
    libc.pthread_mutex_lock(mutex)
    held.set()
    threading.Event().wait()
  threading.Thread(target=hold, daemon=True).start()
  held.wait()

  class Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]
  with open(path, "w"):
    pass
  libc.pthread_mutex_timedlock(mutex, ctypes.byref(Timespec(int(time.time()) + seconds, 0)))
  with open(path + ".over", "w"):
    pass

"""How maxlm's commands end on signals and stray exceptions: one line, never a traceback.

1. From the first line of `maxlm.cli`, when run as the command, Ctrl-C or SIGTERM exits at
   once with one line (`install_early`): heavy imports run under this, since a
   KeyboardInterrupt inside a C extension's import could crash the interpreter at exit.
2. While a command runs (`running`), Ctrl-C raises KeyboardInterrupt and SIGTERM does too
   (training installs its own handlers that save first); the CLI prints "interrupted".
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

_finished = False


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
  raise KeyboardInterrupt  # SIGTERM outside training (which saves first) ends like Ctrl-C


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
def running():
  """Step 2 and 3 for the duration of a command; the previous handlers after it."""
  global _finished
  handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
  signal.signal(signal.SIGINT, signal.default_int_handler)
  signal.signal(signal.SIGTERM, _terminated)
  if not os.environ.get("MAXLM_DEBUG"):
    sys.excepthook, sys.unraisablehook = _quiet_excepthook, _quiet_unraisablehook
  try:
    yield
  finally:
    _finished = True
    for sig, handler in handlers.items():
      signal.signal(sig, handler)

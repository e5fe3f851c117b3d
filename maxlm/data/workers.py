"""The worker processes of `maxlm prepare`: how many, and how they live and die.

- `count(requested, log)`: at most the cores this process may run on and one worker per
  `WORKER_BYTES` of available memory (each forked worker grows its own copy of what it
  touches: the tokenizer, the documents in flight); a `--workers` above that is capped with a
  one-line note, so a huge value cannot set off the machine's out-of-memory killer.
- `pool(n, initializer, args)`: a fork pool whose workers never print a KeyboardInterrupt
  traceback and never outlive prepare. SIGINT and SIGTERM are blocked in the parent while the
  workers fork (a Ctrl-C in that window would otherwise reach a worker before it ignores it);
  each worker then ignores SIGINT (the parent handles Ctrl-C and terminates the pool), takes
  SIGTERM's default (terminate() ends it quietly), asks the kernel for SIGTERM when its parent
  dies (Linux PR_SET_PDEATHSIG: a SIGKILLed prepare leaves no orphan). Every forked child
  (datatrove's too) closes its copies of the parent's `lock_files`, so none holds `--out`'s lock.
"""

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import weakref

WORKER_BYTES = 512 * 2**20  # memory a worker may come to hold on a large corpus
_SIGNALS = {signal.SIGINT, signal.SIGTERM}
_PR_SET_PDEATHSIG = 1
lock_files = weakref.WeakSet()  # open files whose flock a forked worker must not keep


def cores():
  try:
    return len(os.sched_getaffinity(0))
  except (AttributeError, OSError):
    return os.cpu_count() or 1


def available_bytes():
  """MemAvailable (Linux), else None."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  return None


def count(requested=None, log=print):
  """Workers to start: `requested` (None: as many as fit) capped by cores and memory."""
  n_cores, free = cores(), available_bytes()
  by_memory = max(1, free // WORKER_BYTES) if free is not None else n_cores
  most = max(1, min(n_cores, by_memory))
  if requested is None:
    return most
  if requested > most:
    why = (f"{n_cores} cores" if most == n_cores else
           f"{free / 2**30:.1f} GiB available at {WORKER_BYTES // 2**20} MiB a worker")
    log(f"note: --workers {requested} capped at {most} ({why})")
    return most
  return requested


def _set_parent_death_signal():
  if not sys.platform.startswith("linux"):
    return
  try:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
  except (OSError, AttributeError):
    pass


def _close_lock_files():
  for file in list(lock_files):
    try:
      file.close()  # this copy only: the parent's flock stays held
    except OSError:
      pass


os.register_at_fork(after_in_child=_close_lock_files)  # any fork: our pools, datatrove's


def _start(parent, initializer, args):
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  signal.signal(signal.SIGTERM, signal.SIG_DFL)
  _set_parent_death_signal()
  signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)
  if os.getppid() != parent:  # the parent died before the death signal was asked for
    os._exit(1)
  if initializer is not None:
    initializer(*args)


@contextlib.contextmanager
def pool(n, initializer=None, args=()):
  """A `multiprocessing` fork Pool of `n` workers, set up as the module docstring says;
  terminated on leaving."""
  blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
  try:
    workers = multiprocessing.get_context("fork").Pool(n, _start,
                                                       (os.getpid(), initializer, args))
  finally:
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
  with workers:
    yield workers

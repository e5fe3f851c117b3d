"""When training stops early on a signal: save a checkpoint, then exit 0.

One process: SIGTERM or SIGINT sets a flag, and the loop saves after the step in flight.

Several processes: a maintenance event or spot preemption may SIGTERM one host before the
others, and every process must save the same step. JAX's preemption sync manager (started by
`jax.distributed.initialize`; Orbax's CheckpointManager consults the same one) catches SIGTERM
in C++ and, once any process has it, makes `reached_preemption_sync_point(step)` return True
on every process at the same step. So here no Python SIGTERM handler is installed (one would
replace JAX's), and Ctrl-C is forwarded to this process as SIGTERM so that it takes the same
agreed path. The loop asks `stop_at(step)` after every step, on every process, with the same
step number, as the protocol requires.
"""

import os
import signal

import jax

from maxlm.parallel import distributed


class Preemption:

  def __init__(self):
    self.signal = None
    self.multi = distributed.multi()
    self._old = {}
    wanted = {signal.SIGINT: self._forward} if self.multi else {
        signal.SIGTERM: self._handle, signal.SIGINT: self._handle}
    for sig, handler in wanted.items():
      try:
        self._old[sig] = signal.signal(sig, handler)
      except ValueError:  # not the main thread
        pass

  def _handle(self, signum, _):
    self.signal = signal.Signals(signum).name

  def _forward(self, signum, _):
    self.signal = signal.Signals(signum).name
    os.kill(os.getpid(), signal.SIGTERM)

  def stop_at(self, step):
    """Whether to save at global step `step` and stop (called by every process every step)."""
    if not self.multi:
      return self.signal is not None
    from jax.experimental import multihost_utils
    if multihost_utils.reached_preemption_sync_point(step):
      self.signal = self.signal or "SIGTERM"
      return True
    return False

  def reason(self):
    if self.multi and self.signal:
      return f"{self.signal}, saved at the step all {jax.process_count()} processes agreed on"
    return self.signal

  def restore(self):
    for sig, old in self._old.items():
      signal.signal(sig, old)

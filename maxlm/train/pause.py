"""A pause at a known step, for the tests and `maxlm verify-restart` (not a user setting).

A test that signals or kills a tiny job races it: the job may finish before the test's next
action lands. With `MAXLM_PAUSE_AFTER=STEP:FILE` in its environment the job, after logging
global step STEP (and starting that step's save, when one is due), waits until FILE exists or
a stop is requested, so the signal or kill always finds it there. A stop is requested when:
  one process    SIGINT or SIGTERM reached it (the loop then saves at the next step);
  several        every process has entered JAX's preemption sync protocol (each has sent its
                 step counter to the coordination service under the lock that blocks its next
                 `reached_preemption_sync_point`), so all of them agree on the next step.
A job whose peer dies while paused is ended by the watchdog as at any other moment.
"""

import os
import time

ENV = "MAXLM_PAUSE_AFTER"
# where JAX's preemption sync manager (xla/tsl/distributed_runtime/preemption) puts each
# process's step counter once it has the preemption notice
_COUNTERS = "PREEMPTION_CURRENT_COUNTER/"


def parse(env=None):
  """(step, file) from MAXLM_PAUSE_AFTER, or None when unset."""
  value = (os.environ if env is None else env).get(ENV)
  if not value:
    return None
  step, _, path = value.partition(":")
  return int(step), path


def _agreed_to_stop():
  import jax
  from maxlm.parallel import distributed
  return len(distributed.client().key_value_dir_get(_COUNTERS)) >= jax.process_count()


def maybe_wait(step, preempt, poll=0.01):
  """Blocks after global step `step` when MAXLM_PAUSE_AFTER names it (see the docstring)."""
  wanted = parse()
  if wanted is None or wanted[0] != step:
    return
  while not os.path.exists(wanted[1]):
    if (preempt.signal is not None) if not preempt.multi else _agreed_to_stop():
      return
    time.sleep(poll)

"""Stopping early on a signal in one process (maxlm/parallel/preemption.py): SIGTERM or SIGINT
sets the flag the loop asks after each step, the reason names the signal, and restore() puts
the handlers back. The several-process path (JAX's preemption sync point) runs in
tests/test_multiprocess.py; whole runs stopped by SIGTERM in tests/test_train.py."""

import os
import signal

import pytest

from maxlm.parallel import preemption


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_at_the_next_step_and_restore_puts_the_handlers_back(sig):
  before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
  stop = preemption.Preemption()
  try:
    assert not stop.multi and stop.reason() is None
    assert not stop.stop_at(0)
    os.kill(os.getpid(), sig)
    assert stop.stop_at(1) and stop.stop_at(2)
    assert stop.reason() == sig.name
  finally:
    stop.restore()
  assert {s: signal.getsignal(s) for s in before} == before

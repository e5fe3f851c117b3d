"""Step numbering and what is due when (maxlm/train/schedule.py), against a direct count."""

import types

import pytest
from hypothesis import given, strategies as st

from maxlm import MaxlmError
from maxlm.train import schedule


def _config(lengths, checkpoint_every, eval_every):
  stages = [types.SimpleNamespace(num_steps=n) for n in lengths]
  train = types.SimpleNamespace(checkpoint_every=checkpoint_every, eval_every=eval_every)
  return types.SimpleNamespace(stages=stages, train=train)


schedules = st.tuples(st.lists(st.integers(1, 9), min_size=1, max_size=4), st.integers(1, 7),
                      st.integers(0, 5))


@given(schedules)
def test_every_global_step_is_one_stage_step_in_order(drawn):
  lengths, every, evals = drawn
  sched = schedule.Schedule(_config(lengths, every, evals))
  walked = [(s, k) for s, n in enumerate(lengths) for k in range(n)]
  assert [sched.locate(g) for g in range(sched.total)] == walked
  assert all(sched.offset(s) + k == g for g, (s, k) in enumerate(walked))
  with pytest.raises(MaxlmError, match=f"global steps 0..{sched.total - 1}"):
    sched.locate(sched.total)


@given(schedules)
def test_saves_at_stage_ends_and_every_n_updates_evals_every_m(drawn):
  lengths, every, evals = drawn
  sched = schedule.Schedule(_config(lengths, every, evals))
  ends = {sum(lengths[:s + 1]) - 1 for s in range(len(lengths))}
  # checkpoint g + 1 holds g + 1 updates: saved when every divides the updates, or at an end
  want = [g for g in range(sched.total) if (g + 1) % every == 0 or g in ends]
  assert sched.save_steps() == want
  assert sched.stage_ends() == ends
  assert all(sched.saves(g, stopping=True) for g in range(sched.total))
  assert [g for g in range(sched.total) if sched.evaluates(g)] == (
      [g for g in range(sched.total) if (g + 1) % evals == 0] if evals else [])


def test_due_counts_updates_not_indices():
  assert [g for g in range(10) if schedule.due(g, 4)] == [3, 7]
  assert not any(schedule.due(g, 0) for g in range(10))

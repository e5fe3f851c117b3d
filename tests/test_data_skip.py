"""`data.skip_steps` (maxlm/data/skip.py): ranges cut at stage boundaries, step k -> the plan's
batch it trains on, each stage's plan extended by what it skips, and resumes only from a
checkpoint the new ranges do not reach back past."""

import pytest

from maxlm import MaxlmError
from maxlm.data import skip
from maxlm.typed_yaml import ConfigError

import datagen


def _config(skip_steps, steps=(10, 10)):
  return datagen.make_config([{"seq_len": 32, "batch": 2, "steps": n} for n in steps],
                             {"skip_steps": [list(r) for r in skip_steps]})


def test_a_range_is_cut_at_stage_boundaries_and_counted_in_stage_steps():
  config = _config([(3, 5), (8, 13), (18, 40)])
  assert skip.stage_ranges(config, 0) == [(3, 5), (8, 10)]
  assert skip.stage_ranges(config, 1) == [(0, 3), (8, 10)]


def test_step_k_trains_on_the_kth_batch_not_skipped():
  stage = skip.StageSkips(_config([(3, 5), (8, 10)]), 0)
  assert stage.skipped == 4
  assert [stage(k) for k in range(10)] == [0, 1, 2, 5, 6, 7, 10, 11, 12, 13]


def test_the_planner_sees_each_stage_extended_by_its_skips():
  plain = _config([])
  assert skip.planning_config(plain) is plain
  planned = skip.planning_config(_config([(3, 5), (8, 13)]))
  assert [st.num_steps for st in planned.stages] == [14, 13]
  with pytest.raises(ConfigError, match=r"range \[20, 22\] starts after the schedule's last "
                                        r"step \(19\)"):
    skip.planning_config(_config([(20, 22)]))


def test_a_resume_may_not_change_the_skips_before_its_checkpoint():
  config = _config([(3, 5), (12, 14)])
  skip.check_resume(config, [(3, 5)], 12)  # a range added at the checkpoint
  skip.check_resume(config, [(3, 5), (15, 16)], 12)  # a later range changed
  with pytest.raises(MaxlmError, match=r"checkpoint 6 was trained with skips none before it, "
                                       r"this config has \[\[3, 5\]\]"):
    skip.check_resume(config, [], 6)

"""`data.skip_steps`: global steps whose batches are not trained on (after a loss spike).

A range [a, b) names global steps as metrics.jsonl numbers them (0-based, counting across
stages) in the run *without* the range: the batches those steps would have trained on are
skipped, and training goes on with the batches after them. Every stage keeps its `steps`
optimizer steps (so the learning-rate schedule, checkpoint numbers and stage boundaries do
not move); a stage that skips n batches draws n more from its plan, which it extends by n
batches. So with [[100, 300]] inside one stage, step 99 trains on batch 99 as before and step
100 on the batch step 300 would have had.

A range is cut at stage boundaries and each stage skips its part, counted in its own steps:
stage s covers global steps [o_s, o_s + steps_s), and its step k trains on its plan's batch
`plan_step(k)`, the k-th batch not skipped. The next stage's plan starts where the (extended)
plan of this one ended, so stages after a skip see other documents than without it.

A skip changes only the steps at or after its start: steps before it, and their checkpoints,
are those of the run without it, so a run resumes with a new range from any checkpoint at or
before the range's start (`check_resume`), bit for bit as a run that had the range from step 0.
"""

import bisect
import dataclasses

from maxlm import MaxlmError
from maxlm.typed_yaml import ConfigError


def stage_ranges(config, s):
  """Stage s's part of data.skip_steps, in its own step numbers, sorted."""
  first = sum(st.num_steps for st in config.stages[:s])
  last = first + config.stages[s].num_steps
  return [(max(a, first) - first, min(b, last) - first)
          for a, b in sorted(config.data.skip_steps) if a < last and b > first]


class StageSkips:
  """Stage step k -> the index of the batch of the stage's plan it trains on (picklable)."""

  def __init__(self, config, s):
    self.ranges = stage_ranges(config, s)
    self.skipped = sum(b - a for a, b in self.ranges)

  def __call__(self, k):
    for a, b in self.ranges:
      if k >= a:
        k += b - a
    return k


def planning_config(config):
  """The config the planner plans with: each stage's steps extended by the batches it skips.
  Without skips, the config itself."""
  if not config.data.skip_steps:
    return config
  total = sum(st.num_steps for st in config.stages)
  for a, b in config.data.skip_steps:
    if a >= total:
      raise ConfigError(f"data.skip_steps: range [{a}, {b}] starts after the schedule's last "
                        f"step ({total - 1})")
  stages = tuple(dataclasses.replace(st, steps=st.num_steps + StageSkips(config, s).skipped,
                                     tokens=0) for s, st in enumerate(config.stages))
  return dataclasses.replace(config, stages=stages)


def check_resume(config, saved_ranges, step_no):
  """A checkpoint at global step step_no was trained with saved_ranges: the ranges that start
  before it must be this config's too (steps already trained cannot change)."""
  now = sorted(tuple(r) for r in config.data.skip_steps)
  was = sorted(tuple(r) for r in saved_ranges)
  cut = lambda ranges: ranges[:bisect.bisect_left([a for a, _ in ranges], step_no)]
  if cut(now) != cut(was):
    fmt = lambda ranges: [list(r) for r in cut(ranges)] or "none"
    raise MaxlmError(f"data.skip_steps: checkpoint {step_no} was trained with skips "
                     f"{fmt(was)} before it, this config has {fmt(now)}; a skip may only start "
                     f"at or after the checkpoint it resumes from (move the checkpoints after "
                     "the range's start aside: docs/troubleshooting.md)")

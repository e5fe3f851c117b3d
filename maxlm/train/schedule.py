"""Step numbering of a schedule and what is due when: the one place the loop, verify-restart,
trace and resume ask.

Global step g (0-based, as metrics.jsonl's `step`) is step k of stage s, g = offset(s) + k.
After step g the run holds g + 1 updates, so the checkpoint saved then is checkpoint g + 1. A
checkpoint is saved after a stage's last step, after every step g with checkpoint_every
dividing g + 1, and after the step a run stops at; held-out metrics are computed after every
step g with eval_every dividing g + 1.
"""

from maxlm import MaxlmError


def due(g, every):
  """Whether something done every `every` steps (0: never) falls after global step g."""
  return bool(every) and (g + 1) % every == 0


class Schedule:
  """A config's stages laid end to end as global steps."""

  def __init__(self, config):
    self.lengths = [st.num_steps for st in config.stages]
    self.offsets = [sum(self.lengths[:s]) for s in range(len(self.lengths) + 1)]
    self.total = self.offsets[-1]
    self.checkpoint_every = config.train.checkpoint_every
    self.eval_every = config.train.eval_every

  def offset(self, s):
    """The global step of stage s's first step."""
    return self.offsets[s]

  def locate(self, g):
    """(stage, step within it) of global step g."""
    if not 0 <= g < self.total:
      raise MaxlmError(f"step {g}: the schedule has global steps 0..{self.total - 1} (as "
                       "numbered in metrics.jsonl)")
    s = max(i for i in range(len(self.lengths)) if self.offsets[i] <= g)
    return s, g - self.offsets[s]

  def stage_ends(self):
    """The global steps that end a stage."""
    return {self.offsets[s + 1] - 1 for s in range(len(self.lengths)) if self.lengths[s]}

  def saves(self, g, stopping=False):
    """Whether a checkpoint is saved after global step g (stopping: the run stops there)."""
    return stopping or g in self.stage_ends() or due(g, self.checkpoint_every)

  def evaluates(self, g):
    """Whether held-out metrics are computed after global step g."""
    return due(g, self.eval_every)

  def save_steps(self):
    """Every global step after which an uninterrupted run saves, in order."""
    return [g for g in range(self.total) if self.saves(g)]

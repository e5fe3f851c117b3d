"""Loss-spike flags: a step whose loss is far above the trailing statistics of its stage.

The rule: step g is a spike when its training loss > mean + k * std of the losses of the last
N finite steps before it in the same stage (std: the population standard deviation), with
N = train.spike_window and k = train.spike_sigmas, once that window is full. The window starts
empty at each stage's first step, since a new sequence length or mix moves the loss level on
its own; a stage shorter than N + 1 steps is never flagged. The spike step's own loss then
joins the window like any other. A flag is written into that step's metrics.jsonl row as
"spike": {"mean", "std", "threshold", "sigmas"} (one row per step stays one row per step for
every reader; TensorBoard skips it) and `maxlm trace RUN_DIR --spikes` lists them.

Resume-exact: the window is part of each checkpoint's metadata (`state`), so a run killed and
resumed flags the same steps as one that was never interrupted; a checkpoint written before
this existed resumes with an empty window.
"""

import math

import numpy as np


class Detector:
  """Feeds on one loss per step; says whether it is a spike."""

  def __init__(self, window, sigmas, state=None):
    self.window, self.sigmas = window, sigmas
    state = state or {}
    self.stage = state.get("stage")
    self.losses = list(state.get("losses", ()))[-window:] if window else []

  def observe(self, stage, loss):
    """The spike dict if `loss` (of a step of `stage`) is a spike, else None."""
    if stage != self.stage:
      self.stage, self.losses = stage, []
    flag = None
    if self.window and len(self.losses) == self.window and math.isfinite(loss):
      values = np.asarray(self.losses, np.float64)
      mean, std = float(values.mean()), float(values.std())
      threshold = mean + self.sigmas * std
      if loss > threshold:
        flag = {"mean": mean, "std": std, "threshold": threshold,
                "sigmas": (loss - mean) / std if std > 0 else None}
    if self.window and math.isfinite(loss):
      self.losses = (self.losses + [float(loss)])[-self.window:]
    return flag

  def state(self):
    """JSON-able; a Detector built from it continues exactly."""
    return {"stage": self.stage, "losses": list(self.losses)}


def flagged(rows):
  """[(step, row)] of metrics.jsonl rows flagged as spikes, the last row of each step."""
  last = {r["step"]: r for r in rows if "step" in r}
  return [(g, last[g]) for g in sorted(last) if "spike" in last[g]]

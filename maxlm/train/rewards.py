"""GRPO's rewards and advantages: a verifier scores each completion, the group normalizes.

`train.grpo.verify` names the verifier:
  exact | numeric   maxlm/eval/verify.py's rules (the answer extracted from the completion,
                    `<answer>...</answer>` first), reward 1.0 when it matches `gold`, else 0.0;
  module:function   a user function `function(completion: str, gold: str, prompt) -> float`
                    imported from `module` (code tests, format checks, partial credit). A
                    non-finite or non-number return is one error naming the function.

Advantages are group-relative (Shao et al. 2024, GRPO): the G completions of one prompt form a
group, and completion i's advantage is (r_i - mean) / std over its group (the population std).
A group whose rewards are all equal (all right, all wrong) has std 0: its advantages are 0, so
it adds nothing to the policy-gradient term (only the KL term acts on it), and it is counted in
the step's `zero_std_groups` metric. We wrote this instead of borrowing TRL's because our
batches are packed segments (maxlm/train/rollouts.py), not padded [prompts x G] tensors.
"""

import importlib
import math
import numbers

import numpy as np

from maxlm import MaxlmError
from maxlm.eval import verify


def verifier(spec):
  """reward(completion, gold, prompt) -> float for `train.grpo.verify`."""
  if spec in verify.MODES:
    def reward(completion, gold, prompt):
      return float(verify.correct(verify.extract(completion, spec), gold, spec))
    return reward
  module, _, name = spec.partition(":")
  try:
    fn = getattr(importlib.import_module(module), name)
  except Exception as e:  # noqa: BLE001 -- user code: any failure to import is one line
    raise MaxlmError(f"train.grpo.verify={spec}: cannot import {name} from {module} "
                     f"({type(e).__name__}: {e})") from None
  if not callable(fn):
    raise MaxlmError(f"train.grpo.verify={spec}: {module}.{name} is not a function")

  def reward(completion, gold, prompt):
    try:
      value = fn(completion, gold, prompt)
    except Exception as e:  # noqa: BLE001 -- user code
      raise MaxlmError(f"train.grpo.verify={spec} raised {type(e).__name__}: {e} (it is called "
                       "as function(completion, gold, prompt))") from None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not _finite(value):
      raise MaxlmError(f"train.grpo.verify={spec} returned {value!r}; a reward is a finite "
                       "number")
    return float(value)
  return reward


def _finite(value):
  try:
    return math.isfinite(float(value))
  except OverflowError:  # an int beyond float's range
    return False


def _scaled(r, axis=None):
  """r divided by its largest magnitude (per row with axis=1) and that scale: any finite
  rewards' mean and std are then finite (1e308's square is not)."""
  scale = np.abs(r).max(axis=axis, keepdims=True)
  scale = np.where(scale > 0, scale, 1.0)
  return r / scale, scale


def advantages(rewards_PxG):
  """(advantages [P, G] float64, zero-std groups): (r - mean) / std per row, 0 where std is 0.
  Advantages do not change when a group's rewards are scaled, so each row is scaled first."""
  r, _ = _scaled(np.asarray(rewards_PxG, np.float64), axis=1)
  mean = r.mean(axis=1, keepdims=True)
  std = r.std(axis=1, keepdims=True)
  flat = std[:, 0] == 0
  safe = np.where(std > 0, std, 1.0)
  return np.where(std > 0, (r - mean) / safe, 0.0), int(flat.sum())


def moments(rewards):
  """(mean, population std) of all the step's rewards, finite for any finite rewards."""
  r, scale = _scaled(np.asarray(rewards, np.float64).ravel())
  return float(scale[0] * r.mean()), float(scale[0] * r.std())


def pass_at_1(rewards_PxG):
  """The mean fraction of correct samples (reward > 0.5) per prompt: pass@1 by the unbiased
  estimator of maxlm/eval/verify.py."""
  r = np.asarray(rewards_PxG, np.float64)
  return float((r > 0.5).mean()) if r.size else 0.0

"""AdamW with a learning rate that runs continuously across all stages of the schedule.

warmup -> cosine to lr * min_lr_ratio, or warmup -> stable -> linear decay (WSD). WSD's decay
is a share of the whole run, warmup included: its last round(total_steps * decay_fraction)
steps (at least 1, and none before the step at which warmup reaches lr) fall linearly and the
last step's lr is lr * min_lr_ratio. Weight decay skips norm scales and, unless configured,
the embedding table and head. Gradients are clipped to global norm `clip`. With
`optimizer: muon`, Muon updates the layers' matrices instead (maxlm/train/muon.py).
"""

import jax
import optax

from maxlm.train import muon


def lr_schedule(train, total_steps):
  peak, floor = train.lr, train.lr * train.min_lr_ratio
  warmup = min(train.warmup_steps, max(total_steps - 1, 0))
  if train.schedule == "cosine":
    after = optax.cosine_decay_schedule(peak, max(total_steps - warmup, 1),
                                        alpha=train.min_lr_ratio)
  else:
    after = _stable_then_decay(peak, floor, total_steps - 1 - warmup,
                               _decay_steps(train, total_steps, warmup))
  return optax.join_schedules([optax.linear_schedule(peak / max(warmup, 1), peak, warmup),
                               after], [warmup])


def _decay_steps(train, total_steps, warmup):
  """WSD's steps below peak: round(total_steps * decay_fraction), at least 1, at most the steps
  after the one at which warmup reaches peak."""
  after_peak = max(total_steps - 1 - warmup, 0)
  return min(max(round(total_steps * train.decay_fraction), 1), after_peak)


def _stable_then_decay(peak, floor, last, decay):
  """Counted from warmup's end: peak through step last - decay, then linear to floor at `last`."""
  if decay == 0:
    return optax.constant_schedule(peak)
  return optax.join_schedules(
      [optax.constant_schedule(peak), optax.linear_schedule(peak, floor, decay)],
      [last - decay])


def decay_mask(params, decay_embeddings):
  def keep(path, _):
    name = jax.tree_util.keystr(path)
    if "norm" in name:
      return False
    if not decay_embeddings and ("embedding" in name or "'head'" in name):
      return False
    return True
  return jax.tree_util.tree_map_with_path(keep, params)


def make(train, total_steps, names=None, mesh=None):
  """(optax transformation, lr schedule). `names`: the params-shaped tree of logical axis names
  (build.param_names), which `train.optimizer: muon` splits the parameters by; `mesh`: the
  stage's, over whose devices Muon spreads its matrices."""
  schedule = lr_schedule(train, total_steps)
  adamw = optax.adamw(schedule, b1=train.b1, b2=train.b2, eps=train.eps,
                      weight_decay=train.weight_decay,
                      mask=lambda params: decay_mask(params, train.decay_embeddings))
  if train.optimizer == "muon":
    if names is None:
      raise ValueError("train.optimizer muon needs the parameters' logical names")
    adamw = muon.transform(train, schedule, adamw, names, mesh)
  return optax.chain(optax.clip_by_global_norm(train.clip), adamw), schedule

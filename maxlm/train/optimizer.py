"""AdamW with a learning rate that runs continuously across all stages of the schedule.

warmup -> cosine to lr * min_lr_ratio, or warmup -> stable -> linear decay (WSD) over the last
`decay_fraction` of all steps. Weight decay skips norm scales and, unless configured, the
embedding table and head. Gradients are clipped to global norm `clip`.
"""

import jax
import optax


def lr_schedule(train, total_steps):
  peak, floor = train.lr, train.lr * train.min_lr_ratio
  warmup = min(train.warmup_steps, max(total_steps - 1, 0))
  rest = max(total_steps - warmup, 1)
  if train.schedule == "cosine":
    after = optax.cosine_decay_schedule(peak, rest, alpha=train.min_lr_ratio)
  else:
    decay = max(int(rest * train.decay_fraction), 1)
    after = optax.join_schedules(
        [optax.constant_schedule(peak), optax.linear_schedule(peak, floor, decay)],
        [rest - decay])
  return optax.join_schedules([optax.linear_schedule(peak / max(warmup, 1), peak, warmup),
                               after], [warmup])


def decay_mask(params, decay_embeddings):
  def keep(path, _):
    name = jax.tree_util.keystr(path)
    if "norm" in name:
      return False
    if not decay_embeddings and ("embedding" in name or "'head'" in name):
      return False
    return True
  return jax.tree_util.tree_map_with_path(keep, params)


def make(train, total_steps):
  """(optax transformation, lr schedule)."""
  schedule = lr_schedule(train, total_steps)
  return optax.chain(
      optax.clip_by_global_norm(train.clip),
      optax.adamw(schedule, b1=train.b1, b2=train.b2, eps=train.eps,
                  weight_decay=train.weight_decay,
                  mask=lambda params: decay_mask(params, train.decay_embeddings))), schedule

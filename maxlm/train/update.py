"""One optimizer step for every objective: the loss's gradients summed over the step's
micro-batches, divided by the step's count, clipped and applied by the optimizer, the step
counter and rng advanced. The language model (maxlm/train/step.py), DPO (maxlm/train/dpo.py)
and GRPO (maxlm/train/grpo.py) are loss functions over it, so they accumulate and update alike.

A loss is `loss(params, extra, micro) -> (summed loss, (sums, rows))`: `extra` is what the step
holds fixed (the MoE bias, a frozen reference), `sums` a dict of sums over the micro-batch's
positions (its `max_logit` is a maximum), `rows` per-row outputs ([b, ...] arrays, or None).
Summed losses and a division by the step's total count make accumulating micro-batches give
the same gradient as the whole batch.
"""

import typing

import jax
import jax.numpy as jnp
import optax


class Freeze(typing.NamedTuple):
  """Which parameters a stage trains: `grads(g)` zeroes the frozen ones' gradients,
  `keep(new_params, params, new_opt, opt)` carries the frozen ones and their moments over."""
  grads: typing.Callable
  keep: typing.Callable


def combine(a, b):
  """Two micro-batches' sums: the max logit is a max, everything else adds."""
  return {k: (jnp.maximum(a[k], b[k]) if k == "max_logit" else
              jax.tree_util.tree_map(jnp.add, a[k], b[k])) for k in a}


def accumulate(grad_fn, params, extra, batch, grad_accum):
  """(gradients, sums, rows) of grad_fn(params, extra, micro) over `grad_accum` equal
  micro-batches of `batch`, in order; rows come back as one [B, ...] batch."""
  if grad_accum == 1:
    grads, (sums, rows) = grad_fn(params, extra, batch)
    return grads, sums, rows
  micro = jax.tree_util.tree_map(
      lambda x: x.reshape(grad_accum, x.shape[0] // grad_accum, *x.shape[1:]), batch)
  first = jax.tree_util.tree_map(lambda x: x[0], micro)
  sum_shapes = jax.eval_shape(grad_fn, params, extra, first)[1][0]
  zero_sums = {k: (jnp.float32(-jnp.inf) if k == "max_logit" else
                   jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), v))
               for k, v in sum_shapes.items()}

  def add(carry, mb):
    grads, sums = carry
    g, (s, rows) = grad_fn(params, extra, mb)
    return (jax.tree_util.tree_map(jnp.add, grads, g), combine(sums, s)), rows

  zero = (jax.tree_util.tree_map(jnp.zeros_like, params), zero_sums)
  (grads, sums), rows = jax.lax.scan(add, zero, micro)
  rows = jax.tree_util.tree_map(lambda x: x.reshape(-1, *x.shape[2:]), rows)
  return grads, sums, rows


def make_step(loss, opt, schedule, grad_accum, *, count, floor=1.0, freeze=None):
  """step(state, batch, extra) -> (state, metrics, sums, rows): one update by `loss`, its
  gradients divided by max(sums[count], floor). metrics holds what every objective reports
  (lr, grad_norm, param_norm, max_logit); the objective adds its own from `sums`."""
  grad_fn = jax.grad(loss, has_aux=True)

  def step(state, batch, extra):
    params = state["params"]
    grads, sums, rows = accumulate(grad_fn, params, extra, batch, grad_accum)
    n = jnp.maximum(sums[count], floor)
    grads = jax.tree_util.tree_map(lambda g: g / n, grads)
    if freeze is not None:
      grads = freeze.grads(grads)
    updates, opt_state = opt.update(grads, state["opt_state"], params)
    new_params = optax.apply_updates(params, updates)
    if freeze is not None:
      new_params, opt_state = freeze.keep(new_params, params, opt_state, state["opt_state"])
    metrics = {"lr": schedule(state["step"]), "grad_norm": optax.global_norm(grads),
               "param_norm": optax.global_norm(new_params), "max_logit": sums["max_logit"]}
    rng = jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(state["rng"]),
                                                 state["step"]))
    new_state = {**state, "params": new_params, "opt_state": opt_state,
                 "step": state["step"] + 1, "rng": rng}
    return new_state, metrics, sums, rows

  return step

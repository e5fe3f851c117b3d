"""The train state and the jitted step (with gradient accumulation) and eval step.

State is a dict pytree {params, opt_state, step, rng}, plus moe_bias under MoE with bias
balancing (maxlm/train/moe_state.py: updated after each step from its load, outside the
gradient). The loss of a step is the summed NLL (plus z-loss, and MoE's weighted auxiliary
losses) over all its loss positions divided by their count, so accumulating micro-batches
gives the same gradient as the whole batch.
"""

import jax
import jax.numpy as jnp
import optax

from maxlm.model import build
from maxlm.train import moe_state, sparse_stage


def init_state(model, opt, mesh, rules, seed, seq_len):
  params = build.init_params(model, jax.random.key(seed), mesh, rules, seq_len)
  with mesh:
    opt_state = jax.jit(opt.init)(params)
  state = {"params": params, "opt_state": opt_state, "step": jnp.zeros((), jnp.int32),
           "rng": jax.random.key_data(jax.random.key(seed + 1))}
  if moe_state.enabled(model.cfg):
    bias = moe_state.init(build.abstract_collection(model, moe_state.BIAS, seq_len))
    state[moe_state.BIAS] = jax.device_put(bias, moe_state.shardings(bias, mesh))
  return state


def init_state_abstract(model, opt, seed, seq_len):
  """The state's structure, for tracing under jax.eval_shape."""
  params = build.init_params_abstract(model, seq_len)
  state = {"params": params, "opt_state": opt.init(params), "step": jnp.zeros((), jnp.int32),
           "rng": jax.random.key_data(jax.random.key(seed + 1))}
  if moe_state.enabled(model.cfg):
    state[moe_state.BIAS] = moe_state.init(build.abstract_collection(model, moe_state.BIAS,
                                                                     seq_len))
  return state


def _combine(a, b):
  """Two micro-batches' sums: the max logit is a max, everything else adds."""
  return {k: (jnp.maximum(a[k], b[k]) if k == "max_logit" else
              jax.tree_util.tree_map(jnp.add, a[k], b[k])) for k in a}


def make_train_step(model, opt, schedule, rules, model_cfg, grad_accum):
  moe = model_cfg.moe
  keys = ("nll", "count", "max_logit") + sparse_stage.sum_keys(model) + (
      ("moe",) if moe.experts > 0 else ())
  biased = moe_state.enabled(model_cfg)

  def objective(params, bias, micro):
    _, sums = build.loss_fn(model, params, micro, rules, chunk=model_cfg.loss_chunk,
                            z_loss=model_cfg.z_loss, moe_bias=bias)
    return sums["total"], {k: sums[k] for k in keys}

  warmup = sparse_stage.mode_of(model) == "indexer_warmup"
  grad_fn = jax.grad(objective, has_aux=True)  # the parameters' only: the bias gets none

  def step(state, batch):
    params, bias = state["params"], state.get(moe_state.BIAS)
    if grad_accum == 1:
      grads, sums = grad_fn(params, bias, batch)
    else:
      micro = jax.tree_util.tree_map(
          lambda x: x.reshape(grad_accum, x.shape[0] // grad_accum, *x.shape[1:]), batch)

      def accumulate(carry, mb):
        grads, sums = carry
        g, s = grad_fn(params, bias, mb)
        return (jax.tree_util.tree_map(jnp.add, grads, g), _combine(sums, s)), None

      shapes = jax.eval_shape(grad_fn, params, bias,
                              jax.tree_util.tree_map(lambda x: x[0], micro))[1]
      zero_sums = {k: (jnp.float32(-jnp.inf) if k == "max_logit" else
                       jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), v))
                   for k, v in shapes.items()}
      zero = (jax.tree_util.tree_map(jnp.zeros_like, params), zero_sums)
      (grads, sums), _ = jax.lax.scan(accumulate, zero, micro)
    count = jnp.maximum(sums["count"], 1.0)
    grads = jax.tree_util.tree_map(lambda g: g / count, grads)
    if warmup:  # the main model is frozen: only the indexer's gradients count
      grads = sparse_stage.only_indexer(grads)
    updates, opt_state = opt.update(grads, state["opt_state"], params)
    new_params = optax.apply_updates(params, updates)
    if warmup:
      new_params = sparse_stage.keep_main(new_params, params)
      opt_state = sparse_stage.keep_main_opt(opt_state, state["opt_state"])
    metrics = {"loss": sums["nll"] / count, "lr": schedule(state["step"]),
               "grad_norm": optax.global_norm(grads), "param_norm": optax.global_norm(new_params),
               "max_logit": sums["max_logit"], "loss_tokens": sums["count"],
               **sparse_stage.metrics(sums)}
    rng = jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(state["rng"]),
                                                 state["step"]))
    new_state = {"params": new_params, "opt_state": opt_state, "step": state["step"] + 1,
                 "rng": rng}
    if moe.experts > 0:
      stats = moe_state.finish(sums["moe"], grad_accum)
      metrics.update(moe_state.metrics(stats, moe_state.layer_names(model_cfg),
                                       moe.capacity_factor > 0))
      if biased:  # outside the gradient, from this step's whole load
        new_state[moe_state.BIAS] = moe_state.update(bias, stats, moe.bias_rate)
    return new_state, metrics

  return step


def make_eval_step(model, rules, model_cfg):
  def step(params, batch, moe_bias=None):
    _, sums = build.loss_fn(model, params, batch, rules, chunk=model_cfg.loss_chunk,
                            moe_bias=moe_bias)
    return sums["nll_BxL"]
  return step

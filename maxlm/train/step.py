"""The train state, the language model's train step and the eval step.

State is a dict pytree {params, opt_state, step, rng}, plus moe_bias under MoE with bias
balancing (maxlm/model/moe_state.py: updated after each step from its load, outside the
gradient). The step is maxlm/train/update.py's over the language model's loss: the summed NLL
(plus z-loss, and MoE's weighted auxiliary losses) over all its loss positions divided by their
count.
"""

import jax
import jax.numpy as jnp

from maxlm.model import build, moe_state
from maxlm.train import sparse_stage, update


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


def lm_loss(model, rules, model_cfg):
  """The language model's loss over update.make_step: summed NLL (plus z-loss and MoE's
  weighted auxiliary losses) over the loss positions, with the MoE bias held fixed."""
  keys = ("nll", "count", "max_logit") + sparse_stage.sum_keys(model) + (
      ("moe",) if model_cfg.moe.experts > 0 else ()) + (
      ("mtp_nll", "mtp_count") if model_cfg.mtp.depth else ())

  def loss(params, bias, micro):
    _, sums = build.loss_fn(model, params, micro, rules, chunk=model_cfg.loss_chunk,
                            z_loss=model_cfg.z_loss, moe_bias=bias)
    return sums["total"], ({k: sums[k] for k in keys}, None)
  return loss


def make_train_step(model, opt, schedule, rules, model_cfg, grad_accum):
  """step(state, batch) -> (state, metrics); the gradient is the parameters' only (the MoE
  bias gets none: it is updated after the step from the step's whole load)."""
  moe = model_cfg.moe
  update_fn = update.make_step(lm_loss(model, rules, model_cfg), opt, schedule, grad_accum,
                               count="count", freeze=sparse_stage.freeze(model))

  def step(state, batch):
    bias = state.get(moe_state.BIAS)
    new_state, common, sums, _ = update_fn(state, batch, bias)
    count = jnp.maximum(sums["count"], 1.0)
    metrics = {"loss": sums["nll"] / count, **common, "loss_tokens": sums["count"],
               **sparse_stage.metrics(sums)}
    if "mtp_nll" in sums:  # the token after next, in nats, over its own positions
      metrics["mtp_loss"] = sums["mtp_nll"] / jnp.maximum(sums["mtp_count"], 1.0)
    if moe.experts > 0:
      stats = moe_state.finish(sums["moe"], grad_accum)
      metrics.update(moe_state.metrics(stats, moe_state.layer_names(model_cfg),
                                       moe.capacity_factor > 0))
      if moe_state.enabled(model_cfg):  # outside the gradient, from this step's whole load
        new_state[moe_state.BIAS] = moe_state.update(bias, stats, moe.bias_rate)
    return new_state, metrics

  return step


def make_eval_step(model, rules, model_cfg):
  def step(params, batch, moe_bias=None):
    _, sums = build.loss_fn(model, params, batch, rules, chunk=model_cfg.loss_chunk,
                            moe_bias=moe_bias)
    return sums["nll_BxL"]
  return step

"""The train state and the jitted step (with gradient accumulation) and eval step.

State is a dict pytree {params, opt_state, step, rng}. The loss of a step is the summed NLL
(plus z-loss) over all its loss positions divided by their count, so accumulating micro-batches
gives the same gradient as the whole batch.
"""

import jax
import jax.numpy as jnp
import optax

from maxlm.model import build
from maxlm.train import sparse_stage


def init_state(model, opt, mesh, rules, seed, seq_len):
  params = build.init_params(model, jax.random.key(seed), mesh, rules, seq_len)
  with mesh:
    opt_state = jax.jit(opt.init)(params)
  return {"params": params, "opt_state": opt_state, "step": jnp.zeros((), jnp.int32),
          "rng": jax.random.key_data(jax.random.key(seed + 1))}


def init_state_abstract(model, opt, seed, seq_len):
  """The state's structure, for tracing under jax.eval_shape."""
  params = build.init_params_abstract(model, seq_len)
  return {"params": params, "opt_state": opt.init(params), "step": jnp.zeros((), jnp.int32),
          "rng": jax.random.key_data(jax.random.key(seed + 1))}


def make_train_step(model, opt, schedule, rules, model_cfg, grad_accum):
  def objective(params, micro):
    _, sums = build.loss_fn(model, params, micro, rules, chunk=model_cfg.loss_chunk,
                            z_loss=model_cfg.z_loss)
    return sums["total"], {k: sums[k] for k in ("nll", "count", "max_logit") + indexer_keys}

  indexer_keys = sparse_stage.sum_keys(model)
  warmup = sparse_stage.mode_of(model) == "indexer_warmup"
  grad_fn = jax.grad(objective, has_aux=True)

  def step(state, batch):
    params = state["params"]
    if grad_accum == 1:
      grads, sums = grad_fn(params, batch)
    else:
      micro = jax.tree_util.tree_map(
          lambda x: x.reshape(grad_accum, x.shape[0] // grad_accum, *x.shape[1:]), batch)

      def accumulate(carry, mb):
        grads, sums = carry
        g, s = grad_fn(params, mb)
        return (jax.tree_util.tree_map(jnp.add, grads, g),
                {"nll": sums["nll"] + s["nll"], "count": sums["count"] + s["count"],
                 "max_logit": jnp.maximum(sums["max_logit"], s["max_logit"]),
                 **{k: sums[k] + s[k] for k in indexer_keys}}), None

      zero = (jax.tree_util.tree_map(jnp.zeros_like, params),
              {"nll": 0.0, "count": 0.0, "max_logit": -jnp.inf,
               **{k: 0.0 for k in indexer_keys}})
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
    return {"params": new_params, "opt_state": opt_state, "step": state["step"] + 1,
            "rng": rng}, metrics

  return step


def make_eval_step(model, rules, model_cfg):
  def step(params, batch):
    _, sums = build.loss_fn(model, params, batch, rules, chunk=model_cfg.loss_chunk)
    return sums["nll_BxL"]
  return step

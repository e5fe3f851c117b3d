"""The one accumulate/update path every objective runs (maxlm/train/update.py), on a toy
least-squares loss checked against a direct computation."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from maxlm.train import update


def _loss(params, scale, micro):
  """Summed squared error, per-row errors as rows, and the largest prediction."""
  pred = micro["x"] @ params["w"] * scale
  err = (pred - micro["y"]) ** 2
  sums = {"sq": err.sum(), "count": jnp.float32(err.size), "max_logit": pred.max()}
  return err.sum(), (sums, err)


def _data(rows=8):
  rng = np.random.default_rng(0)
  return ({"w": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)},
          {"x": jnp.asarray(rng.normal(size=(rows, 3)), jnp.float32),
           "y": jnp.asarray(rng.normal(size=(rows, 2)), jnp.float32)})


@pytest.mark.parametrize("grad_accum", [1, 2, 4])
def test_micro_batches_sum_to_the_whole_batch(grad_accum):
  params, batch = _data()
  grad_fn = jax.grad(_loss, has_aux=True)
  grads, sums, rows = update.accumulate(grad_fn, params, 0.5, batch, grad_accum)
  whole, (want, want_rows) = grad_fn(params, 0.5, batch)
  np.testing.assert_allclose(grads["w"], whole["w"], rtol=1e-5)
  np.testing.assert_allclose(sums["sq"], want["sq"], rtol=1e-5)
  assert sums["count"] == want["count"] == 16
  assert sums["max_logit"] == want["max_logit"]  # a max, not a sum
  np.testing.assert_allclose(rows, want_rows, rtol=1e-6)  # in row order, one batch


def test_a_step_divides_by_the_count_applies_the_optimizer_and_advances():
  params, batch = _data()
  opt = optax.sgd(0.1)
  state = {"params": params, "opt_state": opt.init(params), "step": jnp.int32(3),
           "rng": jax.random.key_data(jax.random.key(1)), "extra": jnp.ones(2)}
  step = update.make_step(_loss, opt, lambda s: 0.1, 2, count="count")
  new, metrics, sums, _ = step(state, batch, 0.5)
  grad = jax.grad(lambda p: _loss(p, 0.5, batch)[0])(params)["w"] / 16
  np.testing.assert_allclose(new["params"]["w"], params["w"] - 0.1 * grad, rtol=1e-5)
  np.testing.assert_allclose(metrics["grad_norm"], jnp.linalg.norm(grad), rtol=1e-5)
  assert int(new["step"]) == 4 and new["extra"] is state["extra"]  # other keys carried over
  want_rng = jax.random.key_data(jax.random.fold_in(jax.random.key(1), 3))
  assert (new["rng"] == want_rng).all()


def test_a_frozen_parameter_keeps_its_value_and_its_gradient_is_not_counted():
  params, batch = _data()
  params = {"w": params["w"], "b": jnp.ones(2)}
  loss = lambda p, s, m: _loss({"w": p["w"] + 0 * p["b"].sum()}, s, m)
  freeze = update.Freeze(grads=lambda g: {**g, "w": jnp.zeros_like(g["w"])},
                         keep=lambda new, old, new_opt, old_opt: ({**new, "w": old["w"]},
                                                                 new_opt))
  opt = optax.adamw(0.1)
  state = {"params": params, "opt_state": opt.init(params), "step": jnp.int32(0),
           "rng": jax.random.key_data(jax.random.key(0))}
  new, metrics, _, _ = update.make_step(loss, opt, lambda s: 0.1, 1, count="count",
                                        freeze=freeze)(state, batch, 1.0)
  assert (new["params"]["w"] == params["w"]).all()  # weight decay would have moved it
  assert float(metrics["grad_norm"]) == 0.0

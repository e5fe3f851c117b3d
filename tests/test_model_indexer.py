"""The lightning indexer's parameters (maxlm/model/indexer.py): shapes, no gradient into the
main model, RoPE making its query-key scores depend on relative position only, and the
1/sqrt(J) weight scale. Its scores and loss are tested in tests/test_model_sparse.py."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from maxlm.model.indexer import Indexer

import datagen

J, E, D, L = 2, 8, 32, 16


def _indexer():
  config = datagen.make_config([{"seq_len": L, "batch": 1, "steps": 1, "sparse": {
      "mode": "indexer_warmup", "indexer_heads": J, "indexer_dim": E}}])
  stage = config.stages[0]
  module = Indexer(config.model, stage.sparse, stage.rope)
  x = jax.random.normal(jax.random.key(0), (1, L, D))
  positions = jnp.arange(L)[None]
  params = nn.meta.unbox(module.init(jax.random.key(1), x, positions))
  return module, params, x, positions


def test_shapes_and_weight_scale():
  module, params, x, positions = _indexer()
  q, w, k = module.apply(params, x, positions)
  assert (q.shape, w.shape, k.shape) == ((1, L, J, E), (1, L, J), (1, L, E))
  assert q.dtype == w.dtype == k.dtype == jnp.float32
  kernel = params["params"]["weights"]["kernel"]
  np.testing.assert_allclose(w, x @ kernel * J ** -0.5, rtol=1e-5, atol=1e-6)


def test_the_main_model_gets_no_gradient_but_the_indexer_does():
  module, params, x, positions = _indexer()
  total = lambda p, x: sum(jnp.sum(o ** 2) for o in module.apply(p, x, positions))
  assert not np.any(jax.grad(total, argnums=1)(params, x))
  grads = jax.grad(total)(params, x)["params"]
  assert all(np.any(grads[name]["kernel"]) for name in ("query", "key", "weights"))


def test_scores_depend_on_relative_positions_only():
  module, params, x, positions = _indexer()
  scores = lambda pos: jnp.einsum("bqje,bke->bjqk", *module.apply(params, x, pos)[::2])
  np.testing.assert_allclose(scores(positions), scores(positions + 1000), rtol=1e-4, atol=1e-4)
  assert not np.allclose(scores(positions), scores(positions * 2), atol=1e-3)

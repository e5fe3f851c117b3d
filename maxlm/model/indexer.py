"""The lightning indexer's parameters: a few small query heads, one key head, per-head weights.

From the layer's normalised input under stop_gradient (the indexer learns from its KL loss
only; the main model gets no gradient from it): qI [B,L,J,E] and kI [B,L,E] with RoPE at the
stage's positions, w [B,L,J] scaled by 1/sqrt(J), and 1/sqrt(E) folded into qI. The scores
are computed in `attention.sparse`. Created only in stages whose `sparse.mode` is not dense.
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxlm.model import rope as rope_lib


class Indexer(nn.Module):
  cfg: Any  # ModelConfig
  sparse: Any  # SparseConfig
  rope: Any

  @nn.compact
  def __call__(self, x_BxLxD, positions_BxL):
    j, e = self.sparse.indexer_heads, self.sparse.indexer_dim
    x = jax.lax.stop_gradient(x_BxLxD).astype(jnp.float32)
    init = lambda names: nn.with_logical_partitioning(
        nn.initializers.normal(stddev=self.cfg.init_std), names)
    dense = lambda features, names, name: nn.DenseGeneral(
        features, use_bias=False, dtype=jnp.float32, param_dtype=jnp.float32,
        kernel_init=init(names), name=name)
    q_BxLxJxE = dense((j, e), ("embed", None, None), "query")(x)
    k_BxLxE = dense(e, ("embed", None), "key")(x)
    w_BxLxJ = dense(j, ("embed", None), "weights")(x) * j ** -0.5
    q_BxLxJxE = rope_lib.apply(q_BxLxJxE, positions_BxL, self.rope) * e ** -0.5
    k_BxLxE = rope_lib.apply(k_BxLxE[:, :, None], positions_BxL, self.rope)[:, :, 0]
    return q_BxLxJxE, w_BxLxJ, k_BxLxE

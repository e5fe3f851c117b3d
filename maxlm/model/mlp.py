"""The dense SwiGLU MLP of a layer (and the shared experts of an MoE layer, maxlm/model/moe.py)."""

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from maxlm.model.dense import constrain, dense


class Mlp(nn.Module):
  cfg: Any

  @nn.compact
  def __call__(self, x_BxLxD):
    c = self.cfg
    dt = jnp.dtype(c.dtype)
    # gate and up in one [D, 2, F] kernel: one GEMM each way, and on CPU XLA then avoids a
    # transposed copy in the backward pass (1.6x faster MLP gradient, measured)
    gate_up_BxLx2xF = dense((2, c.d_ff), -1, ("embed", "gate_up", "mlp"), c.init_std, dt,
                            "gate_up")(x_BxLxD)
    h_BxLxF = constrain(nn.silu(gate_up_BxLx2xF[..., 0, :]) * gate_up_BxLx2xF[..., 1, :],
                        ("batch", "length", "act_mlp"))
    return dense(c.d_model, -1, ("mlp", "embed"), c.init_std / (2 * c.n_layers) ** 0.5, dt,
                 "down")(h_BxLxF)

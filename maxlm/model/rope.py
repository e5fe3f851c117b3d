"""Rotary position embedding driven by the batch's `positions`, with long-context scaling.

`linear` divides positions by `factor`; `yarn` interpolates only the low frequencies (whose
wavelength exceeds the original training length), keeps the high ones, and scales attention
by 0.1 * ln(factor) + 1 (Peng et al., 2023).
"""

import jax.numpy as jnp
import numpy as np


def inverse_frequencies(head_dim, rope):
  inv = 1.0 / (rope.theta ** (np.arange(0, head_dim, 2) / head_dim))
  if rope.scaling == "yarn" and rope.factor > 1:
    wavelength = 2 * np.pi / inv
    ramp = np.clip((rope.original_length / wavelength - 1.0) / (32.0 - 1.0), 0.0, 1.0)
    inv = inv / rope.factor * (1 - ramp) + inv * ramp
  return inv.astype(np.float32)


def attention_scale(rope):
  if rope.scaling == "yarn" and rope.factor > 1:
    return float(0.1 * np.log(rope.factor) + 1.0)
  return 1.0


def apply(x_BxLxHxD, positions_BxL, rope):
  """Rotates pairs (x[..., i], x[..., i + D/2]) by position * frequency."""
  d = x_BxLxHxD.shape[-1]
  pos = positions_BxL.astype(jnp.float32)
  if rope.scaling == "linear":
    pos = pos / rope.factor
  angle_BxLxF = pos[..., None] * inverse_frequencies(d, rope)
  scale = attention_scale(rope)
  cos = (jnp.cos(angle_BxLxF) * scale)[:, :, None, :]
  sin = (jnp.sin(angle_BxLxF) * scale)[:, :, None, :]
  x = x_BxLxHxD.astype(jnp.float32)
  first, second = x[..., :d // 2], x[..., d // 2:]
  out = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
  return out.astype(x_BxLxHxD.dtype)

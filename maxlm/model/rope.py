"""Rotary position embedding driven by the batch's `positions`, with long-context scaling.

The kinds, each identical to transformers' `rope_type` of the same name (so an exported model
is served as it was trained; tests/test_model_rope.py checks the frequencies against a table
and, where transformers is installed, against its own code):
  none    inv_freq_i = theta^(-2i/D)
  linear  positions divided by `factor` (transformers divides the frequencies instead)
  yarn    the reference YaRN (Peng et al., 2023; transformers' `_compute_yarn_parameters`):
          dimension indices below the correction range keep their frequency (extrapolation),
          those above it are divided by `factor` (interpolation), with a linear ramp in the
          dimension index between. The range comes from the rotation counts beta_fast and
          beta_slow over `original_length` positions, floored and ceiled. cos and sin are
          scaled by the attention factor: `attention_factor` if set, else 0.1 ln(factor) + 1.
The rotation pairs (x[i], x[i + D/2]) as transformers' `rotate_half` does, so exported q/k
kernels need no permutation.
"""

import math

import jax.numpy as jnp
import numpy as np


def _correction_dim(rotations, dim, theta, length):
  """The dimension index whose wavelength fits `rotations` times into `length` positions."""
  return dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def yarn_range(dim, rope):
  """(low, high): the ramp's bounds in the dimension index, truncated as the reference does."""
  low = math.floor(_correction_dim(rope.beta_fast, dim, rope.theta, rope.original_length))
  high = math.ceil(_correction_dim(rope.beta_slow, dim, rope.theta, rope.original_length))
  return max(low, 0), min(high, dim - 1)


def mscale(factor, m=1.0):
  return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def inverse_frequencies(head_dim, rope):
  inv = 1.0 / (rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
  if rope.scaling == "yarn":
    low, high = yarn_range(head_dim, rope)
    if low == high:
      high += 0.001  # the reference's guard against a zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # the share of the original (extrapolated) frequency
    inv = inv / rope.factor * (1 - keep) + inv * keep
  return inv.astype(np.float32)


def attention_scale(rope):
  if rope.scaling != "yarn":
    return 1.0
  return float(rope.attention_factor or mscale(rope.factor))


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


def apply_tail(x, positions, theta, rope_dim, inverse=False):
  """DeepSeek-V4's RoPE: only the last `rope_dim` channels turn, in adjacent pairs
  (x[2i], x[2i + 1]) (transformers' deepseek_v4 `apply_rotary_pos_emb`); the others pass.
  x: [..., L, D] or [..., L, H, D] with positions [..., L]. `inverse` turns back by the same
  angle (V4 undoes the keys' rotation on the attention output)."""
  inv = 1.0 / (theta ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim))
  angle = positions.astype(jnp.float32)[..., None] * inv.astype(np.float32)
  if x.ndim == positions.ndim + 2:  # a heads axis
    angle = angle[..., None, :]
  cos, sin = jnp.cos(angle), jnp.sin(angle) * (-1.0 if inverse else 1.0)
  x32 = x.astype(jnp.float32)
  keep, turn = x32[..., :-rope_dim], x32[..., -rope_dim:]
  even, odd = turn[..., 0::2], turn[..., 1::2]
  turned = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
  return jnp.concatenate([keep, turned.reshape(turn.shape)], axis=-1).astype(x.dtype)

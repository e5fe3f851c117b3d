"""Dense masked attention: the definition every other kernel is tested against."""

import jax
import jax.numpy as jnp


def visible(q_segment_ids, kv_segment_ids, q_offset=0, window=0):
  """[B, Lq, Lk] bool: i sees j iff j <= i, the segments are equal and non-zero, and with a
  window W > 0 also i - W < j (the last W positions, i itself included)."""
  lq, lk = q_segment_ids.shape[1], kv_segment_ids.shape[1]
  distance = (q_offset + jnp.arange(lq))[:, None] - jnp.arange(lk)[None, :]
  causal = distance >= 0
  if window:
    causal = causal & (distance < window)
  same = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
  return causal[None] & same & (q_segment_ids != 0)[:, :, None]


def attention(q, k, v, q_segment_ids, kv_segment_ids, q_offset=0, window=0):
  """q [B,Lq,H,D], k/v [B,Lk,K,D] -> ([B,Lq,H,D], max visible logit)."""
  b, lq, h, d = q.shape
  kh = k.shape[2]
  q5 = q.reshape(b, lq, kh, h // kh, d)
  logits = jnp.einsum("bqkgd,bskd->bkgqs", q5, k,
                      preferred_element_type=jnp.float32) / jnp.sqrt(d).astype(jnp.float32)
  mask = visible(q_segment_ids, kv_segment_ids, q_offset, window)[:, None, None]
  logits = jnp.where(mask, logits, -jnp.inf)
  max_logit = jnp.max(jnp.where(mask, logits, -jnp.inf))
  weights = jax.nn.softmax(jnp.where(mask.any(-1, keepdims=True), logits, 0.0), axis=-1)
  weights = jnp.where(mask, weights, 0.0)
  out = jnp.einsum("bkgqs,bskd->bqkgd", weights.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
  return out.reshape(b, lq, h, d).astype(q.dtype), max_logit


class Windowed:
  """A kernel's causal `mask_function` (q_pos, k_pos) and q_pos - W < k_pos: hashable, so the
  kernels' caches key on it (`splash_segments`, `triton_segments`)."""

  def __init__(self, inner, window):
    self.inner, self.window = inner, window

  def __call__(self, q_pos, k_pos):
    return self.inner(q_pos, k_pos) & (q_pos - k_pos < self.window)

  def __eq__(self, other):
    return isinstance(other, Windowed) and (other.inner, other.window) == (self.inner,
                                                                           self.window)

  def __hash__(self):
    return hash((self.inner, self.window))

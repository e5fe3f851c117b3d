"""Attention for sampling: queries against a KV cache laid out [B, K, S, D].

The rule is reference.attention's (its `visible` mask: causal by cache slot, equal non-zero
segments, the window); only the layout differs. With the slot axis next to head_dim both
products are batched matmuls over (B, K), which XLA's CPU backend runs about 15x faster than
the [B, S, K, D] contraction for a few queries against a long cache (measured at 128 rows x 168
slots), and the decode step is what tools/bench_sample.py times.
"""

import jax
import jax.numpy as jnp

from maxlm.model.attention import reference


def attention(q_BxLxHxD, k_BxKxSxD, v_BxKxSxD, q_segment_ids, kv_segment_ids, q_offset=0,
              window=0):
  """-> ([B, L, H, D], max visible logit), as reference.attention on the [B, S, K, D] cache."""
  b, lq, h, d = q_BxLxHxD.shape
  kh = k_BxKxSxD.shape[1]
  q_BxLxKxGxD = q_BxLxHxD.reshape(b, lq, kh, h // kh, d)
  logits = jnp.einsum("bqkgd,bksd->bkgqs", q_BxLxKxGxD, k_BxKxSxD,
                      preferred_element_type=jnp.float32) / jnp.sqrt(d).astype(jnp.float32)
  mask = reference.visible(q_segment_ids, kv_segment_ids, q_offset, window)[:, None, None]
  logits = jnp.where(mask, logits, -jnp.inf)
  max_logit = jnp.max(logits)
  weights = jax.nn.softmax(jnp.where(mask.any(-1, keepdims=True), logits, 0.0), axis=-1)
  weights = jnp.where(mask, weights, 0.0)
  out = jnp.einsum("bkgqs,bksd->bqkgd", weights.astype(v_BxKxSxD.dtype), v_BxKxSxD,
                   preferred_element_type=jnp.float32)
  return out.reshape(b, lq, h, d).astype(q_BxLxHxD.dtype), max_logit

"""Attention test cases the attention tests share (tests/test_model_attention.py,
tests/test_model_sparse.py): packed segment rows, a (q, k, v, segments, weights) case, and a
closeness check relative to the reference's scale."""

import jax.numpy as jnp
import numpy as np


def packed_segments(batch, length, rng, max_doc):
  """Rows of sorted segments with documents of 1..max_doc tokens and padding at the end."""
  out = np.zeros((batch, length), np.int32)
  for b in range(batch):
    pos, s = 0, 1
    while pos < length - max_doc // 4:
      n = int(rng.integers(1, max_doc + 1))
      out[b, pos:pos + n] = s
      pos, s = pos + n, s + 1
  return out


def make_case(length=200, heads=4, kv_heads=2, dim=32, dtype=jnp.float32, seed=0, max_doc=70):
  rng = np.random.default_rng(seed)
  seg = packed_segments(3, length, rng, max_doc)
  seg[1] = 0  # a row that is all padding
  seg[2, :5] = [1, 2, 3, 4, 5]  # one-token documents
  q = jnp.asarray(rng.normal(size=(3, length, heads, dim)), dtype)
  k = jnp.asarray(rng.normal(size=(3, length, kv_heads, dim)), dtype)
  v = jnp.asarray(rng.normal(size=(3, length, kv_heads, dim)), dtype)
  w = jnp.asarray(rng.normal(size=(3, length, heads, dim)), jnp.float32)
  return q, k, v, jnp.asarray(seg), w


def close(a, b, tol):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  assert np.abs(a - b).max() <= tol * max(1.0, np.abs(b).max()), np.abs(a - b).max()

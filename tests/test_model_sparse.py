"""DeepSeek sparse attention (maxlm/model/attention/sparse.py): equality with dense, segments."""

import jax
import jax.numpy as jnp
import numpy as np

from maxlm.model.attention import reference, sparse
from test_model_attention import close, make_case, packed_segments


def indexer_inputs(b, length, seed=1, heads=2, dim=8):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.normal(size=(b, length, heads, dim)), jnp.float32),
          jnp.asarray(rng.normal(size=(b, length, heads)), jnp.float32),
          jnp.asarray(rng.normal(size=(b, length, dim)), jnp.float32))


def test_topk_covering_every_visible_key_equals_dense_outputs_and_grads():
  q, k, v, seg, w = make_case(length=200)
  iq, iw, ik = indexer_inputs(3, 200)
  topk = 70  # every document is at most 70 tokens: k >= every visible count

  def loss(fn):
    def f(q, k, v):
      out = fn(q, k, v)
      return (out * w).sum(), out
    return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v)

  (_, dense), dense_g = loss(lambda q, k, v: reference.attention(q, k, v, seg, seg)[0])
  (_, out), grads = loss(lambda q, k, v: sparse.sparse(q, k, v, iq, iw, ik, seg, seg,
                                                       topk=topk, chunk=48)[0])
  close(out, dense, 1e-5)
  for g, dg in zip(grads, dense_g):
    close(g, dg, 1e-5)
  stats = sparse.sparse(q, k, v, iq, iw, ik, seg, seg, topk=topk, chunk=48)[2]
  vis = np.asarray(reference.visible(seg, seg)).sum(-1)
  assert float(stats["selected"]) == vis.sum()  # every visible key, and nothing else
  assert float(stats["queries"]) == (np.asarray(seg) > 0).sum()


def test_selection_stays_in_the_document_and_packing_changes_nothing():
  rng = np.random.default_rng(3)
  length, topk = 96, 6
  seg = jnp.asarray(packed_segments(2, length, rng, 40))
  q, k, v, _, _ = make_case(length=length, seed=4)
  q, k, v = q[:2], k[:2], v[:2]
  iq, iw, ik = indexer_inputs(2, length, seed=5)
  out, _, stats = sparse.sparse(q, k, v, iq, iw, ik, seg, seg, topk=topk, chunk=16)
  vis = np.asarray(reference.visible(seg, seg)).sum(-1)
  assert float(stats["selected"]) == np.minimum(vis, topk).sum()
  # each document alone (at position 0, its own row) gives the same outputs as packed
  for b in range(2):
    row = np.asarray(seg[b])
    for s in np.unique(row[row > 0]):
      where = np.nonzero(row == s)[0]
      a, n = where[0], len(where)
      take = lambda x: x[b:b + 1, a:a + n]
      alone, _, _ = sparse.sparse(take(q), take(k), take(v), take(iq), take(iw), take(ik),
                                  jnp.ones((1, n), jnp.int32), jnp.ones((1, n), jnp.int32),
                                  topk=topk, chunk=8)
      np.testing.assert_allclose(np.asarray(alone[0]), np.asarray(out[b, a:a + n]), atol=1e-5)
  assert not np.asarray(out)[np.asarray(seg) == 0].any()  # padding rows stay 0


def test_selected_keys_never_cross_a_document():
  rng = np.random.default_rng(7)
  length = 80
  seg = jnp.asarray(packed_segments(1, length, rng, 30))
  q, k, v, _, _ = make_case(length=length, seed=8)
  iq, iw, ik = indexer_inputs(1, length, seed=9)
  # keys of other documents get huge indexer scores: a leak would select them
  ik = ik + 100.0 * (jnp.arange(length) % 2)[None, :, None]
  k1, v1 = k[:1], v[:1]
  out = sparse.sparse(q[:1], k1, v1, iq, iw, ik, seg, seg, topk=4, chunk=16)[0]
  # changing keys/values outside a query's document cannot change its output
  row = np.asarray(seg[0])
  for s in np.unique(row[row > 0]):
    other = jnp.asarray(row != s)[None, :, None, None]
    out2 = sparse.sparse(q[:1], jnp.where(other, 7.0, k1), jnp.where(other, -3.0, v1), iq, iw,
                         ik, seg, seg, topk=4, chunk=16)[0]
    np.testing.assert_array_equal(np.asarray(out2[0, row == s]), np.asarray(out[0, row == s]))


def test_warmup_kl_is_zero_when_the_indexer_matches_and_recall_is_one_with_full_topk():
  q, k, v, seg, _ = make_case(length=64, max_doc=20)
  iq, iw, ik = indexer_inputs(3, 64)
  stats = sparse.warmup(q, k, iq, iw, ik, seg, seg, topk=64, chunk=16)
  valid = float((np.asarray(seg) > 0).sum())
  assert float(stats["queries"]) == valid
  np.testing.assert_allclose(float(stats["recall"]) / valid, 1.0, rtol=1e-5)
  assert float(stats["kl"]) > 0
  g = jax.grad(lambda iq: sparse.warmup(q, k, iq, iw, ik, seg, seg, topk=8)["kl"])(iq)
  assert np.abs(np.asarray(g)).max() > 0


def test_block_selection_equals_dense_when_it_covers_every_visible_block():
  q, k, v, seg, w = make_case(length=200)
  iq, iw, ik = indexer_inputs(3, 200)

  def run(fn):
    return jax.value_and_grad(lambda q, k, v: (fn(q, k, v) * w).sum(), argnums=(0, 1, 2))(
        q, k, v)

  _, dense_g = run(lambda q, k, v: reference.attention(q, k, v, seg, seg)[0])
  dense = reference.attention(q, k, v, seg, seg)[0]
  out, _, stats = sparse.sparse_blocks(q, k, v, iq, iw, ik, seg, seg, topk=208, block=16)
  close(out, dense, 1e-5)
  grads = run(lambda q, k, v: sparse.sparse_blocks(q, k, v, iq, iw, ik, seg, seg, topk=208,
                                                   block=16)[0])[1]
  for g, dg in zip(grads, dense_g):
    close(g, dg, 1e-5)
  assert float(stats["selected"]) == np.asarray(reference.visible(seg, seg)).sum()


def test_block_selection_stays_in_the_document():
  rng = np.random.default_rng(11)
  length = 96
  seg = jnp.asarray(packed_segments(1, length, rng, 30))
  q, k, v, _, _ = make_case(length=length, seed=12)
  q, k, v = q[:1], k[:1], v[:1]
  v = v + 1000.0 * seg[:, :, None, None]  # each document's values in a range of their own
  iq, iw, ik = indexer_inputs(1, length, seed=13)
  out, _, stats = sparse.sparse_blocks(q, k, v, iq, iw, ik, seg, seg, topk=16, block=8)
  vis = np.asarray(reference.visible(seg, seg)).sum(-1)
  assert 0 < float(stats["selected"]) <= vis.sum()
  row = np.asarray(seg[0])
  # each query's output is a convex combination of its own document's values
  vals = np.asarray(v[0]).repeat(2, axis=1)  # [L, H, D] (2 query heads per KV head)
  for t in range(length):
    if row[t] == 0:
      assert not np.asarray(out[0, t]).any()
      continue
    own = vals[(row == row[t]) & (np.arange(length) <= t)]
    lo, hi = own.min(0) - 1e-5, own.max(0) + 1e-5
    assert ((np.asarray(out[0, t]) >= lo) & (np.asarray(out[0, t]) <= hi)).all(), t

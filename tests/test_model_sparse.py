"""DeepSeek sparse attention (maxlm/model/attention/sparse.py, sparse_blocks.py): equality with
dense, segments, packing, recall."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from maxlm.model.attention import reference, sparse, sparse_blocks
from attncases import close, make_case, packed_segments
from limits import HANG_S


def jitted(fn, **static):
  """fn compiled once, its keyword settings (topk, chunk, block, ...) fixed."""
  return jax.jit(functools.partial(fn, **static))


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
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)

  (_, dense), dense_g = loss(lambda q, k, v: reference.attention(q, k, v, seg, seg)[0])
  (_, out), grads = loss(lambda q, k, v: sparse.sparse(q, k, v, iq, iw, ik, seg, seg,
                                                       topk=topk, chunk=48)[0])
  close(out, dense, 1e-5)
  for g, dg in zip(grads, dense_g):
    close(g, dg, 1e-5)
  stats = jitted(sparse.sparse, topk=topk, chunk=48)(q, k, v, iq, iw, ik, seg, seg)[2]
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
  out, _, stats = jitted(sparse.sparse, topk=topk, chunk=16)(q, k, v, iq, iw, ik, seg, seg)
  vis = np.asarray(reference.visible(seg, seg)).sum(-1)
  assert float(stats["selected"]) == np.minimum(vis, topk).sum()
  # each document alone (at position 0, its own row) gives the same outputs as packed
  alone_fn = jitted(sparse.sparse, topk=topk, chunk=8)  # compiled once per document length
  for b in range(2):
    row = np.asarray(seg[b])
    for s in np.unique(row[row > 0]):
      where = np.nonzero(row == s)[0]
      a, n = where[0], len(where)
      take = lambda x: x[b:b + 1, a:a + n]
      alone, _, _ = alone_fn(take(q), take(k), take(v), take(iq), take(iw), take(ik),
                             jnp.ones((1, n), jnp.int32), jnp.ones((1, n), jnp.int32))
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
  fn = jitted(sparse.sparse, topk=4, chunk=16)
  out = fn(q[:1], k1, v1, iq, iw, ik, seg, seg)[0]
  # changing keys/values outside a query's document cannot change its output
  row = np.asarray(seg[0])
  for s in np.unique(row[row > 0]):
    other = jnp.asarray(row != s)[None, :, None, None]
    out2 = fn(q[:1], jnp.where(other, 7.0, k1), jnp.where(other, -3.0, v1), iq, iw, ik, seg,
              seg)[0]
    np.testing.assert_array_equal(np.asarray(out2[0, row == s]), np.asarray(out[0, row == s]))


def test_warmup_kl_is_zero_when_the_indexer_matches_and_recall_is_one_with_full_topk():
  q, k, v, seg, _ = make_case(length=64, max_doc=20)
  iq, iw, ik = indexer_inputs(3, 64)
  stats = jitted(sparse.warmup, topk=64, chunk=16)(q, k, iq, iw, ik, seg, seg)
  valid = float((np.asarray(seg) > 0).sum())
  assert float(stats["queries"]) == valid
  np.testing.assert_allclose(float(stats["recall"]) / valid, 1.0, rtol=1e-5)
  assert float(stats["kl"]) > 0
  g = jax.jit(jax.grad(lambda iq: sparse.warmup(q, k, iq, iw, ik, seg, seg, topk=8)["kl"]))(iq)
  assert np.abs(np.asarray(g)).max() > 0


def test_block_selection_equals_dense_when_it_covers_every_visible_block():
  q, k, v, seg, w = make_case(length=200)
  iq, iw, ik = indexer_inputs(3, 200)

  def run(fn):
    return jax.jit(jax.value_and_grad(lambda q, k, v: (fn(q, k, v) * w).sum(),
                                      argnums=(0, 1, 2)))(q, k, v)

  _, dense_g = run(lambda q, k, v: reference.attention(q, k, v, seg, seg)[0])
  dense = jax.jit(lambda q, k, v: reference.attention(q, k, v, seg, seg)[0])(q, k, v)
  out, _, stats = jitted(sparse_blocks.sparse_blocks, topk=208, block=16)(q, k, v, iq, iw, ik,
                                                                          seg, seg)
  close(out, dense, 1e-5)
  grads = run(lambda q, k, v: sparse_blocks.sparse_blocks(q, k, v, iq, iw, ik, seg, seg, topk=208,
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
  out, _, stats = jitted(sparse_blocks.sparse_blocks, topk=16, block=8)(q, k, v, iq, iw, ik, seg,
                                                                        seg)
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


def brute_force_block_mask(seg, iq, iw, ik, topk, c):
  """[B, L, L]: what block selection lets query t see, from the indexer scores in numpy."""
  seg, iq, iw, ik = (np.asarray(x, np.float64) for x in (seg, iq, iw, ik))
  b, length = seg.shape
  nb, kb = length // c, max(1, min(topk // c, length // c))
  pos = np.arange(length)
  vis = ((pos[:, None] >= pos[None]) & (seg[:, :, None] == seg[:, None])
         & (seg > 0)[:, :, None])
  scores = np.einsum("btj,btjs->bts", iw, np.maximum(np.einsum("btje,bse->btjs", iq, ik), 0))
  mask = np.zeros_like(vis)
  for r in range(b):
    for i in range(nb):
      rows = slice(i * c, (i + 1) * c)
      s = np.where(vis[r, rows], scores[r, rows], -np.inf).reshape(c, nb, c).max(axis=(0, 2))
      s[i] = np.inf if np.isfinite(s[i]) else s[i]
      keep = [j for j in np.argsort(-s, kind="stable")[:kb] if s[j] > -np.inf]
      for j in keep:
        mask[r, rows, j * c:(j + 1) * c] = vis[r, rows, j * c:(j + 1) * c]
  return mask, vis


def masked_attention(q, k, v, mask):
  """Dense softmax attention over an arbitrary [B, L, L] mask (GQA), zero where nothing shows."""
  g = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
  logits = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
  m = jnp.asarray(mask)[:, None]
  probs = jnp.where(m, jax.nn.softmax(jnp.where(m, logits, -1e30), axis=-1), 0.0)
  return jnp.einsum("bhts,bshd->bthd", probs, v), probs


def test_block_selection_with_a_partial_selection_matches_masked_dense_attention():
  """Forward, the custom backward and the indexer's KL gradients against plain autodiff of
  dense attention under the brute-force selection mask."""
  length, c, topk = 96, 8, 24
  q, k, v, seg, w = make_case(length=length, max_doc=60, seed=21)
  iq, iw, ik = indexer_inputs(3, length, seed=22)
  mask, _ = brute_force_block_mask(seg, iq, iw, ik, topk, c)
  assert mask.sum() < reference.visible(seg, seg).sum()  # the selection really drops keys
  valid = (np.asarray(seg) > 0)

  def want(q, k, v, iq, iw, ik):
    out, probs = masked_attention(q, k, v, mask)
    p = jax.lax.stop_gradient(probs.mean(axis=1))
    scores = jnp.einsum("btj,btjs->bts", iw, jax.nn.relu(jnp.einsum("btje,bse->btjs", iq, ik)))
    log_q = sparse._log_softmax(scores, jnp.asarray(mask))
    kl = sparse._kl(p, log_q, jnp.asarray(mask))
    return (out * w).sum() + jnp.sum(kl * valid), out

  def got(q, k, v, iq, iw, ik):
    out, _, stats = sparse_blocks.sparse_blocks(q, k, v, iq, iw, ik, seg, seg, topk=topk,
                                                block=c)
    return (out * w).sum() + stats["kl"], out

  args = (q, k, v, iq, iw, ik)
  (lw, ow), gw = jax.jit(jax.value_and_grad(want, argnums=range(6), has_aux=True))(*args)
  (lg, og), gg = jax.jit(jax.value_and_grad(got, argnums=range(6), has_aux=True))(*args)
  close(og, ow, 1e-5)
  close(lg, lw, 1e-5)
  for a, b in zip(gg, gw):
    close(a, b, 1e-5)
  stats = jitted(sparse_blocks.sparse_blocks, topk=topk, block=c)(*args, seg, seg)[2]
  assert float(stats["selected"]) == mask.sum()


def test_block_recall_is_the_dense_mass_on_the_selected_keys():
  length, c, topk = 96, 8, 24
  q, k, v, seg, _ = make_case(length=length, max_doc=60, seed=23)
  iq, iw, ik = indexer_inputs(3, length, seed=24)
  mask, vis = brute_force_block_mask(seg, iq, iw, ik, topk, c)
  _, probs = jax.jit(masked_attention)(q, k, v, vis)
  mass = np.asarray(probs).mean(axis=1)  # [B, L, L], mean over heads
  per_query = (mass * mask).sum(-1)
  valid = np.asarray(seg) > 0
  stats = jitted(sparse_blocks.sparse_blocks, topk=topk, block=c, recall_blocks=length // c)(
      q, k, v, iq, iw, ik, seg, seg)[2]  # every block
  assert float(stats["recall_queries"]) == valid.sum()
  np.testing.assert_allclose(float(stats["recall"]), per_query[valid].sum(), rtol=1e-5)
  assert per_query[valid].mean() < 0.999  # a partial selection: recall is informative
  # a sample of 2 blocks: blocks 3 and 9 of 12, as documented
  two = jitted(sparse_blocks.sparse_blocks, topk=topk, block=c, recall_blocks=2)(
      q, k, v, iq, iw, ik, seg, seg)[2]
  rows = np.zeros(length, bool)
  rows[3 * c:4 * c] = rows[9 * c:10 * c] = True
  np.testing.assert_allclose(float(two["recall"]), per_query[valid & rows].sum(), rtol=1e-5)
  assert float(two["recall_queries"]) == (valid & rows).sum()


def test_block_selection_is_packing_invariant_for_block_aligned_documents():
  """A document starting on a block boundary sees the same keys packed or alone (the block grid
  is the same relative to it); a document of at most k - block + 1 tokens spans at most k / block
  blocks wherever it sits, so it is dense."""
  length, c, topk = 128, 8, 16
  q, k, v, _, _ = make_case(length=length, seed=25)
  q, k, v = q[:1], k[:1], v[:1]
  iq, iw, ik = indexer_inputs(1, length, seed=26)
  seg = np.zeros((1, length), np.int32)
  seg[0, 0:40], seg[0, 43:52], seg[0, 56:120], seg[0, 121:126] = 1, 2, 3, 4
  seg = jnp.asarray(seg)
  fn = jitted(sparse_blocks.sparse_blocks, topk=topk, block=c)  # one compile per length
  out = fn(q, k, v, iq, iw, ik, seg, seg)[0]
  # aligned and longer than k; unaligned but within k - c + 1 keys (2 and 1 blocks)
  for a, n in ((0, 40), (56, 64), (43, 9), (121, 5)):
    take = lambda x: x[:, a:a + n]  # noqa: E731
    one = jnp.ones((1, n), jnp.int32)
    alone = fn(take(q), take(k), take(v), take(iq), take(iw), take(ik), one, one)[0]
    close(alone[0], out[0, a:a + n], 1e-5)


def test_gpu_sparse_check_runs_its_commands_in_dry_run(tmp_path):
  """tools/gpu_sparse_check.sh (the prepared GPU comparison) with DRY_RUN=1 runs the same
  bench_sparse commands on the CPU at L = 512."""
  import json
  import os
  import pathlib
  import subprocess
  root = pathlib.Path(__file__).resolve().parents[1]
  proc = subprocess.run(["bash", str(root / "tools" / "gpu_sparse_check.sh"), str(tmp_path)],
                        env={**os.environ, "DRY_RUN": "1"}, capture_output=True, text=True,
                        timeout=HANG_S)
  assert proc.returncode == 0, proc.stderr[-2000:]
  out = json.loads((tmp_path / "sparse_vs_blockwise.json").read_text())
  cases = {k: v for k, v in out.items() if k.endswith("_512")}
  assert "sparse_over_dense_512" in out, cases  # a case's process failed: its error is there
  assert out["sparse_over_dense_512"] > 0 and out["sparse_peak_rss_gib_512"] > 0
  assert out["topk_full_block_max_rel_diff"] < 1e-5


def test_block_selection_memory_grows_linearly_in_length():
  """Forward + backward compiled at 16K and 64K (not run): XLA's temporary buffers grow like
  L (4x), not L^2 (16x), and stay far below one [L, L] f32 array (16 GiB at 64K); the sampled
  recall's blocks run one at a time, adding a fixed amount (their dense key tiles: ~12 MiB here,
  the same at any L)."""
  def temp_bytes(length, recall_blocks=4):
    shapes = [(1, length, 4, 32), (1, length, 2, 32), (1, length, 2, 32), (1, length, 2, 16),
              (1, length, 2), (1, length, 16)]
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    seg = jax.ShapeDtypeStruct((1, length), jnp.int32)

    def loss(q, k, v, iq, iw, ik, seg):
      out, _, stats = sparse_blocks.sparse_blocks(q, k, v, iq, iw, ik, seg, seg, topk=256,
                                                  block=64, recall_blocks=recall_blocks)
      return out.sum() + stats["kl"], stats  # stats as outputs: XLA keeps the recall

    fn = jax.jit(jax.grad(loss, argnums=range(6), has_aux=True))
    return fn.lower(*args, seg).compile().memory_analysis().temp_size_in_bytes

  small, large = temp_bytes(16384), temp_bytes(65536)
  assert large / small < 5, (small, large)
  assert large < 2**30 // 8, large
  without = temp_bytes(65536, recall_blocks=0)
  assert large - without < 2**24, (large, without)

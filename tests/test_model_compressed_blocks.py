"""DeepSeek-V4's attention by query blocks (maxlm/model/compressed_blocks.py) equals the dense
reference (compressed.attend over compressed.select's mask) on packed rows, for window-only,
HCA and CSA layers, with blocks that do not divide the row and windows longer than a block."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm.model import compressed, mqa
from randparams import random_params

D, H, K = 32, 4, 16


def _row(lengths, length, continued):
  seg, pos, at = np.zeros(length, np.int32), np.zeros(length, np.int32), 0
  for i, n in enumerate(lengths):
    start = 5 if continued and i == 0 else 0  # a piece whose positions continue a neighbour's
    seg[at:at + n], pos[at:at + n] = i + 1, start + np.arange(n)
    at += n
  return jnp.asarray(pos[None]), jnp.asarray(seg[None])


CASES = [  # (lengths, padding, (rate, overlap), window, block, continued)
    ([11, 17, 2, 9], 3, (0, False), 9, 7, True),  # window only, a window longer than a block
    ([23, 1, 14], 4, (3, False), 5, 16, False),  # HCA, a block longer than a document
    ([11, 17, 2, 9], 3, (4, True), 6, 7, True),  # CSA: the indexer's top 3 of each block
    ([40], 0, (4, True), 3, 8, False),  # CSA, one document, blocks dividing the row
]


@pytest.mark.parametrize("lengths,padding,kind,window,block,continued", CASES)
def test_blocks_equal_the_dense_reference(lengths, padding, kind, window, block, continued):
  rate, overlap = kind
  length = sum(lengths) + padding
  spec = mqa.MqaSpec(heads=H, head_dim=K, rope_dim=8, q_lora=12, out_groups=2, out_lora=6,
                     window=window, rate=rate, overlap=overlap, index_heads=4, index_dim=8,
                     index_top_k=3)
  x = jax.random.normal(jax.random.PRNGKey(len(lengths) + padding), (1, length, D))
  pos, seg = _row(lengths, length, continued)
  params = random_params(mqa.Mqa(spec), (x, pos, seg))
  dense = mqa.Mqa(spec).apply({"params": params}, x, pos, seg)
  blocks = mqa.Mqa(spec.__class__(**{**spec.__dict__, "block": block})).apply(
      {"params": params}, x, pos, seg)
  np.testing.assert_allclose(np.asarray(blocks), np.asarray(dense), rtol=2e-5, atol=2e-6)


def _indexer_kl(spec, params, x, pos, seg):
  """(the layer's sown indexer sums, the gradient of their KL) under `spec`."""
  def kl(params):
    _, sown = mqa.Mqa(spec).apply({"params": params}, x, pos, seg, mutable=["sparse"])
    sums = {k: v[0] for k, v in sown["sparse"].items()}
    return sums["kl"], sums
  return jax.grad(kl, has_aux=True)(params)[::-1]


@pytest.mark.parametrize("mode", ["indexer_warmup", "sparse"])
@pytest.mark.parametrize("lengths,padding,kind,window,block,continued",
                         [c for c in CASES if c[2][1]])
def test_the_indexer_learns_the_same_by_blocks_and_only_the_indexer(
    mode, lengths, padding, kind, window, block, continued):
  """CSA's indexer KL (compressed.indexer_kl) and its gradient are the same by blocks as by the
  dense reference; it moves the indexer's parameters and no other, a step down it lowers the
  KL, and the sums count the queries that see an entry and the entries they attend (all
  visible in warm-up, top 3)."""
  length = sum(lengths) + padding
  spec = mqa.MqaSpec(heads=H, head_dim=K, rope_dim=8, q_lora=12, out_groups=2, out_lora=6,
                     window=window, rate=kind[0], overlap=True, index_heads=4, index_dim=8,
                     index_top_k=3, index_mode=mode)
  x = jax.random.normal(jax.random.PRNGKey(7), (1, length, D))
  pos, seg = _row(lengths, length, continued)
  params = random_params(mqa.Mqa(spec), (x, pos, seg))
  sums, grads = _indexer_kl(spec, params, x, pos, seg)
  by_blocks, grads_blocks = _indexer_kl(spec.__class__(**{**spec.__dict__, "block": block}),
                                        params, x, pos, seg)
  for name in ("kl", "queries", "selected"):
    np.testing.assert_allclose(by_blocks[name], sums[name], rtol=2e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7),
               grads_blocks, grads)
  assert float(sums["kl"]) > 0 and float(sums["queries"]) > 0
  if mode == "sparse":
    assert float(sums["selected"]) <= 3 * float(sums["queries"])
  moved = {k for k, g in grads.items() if any(np.abs(v).max() > 0 for v in jax.tree.leaves(g))}
  assert moved == {"index_q", "index_weights", "index_compressor"}
  norm = sum(float(jnp.sum(g ** 2)) for g in jax.tree.leaves(grads)) ** 0.5
  stepped = jax.tree.map(lambda p, g: p - 0.1 / norm * g, params, grads)
  assert float(_indexer_kl(spec, stepped, x, pos, seg)[0]["kl"]) < float(sums["kl"])


def test_indexer_kl_is_the_divergence_written_out():
  """Two queries over three entries: the heads' attention summed and normalised against the
  softmax of the scores over what each sees; a query that sees nothing counts nothing."""
  probs_BxHxQxN = jnp.asarray([[[[0.2, 0.1, 0.0], [0.0, 0.0, 0.0]],
                                [[0.3, 0.2, 0.0], [0.0, 0.0, 0.0]]]])
  scores = jnp.asarray([[[1.0, -1.0, 5.0], [0.0, 0.0, 0.0]]])
  mask = jnp.asarray([[[True, True, False], [False, False, False]]])
  got = compressed.indexer_kl(probs_BxHxQxN, scores, mask)
  p = np.array([0.5, 0.3]) / 0.8
  q = np.exp([1.0, -1.0]) / np.exp([1.0, -1.0]).sum()
  np.testing.assert_allclose(got["kl"], np.sum(p * np.log(p / q)), rtol=1e-6)
  assert float(got["queries"]) == 1 and float(got["selected"]) == 2
  grad = jax.grad(lambda s: compressed.indexer_kl(probs_BxHxQxN, s, mask)["kl"])(scores)
  assert np.isfinite(np.asarray(grad)).all() and float(jnp.abs(grad[0, 1]).max()) == 0

"""DeepSeek-V4's attention by query blocks (maxlm/model/compressed_blocks.py) equals the dense
reference (compressed.attend over compressed.select's mask) on packed rows, for window-only,
HCA and CSA layers, with blocks that do not divide the row and windows longer than a block."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm.model import mqa
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

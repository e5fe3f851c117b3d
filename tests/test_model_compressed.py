"""Compressed entries (maxlm/model/compressed.py): equal to transformers' DeepSeek-V4
compressors on one document, and on any packing equal to each document compressed alone."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from maxlm.model import compressed, rope

D, ROPE_DIM, THETA, EPS = 16, 8, 160000.0, 1e-6
ROW = 128  # fits 5 documents of up to 23 tokens and 9 of padding


def _packing(lengths, length, starts=None):
  """(positions, segment ids) of documents packed in order; document i's positions start at
  starts[i] (a piece cut from a longer document), else 0."""
  seg = np.zeros(length, np.int32)
  pos = np.zeros(length, np.int32)
  at = 0
  for i, n in enumerate(lengths):
    seg[at:at + n], pos[at:at + n] = i + 1, np.arange(n) + (starts[i] if starts else 0)
    at += n
  return pos[None], seg[None]


@functools.partial(jax.jit, static_argnums=(6, 7))
def _entries_jit(kv, gate, bias, scale, pos, seg, rate, overlap):
  pooled, end, valid = compressed.pool(kv, gate, bias, pos, seg, rate, overlap)
  at = compressed.entry_positions(pos, end, rate)
  return compressed.normalize_and_rotate(pooled, scale, EPS, at, THETA, ROPE_DIM), end, valid


def _entries(*args):
  return tuple(np.asarray(a) for a in _entries_jit(*args))


def _random(seed, length, width, rate):
  k = jax.random.split(jax.random.PRNGKey(seed), 4)
  return (jax.random.normal(k[0], (1, length, width)), jax.random.normal(k[1], (1, length, width)),
          jax.random.normal(k[2], (rate, width)) * 0.5, 1 + 0.1 * jax.random.normal(k[3], (D,)))


@pytest.mark.parametrize("overlap, rate", [(False, 8), (True, 4)], ids=["hca", "csa"])
def test_one_document_equals_transformers(overlap, rate):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf
  cfg = transformers.DeepseekV4Config(
      hidden_size=D, head_dim=D, partial_rotary_factor=ROPE_DIM / D, num_attention_heads=2,
      num_hidden_layers=1, vocab_size=16, q_lora_rank=8, index_n_heads=2, index_head_dim=8,
      index_topk=2, compress_rope_theta=THETA, rms_norm_eps=EPS,
      compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8})
  module = (hf.DeepseekV4CSACompressor if overlap else hf.DeepseekV4HCACompressor)(cfg).eval()
  width = 2 * D if overlap else D
  length = 37  # ends inside a window: that window gives no entry
  hidden = torch.randn(1, length, D, generator=torch.Generator().manual_seed(0))
  with torch.no_grad():
    for p in module.parameters():
      p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.3)
    ref = module(hidden, torch.zeros(1, length, 8), torch.arange(length)[None], None, 0)[0]
    kv, gate = module.kv_proj(hidden), module.gate_proj(hidden)
  pos, seg = _packing([length], length)
  ours, end, valid = _entries(jnp.asarray(kv.numpy()), jnp.asarray(gate.numpy()),
                              jnp.asarray(module.position_bias.detach().numpy()),
                              jnp.asarray(module.kv_norm.weight.detach().numpy()), pos, seg,
                              rate, overlap)
  ref = ref[0, 0].numpy()
  assert valid.sum() == ref.shape[0] == length // rate
  np.testing.assert_allclose(ours[0, :ref.shape[0]], ref, rtol=1e-5, atol=1e-5)
  assert width == kv.shape[-1]


@given(st.lists(st.tuples(st.integers(1, 23), st.sampled_from([0, 0, 3, "follow"])),
                min_size=1, max_size=5), st.booleans(), st.sampled_from([2, 4]),
       st.integers(0, 9))
def test_a_packed_row_equals_each_document_alone(docs, overlap, rate, slack):
  """Entries of a packed row are each document's own entries, in order; each query sees only
  its own document's closed entries. A document may start at a later position, even the one
  right after its neighbour's last (pieces of one long document): windows still never cross.
  Rows are padded to one length (one compile a case)."""
  lengths = [n for n, _ in docs]
  starts = []
  for i, (n, start) in enumerate(docs):
    starts.append(starts[-1] + lengths[i - 1] if start == "follow" and i else (
        0 if start == "follow" else start))
  length = ROW
  width = 2 * D if overlap else D
  kv, gate, bias, scale = _random(sum(lengths) * 7 + rate, length, width, rate)
  pos, seg = _packing(lengths, sum(lengths) + slack, starts)
  pos, seg = np.pad(pos, ((0, 0), (0, length - pos.shape[1]))), np.pad(
      seg, ((0, 0), (0, length - seg.shape[1])))
  packed, end, valid = _entries(kv, gate, bias, scale, pos, seg, rate, overlap)
  expected, at = [], 0
  for n, start in zip(lengths, starts):
    p1, s1 = _packing([n], length, [start])
    alone, _, ok = _entries(jnp.roll(kv, -at, axis=1), jnp.roll(gate, -at, axis=1), bias,
                            scale, p1, s1, rate, overlap)
    expected.append(alone[0, ok[0]])
    at += n
  expected = np.concatenate(expected) if expected else np.zeros((0, D))
  np.testing.assert_allclose(packed[0, valid[0]], expected, rtol=1e-5, atol=1e-5)
  sees = np.asarray(compressed.visible(seg, end, valid))[0]
  owner = seg[0][np.clip(end[0], 0, length - 1)]
  for t in range(length):
    for e in np.flatnonzero(sees[t]):
      assert owner[e] == seg[0, t] > 0 and end[0, e] <= t
    mine = valid[0] & (owner == seg[0, t]) & (end[0] <= t)
    assert sees[t].sum() == (mine.sum() if seg[0, t] else 0)


def test_rope_tail_equals_transformers_and_turns_back():
  torch = pytest.importorskip("torch")
  pytest.importorskip("transformers")
  from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf
  x = jax.random.normal(jax.random.PRNGKey(0), (1, 6, 2, D))
  pos = jnp.arange(6)[None] * 3
  inv = 1.0 / (THETA ** (torch.arange(0, ROPE_DIM, 2, dtype=torch.float) / ROPE_DIM))
  freqs = torch.from_numpy(np.asarray(pos)).float()[..., None] * inv
  ref = hf.apply_rotary_pos_emb(torch.from_numpy(np.asarray(x)).transpose(1, 2), freqs.cos(),
                                freqs.sin()).transpose(1, 2).numpy()
  ours = rope.apply_tail(x, pos, THETA, ROPE_DIM)
  np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(rope.apply_tail(ours, pos, THETA, ROPE_DIM, inverse=True), x,
                             rtol=1e-5, atol=1e-5)

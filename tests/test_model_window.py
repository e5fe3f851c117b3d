"""Local (sliding-window) attention: `window` W > 0 lets position i see j iff the segments are
equal and non-zero and i - W < j <= i. Every implementation equals the reference with a window
(outputs and gradients, f32), the mask rule is transformers' sliding-window mask, the loops and
kernels visit exactly the tiles inside the window, and sampling's cache path equals the full
forward pass."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from maxlm import MaxlmError, config
from maxlm.config import MeshConfig
from maxlm.model.attention import (attention, blockwise, reference, splash_segments,
                                   triton_segments)
from maxlm.parallel import mesh as mesh_lib

L = 160


def rows(length, rng):
  """One document longer than any window (then padding), documents of 13, random lengths
  (padding last), all padding."""
  seg = np.zeros((4, length), np.int32)
  seg[0, :length - 10] = 1
  seg[1] = np.arange(length) // 13 + 1
  pos, s = 0, 1
  while pos < length - 12:
    n = int(rng.integers(1, 60))
    seg[2, pos:pos + n] = s
    pos, s = pos + n, s + 1
  return jnp.asarray(seg)


def inputs(length=L, heads=4, kv_heads=2, dim=16, seed=0):
  rng = np.random.default_rng(seed)
  seg = rows(length, rng)
  shape = lambda h: (seg.shape[0], length, h, dim)
  q, k, v = (jnp.asarray(rng.normal(size=shape(h)), jnp.float32)
             for h in (heads, kv_heads, kv_heads))
  w = jnp.asarray(rng.normal(size=shape(heads)), jnp.float32)
  return q, k, v, seg, w


def out_and_grads(fn, q, k, v, w):
  """fn's output and the gradients of (out * w).sum(), in one jitted function."""
  def loss(q, k, v):
    out = fn(q, k, v)
    return (out * w).sum(), out
  run = lambda q, k, v: jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
  (_, out), grads = jax.jit(run)(q, k, v)
  return out, grads


@functools.lru_cache(maxsize=None)
def reference_out_and_grads(window, length=L, heads=4, kv_heads=2, rows=None):
  """The reference's output and gradients on inputs(length, heads, kv_heads)[:rows] (computed
  once for every impl or kernel compared with it)."""
  q, k, v, seg, w = (x[:rows] for x in inputs(length=length, heads=heads, kv_heads=kv_heads))
  ref = lambda q, k, v: reference.attention(q, k, v, seg, seg, window=window)[0]
  return out_and_grads(ref, q, k, v, w)


def close(a, b, tol=1e-5):
  a, b = np.asarray(a), np.asarray(b)
  assert np.abs(a - b).max() <= tol * max(1.0, np.abs(b).max()), np.abs(a - b).max()


def brute_force_tiles(seg, bq, bk, window):
  """(Query block, key block) tiles holding a visible pair, summed over rows."""
  seg = jnp.pad(seg, [(0, 0), (0, -seg.shape[1] % np.lcm(bq, bk))])
  vis = np.asarray(reference.visible(seg, seg, window=window))
  b, n = seg.shape
  return int(vis.reshape(b, n // bq, bq, n // bk, bk).any(axis=(2, 4)).sum())


WINDOWS = [1, 5, 40, 1000]  # one position; under a block; not a block multiple; >= L
IMPLS = [pytest.param(impl, kw, id=impl) for impl, kw in [
    ("blockwise", {"block_q": 32, "block_k": 16}), ("splash", {"block_q": 128}),
    ("gpu", {"block_q": 32}), ("splash_causal", {"block_q": 128})]]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("impl, kw", IMPLS)
def test_every_impl_equals_the_reference_with_a_window(impl, kw, window):
  q, k, v, seg, w = inputs()
  want, want_grads = reference_out_and_grads(window)
  got, grads = out_and_grads(lambda q, k, v: attention(q, k, v, seg, impl=impl, window=window,
                                                       **kw), q, k, v, w)
  close(got, want)
  for g, wg in zip(grads, want_grads):
    close(g, wg)
  assert not np.asarray(got[3]).any(), "an all-padding row's output is 0"


def test_a_window_changes_attention_and_one_as_long_as_the_row_does_not():
  q, k, v, seg, _ = inputs()
  full = reference.attention(q, k, v, seg, seg)[0]
  assert np.array_equal(reference.attention(q, k, v, seg, seg, window=L)[0], full)
  local = reference.attention(q, k, v, seg, seg, window=40)[0]
  assert np.abs(local[0] - full[0]).max() > 0.1, "a 150-token document sees less with W=40"
  assert np.array_equal(local[1], full[1]), "13-token documents all fit in the window"
  one = reference.attention(q, k, v, seg, seg, window=1)[0]
  want = jnp.repeat(v, 2, axis=2) * (seg > 0)[:, :, None, None]  # W=1: each sees only itself
  close(one, want)


def packed(docs, length):
  """[1, length]: documents of the given lengths, then padding (one shape per test, so the
  eager jnp ops compile once)."""
  seg = np.zeros(length, np.int32)
  seg[:sum(docs)] = np.repeat(np.arange(1, len(docs) + 1), docs)
  return jnp.asarray(seg[None])


@settings(max_examples=25, deadline=None)
@given(docs=st.lists(st.integers(1, 30), min_size=1, max_size=6), window=st.integers(1, 40),
       offset=st.integers(0, 12))
@example(docs=[30] * 6, window=1, offset=0)
@example(docs=[1, 1, 1], window=40, offset=12)
@example(docs=[30, 1, 29], window=29, offset=5)
def test_the_mask_rule(docs, window, offset):
  """reference.visible against the rule in plain Python, and against transformers'
  sliding-window causal mask combined with its packed-sequence mask."""
  seg = packed(docs, 6 * 30 + 4)
  n = seg.shape[1]
  q_seg, q_offset = seg[:, offset:], offset
  got = np.asarray(reference.visible(q_seg, seg, q_offset, window))[0]
  s = np.asarray(seg[0])
  i, j = np.arange(q_offset, n)[:, None], np.arange(n)[None]  # query, key positions
  want = (s[i] == s[j]) & (s[j] != 0) & (i - window < j) & (j <= i)
  assert (got == want).all()
  torch = pytest.importorskip("torch")
  masking = pytest.importorskip("transformers.masking_utils")
  rule = masking.and_masks(masking.sliding_window_causal_mask_function(window),
                           masking.packed_sequence_mask_function(torch.tensor(s)[None]))
  hf = rule(torch.tensor(0), torch.tensor(0), torch.arange(n)[:, None], torch.arange(n)[None])
  full = np.asarray(reference.visible(seg, seg, 0, window))[0]
  assert (full == (hf.numpy() & (s != 0)[:, None])).all()


@settings(max_examples=20, deadline=None)
@given(docs=st.lists(st.integers(1, 90), min_size=1, max_size=8), window=st.integers(1, 200),
       bq=st.sampled_from([8, 16, 32]), bk=st.sampled_from([8, 16, 32]))
@example(docs=[90] * 8, window=1, bq=8, bk=8)
@example(docs=[1, 89, 3], window=200, bq=32, bk=32)
@example(docs=[17, 40], window=33, bq=8, bk=32)
def test_block_plans_are_exactly_the_tiles_inside_the_window(docs, window, bq, bk):
  """On packed rows every plan (blockwise's loop bounds, splash's block mask, the Triton
  kernel's forward/dQ and dK/dV ranges) is exactly the tiles holding a visible pair."""
  seg = padded = packed(docs, 8 * 90 + 16)  # a multiple of every tile
  want = brute_force_tiles(seg, bq, bk, window)
  assert blockwise.tile_count(padded, padded, block_q=bq, block_k=bk, window=window) == want
  if bq == bk:
    assert splash_segments.block_count(padded, bq, bk, window) == want
    assert triton_segments.block_count(padded, bq, bk, window) == want
    start, stop = triton_segments.k_ranges(padded, bq, bk, window)
    assert int(jnp.sum(stop - start)) == want


def test_blockwise_computes_only_the_tiles_inside_the_window(monkeypatch):
  """Counted inside the loops (each tile's scores are computed once forward, once backward):
  the forward and backward pass each visit exactly the planned tiles, a number that grows with
  W and not with L."""
  visits = []
  scores = blockwise._scores

  def counting(*args):
    jax.debug.callback(lambda: visits.append(1))
    return scores(*args)

  monkeypatch.setattr(blockwise, "_scores", counting)
  rng = np.random.default_rng(1)

  def count(length, window):
    seg = jnp.asarray((np.arange(length) < length - 9)[None], jnp.int32)  # one doc + padding
    q = jnp.asarray(rng.normal(size=(1, length, 2, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, length, 1, 8)), jnp.float32)
    visits.clear()
    fn = lambda q: blockwise.attention(q, k, k, seg, seg, block_q=16, block_k=16,
                                       window=window)[0].sum()
    jax.block_until_ready(jax.jit(jax.grad(fn))(q))
    assert len(visits) == 2 * blockwise.tile_count(seg, seg, block_q=16, block_k=16,
                                                   window=window)
    assert len(visits) / 2 == brute_force_tiles(seg, 16, 16, window)
    return len(visits) // 2

  blocks = 256 // 16
  assert count(256, 0) == blocks * (blocks + 1) // 2
  assert count(256, 1) == blocks  # the diagonal tiles only
  assert count(256, 20) == 1 + 2 + 3 * (blocks - 2)  # W - 1 = 19 reaches two blocks back
  assert count(512, 20) == 1 + 2 + 3 * (2 * blocks - 2)  # twice the length: twice the tiles


class Counter:
  """A causal mask function counting, from inside a kernel, each tile it masks."""

  def __init__(self):
    self.n = 0

  def _add(self):
    self.n += 1

  def __call__(self, q_pos, k_pos):
    jax.debug.callback(self._add)
    return q_pos >= k_pos


@pytest.mark.parametrize("kernel", ["splash", "gpu"])
def test_the_kernels_compute_only_the_tiles_inside_the_window(kernel):
  q, k, v, seg, w = inputs(length=384, heads=2, kv_heads=1)
  window, block = 100, (128 if kernel == "splash" else 64)
  counter = Counter()
  if kernel == "splash":
    fn = lambda q, k, v: splash_segments.splash(q, k, v, seg, block=block, interpret=True,
                                                mask_function=counter, window=window)
  else:
    fn = lambda q, k, v: triton_segments.gpu(q, k, v, seg, block=block, block_bwd=block,
                                             interpret=True, mask_function=counter,
                                             window=window)[0]
  want, want_grads = reference_out_and_grads(window, length=384, heads=2, kv_heads=1)
  got, grads = out_and_grads(fn, q, k, v, w)
  close(got, want)
  for g, wg in zip(grads, want_grads):
    close(g, wg)
  tiles = brute_force_tiles(seg, block, block, window)
  assert tiles < brute_force_tiles(seg, block, block, 0), "the window leaves tiles to skip"
  assert counter.n == 2 * 3 * tiles  # 2 heads: forward, dQ, dK/dV


@pytest.mark.parametrize("window", [7, 40])
def test_context_parallel_equals_the_reference_with_a_window(window):
  mesh = mesh_lib.make_mesh(MeshConfig(data=1, fsdp=2, context=4), jax.devices()[:8])
  q, k, v, seg, w = (x[:2] for x in inputs(length=250))
  want, want_grads = reference_out_and_grads(window, length=250, rows=2)
  fn = lambda q, k, v: attention(q, k, v, seg, impl="blockwise", block_q=16, block_k=16,
                                 mesh=mesh, batch_axes=("data", "fsdp"), head_axes="tensor",
                                 window=window)
  got, grads = jax.jit(lambda q, k, v: out_and_grads(fn, q, k, v, w))(q, k, v)
  close(got, want)
  for g, wg in zip(grads, want_grads):
    close(g, wg)


def test_gpu_mha_refuses_a_window():
  q, k, v, seg, _ = inputs(length=32)
  with pytest.raises(MaxlmError, match="no sliding window"):
    attention(q, k, v, seg, impl="gpu_mha", window=8)


def model_cfg(**model):
  return config.from_dict({
      "model": {"size": "tiny", "vocab_size": 64, "dtype": "float32", **model},
      "stages": [{"seq_len": 32, "batch": 1, "steps": 1}]})


def attention_module(window, decode=False, sparse=None):
  from maxlm.model.transformer import Attention, Settings
  cfg = model_cfg()
  settings_ = Settings(rope=cfg.stages[0].rope, impl="blockwise", block_q=8, block_k=8,
                       sparse=sparse)
  return Attention(cfg.model, settings_, decode, window=window)


@pytest.mark.parametrize("window", [1, 6, 100])
def test_the_decode_cache_equals_the_full_forward_with_a_window(window):
  """A prompt of 9 then one token at a time through the cache (two rows, one left-padded as the
  batched sampler pads them) equals the full forward pass over the row."""
  n = 24
  x = jax.random.normal(jax.random.key(0), (2, n, model_cfg().model.d_model))
  pos = jnp.broadcast_to(jnp.arange(n), (2, n))
  seg = jnp.ones((2, n), jnp.int32).at[1, :3].set(0)
  pos = pos.at[1].set(jnp.maximum(jnp.arange(n) - 3, 0))
  full_module = attention_module(window)
  params = jax.jit(full_module.init)(jax.random.key(1), x, pos, seg)["params"]
  want, _ = jax.jit(full_module.apply)({"params": params}, x, pos, seg)
  decoder = attention_module(window, decode=True)
  cache = jax.jit(decoder.init)(jax.random.key(1), x, pos, seg)["cache"]
  step = jax.jit(lambda cache, *a: decoder.apply({"params": params, "cache": cache}, *a,
                                                 mutable=["cache"]))
  outs = []
  for a, b in [(0, 9)] + [(t, t + 1) for t in range(9, n)]:
    (y, _), state = step(cache, x[:, a:b], pos[:, a:b], seg[:, a:b])
    cache = state["cache"]
    outs.append(y)
  got = jnp.concatenate(outs, axis=1)
  close(got[0], want[0])
  close(got[1, 3:], want[1, 3:])  # the left padding's outputs are not used


def test_sparse_modes_refuse_a_window():
  cfg = config.SparseConfig(mode="indexer_warmup", topk=8, indexer_heads=1, indexer_dim=8)
  module = attention_module(8, sparse=cfg)
  x = jnp.ones((1, 16, model_cfg().model.d_model))
  pos, seg = jnp.arange(16)[None], jnp.ones((1, 16), jnp.int32)
  with pytest.raises(MaxlmError, match="no sliding window"):
    module.init(jax.random.key(0), x, pos, seg)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_a_local_global_decoder_samples_as_it_trains(scan_layers):
  """Layer 0 local (W=5), layer 1 global: the logits of a prompt then one token at a time through
  the decode cache equal the full forward pass; the window changes them (W=5 against W=24 on 24
  tokens), and W as long as the row is global attention."""
  from maxlm.model import build

  def logits_fn(window, decode=False):
    cfg = config.from_dict({
        "model": {"size": "tiny", "n_layers": 2, "vocab_size": 64, "dtype": "float32",
                  "scan_layers": scan_layers, "max_logit": False,
                  "attention": {"window": window, "global_every": 2}},
        "stages": [{"seq_len": 24, "batch": 1, "steps": 1, "attention": "reference"}]})
    model = build.model_for(cfg, 0)
    return model.clone(decode=True) if decode else model

  n = 24
  tokens = jax.random.randint(jax.random.key(2), (1, n), 0, 64)
  pos, seg = jnp.arange(n)[None], jnp.ones((1, n), jnp.int32)
  model = logits_fn(5)
  params = jax.jit(model.init)(jax.random.key(0), tokens, pos, seg)["params"]
  full = lambda m: (lambda h, head, _: h @ head)(*jax.jit(m.apply)({"params": params}, tokens,
                                                                    pos, seg))
  want = full(model)
  decoder = logits_fn(5, decode=True)
  cache = jax.eval_shape(decoder.init, jax.random.key(0), tokens, pos, seg)["cache"]
  cache = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), cache)
  step = jax.jit(lambda cache, *a: decoder.apply({"params": params, "cache": cache}, *a,
                                                 mutable=["cache"]))
  outs = []
  for a, b in [(0, 7)] + [(t, t + 1) for t in range(7, n)]:
    (h, head, _), state = step(cache, tokens[:, a:b], pos[:, a:b], seg[:, a:b])
    cache = state["cache"]
    outs.append(h @ head)
  close(jnp.concatenate(outs, axis=1), want)
  assert np.abs(full(logits_fn(n)) - want).max() > 1e-3
  if not scan_layers:  # layer_0..3 either way; scanned, an all-global model stacks its layers
    close(full(logits_fn(n)), full(logits_fn(0)))


def test_the_local_attention_bench_runs_small(capsys):
  """tools/bench_local_attention.py at a tiny length: both cases run and count their tiles."""
  import json
  import os
  import sys
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))
  try:
    import bench_local_attention
  finally:
    sys.path.pop(0)
  assert bench_local_attention.main(["--json", "--lengths", "1024", "--window", "128",
                                     "--block", "128"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert not any("error" in case for case in out["cases"].values()), out["cases"]
  assert out["cases"]["local_1024"]["tiles"] == 1 + 2 * 7  # 8 blocks, one back each
  assert out["cases"]["global_1024"]["tiles"] == 8 * 9 // 2
  assert out["local_over_global"]["1024"]["tiles"] == round(15 / 36, 4)

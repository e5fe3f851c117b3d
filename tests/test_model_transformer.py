import dataclasses

import flax.linen as nn

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm import config
from maxlm.config import MeshConfig, RopeConfig
from maxlm.model import build, loss as loss_lib, rope
from maxlm.parallel import mesh as mesh_lib

L, B, V = 64, 8, 256


def make_config(**model):
  return config.from_dict({
      "model": {"size": "tiny", "vocab_size": V, "dtype": "float32", **model},
      "stages": [{"seq_len": L, "batch": B, "steps": 1, "attention": "blockwise",
                  "block_q": 16, "block_k": 16}]})


def make_batch(seed=0):
  rng = np.random.default_rng(seed)
  seg = np.repeat(np.arange(1, 5), 16)[None].repeat(B, 0).astype(np.int32)
  seg[1, 40:] = 0
  seg[2] = np.repeat([1, 2], [23, 41])  # a document crossing the 4-way context shards
  pos = np.zeros_like(seg)
  for r in range(B):
    for s in np.unique(seg[r][seg[r] > 0]):
      idx = np.flatnonzero(seg[r] == s)
      pos[r, idx] = np.arange(len(idx))
  return {"inputs": rng.integers(0, V, (B, L)).astype(np.int32),
          "targets": rng.integers(0, V, (B, L)).astype(np.int32), "segment_ids": seg,
          "positions": pos, "loss_mask": (seg > 0).astype(np.int32)}


def loss_and_grads(cfg, shape, batch):
  n = int(np.prod(shape))
  mesh = mesh_lib.make_mesh(MeshConfig(*shape), jax.devices()[:n])
  model = build.model_for(cfg, 0, mesh)
  params = build.init_params(model, jax.random.key(0), mesh, cfg.rules, L)
  placed = mesh_lib.place_batch(batch, mesh, cfg.rules)
  fn = jax.value_and_grad(lambda p, b: build.loss_fn(model, p, b, cfg.rules, chunk=24),
                          has_aux=True)
  with mesh:
    (loss, aux), grads = jax.jit(fn)(params, placed)
  return float(loss), aux, jax.tree_util.tree_map(np.asarray, grads)


@pytest.fixture(scope="module")
def single():
  cfg = make_config()
  return cfg, loss_and_grads(cfg, (1, 1, 1, 1), make_batch())


@pytest.mark.parametrize("shape", [(8, 1, 1, 1), (2, 4, 1, 1), (2, 2, 2, 1), (1, 2, 1, 4),
                                   (1, 1, 2, 4)])
def test_meshes_match_one_device(single, shape):
  cfg, (loss1, _, grads1) = single
  loss, _, grads = loss_and_grads(cfg, shape, make_batch())
  assert abs(loss - loss1) <= 1e-5 * abs(loss1)
  for g, g1 in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(grads1)):
    assert np.abs(g - g1).max() <= 1e-5 * np.abs(g1).max()


def test_loss_is_a_fresh_start_at_each_segment():
  """A document's loss does not depend on what is packed before it in the row."""
  cfg = make_config()
  mesh = mesh_lib.make_mesh(MeshConfig(1, 1, 1, 1), jax.devices()[:1])
  model = build.model_for(cfg, 0, mesh)
  params = build.init_params(model, jax.random.key(1), mesh, cfg.rules, L)
  batch = make_batch(3)
  doc = slice(16, 32)  # segment 2 of row 0
  alone = {k: np.zeros_like(v[:1]) for k, v in batch.items()}
  for k in batch:
    alone[k][0, :16] = batch[k][0, doc]
  alone["segment_ids"][0, :16] = 1
  only = {k: v[:1].copy() for k, v in batch.items()}
  only["loss_mask"][0] = 0
  only["loss_mask"][0, doc] = 1
  f = jax.jit(lambda b: build.loss_fn(model, params, b, cfg.rules, chunk=L)[0])
  assert np.isclose(float(f(only)), float(f(alone)), rtol=1e-5)


def _loss_case(seed):
  """(h, w, t, m) for a small chunked-loss check, and the same loss from full logits."""
  rng = np.random.default_rng(seed)
  h = jnp.asarray(rng.normal(size=(2, 50, 16)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(16, 40)), jnp.float32)
  t = jnp.asarray(rng.integers(0, 40, (2, 50)))
  m = jnp.asarray(rng.integers(0, 2, (2, 50)))

  def full(h, w, z):
    logits = h @ w
    lse = jax.nn.logsumexp(logits, -1)
    nll = lse - jnp.take_along_axis(logits, t[..., None], -1)[..., 0]
    return ((nll + z * lse ** 2) * m).sum() / m.sum()

  return (h, w, t, m), full


def test_chunked_loss_equals_full_logits():
  (h, w, t, m), full = _loss_case(0)
  full = jax.jit(full)
  want, want_z = float(full(h, w, 0.0)), float(full(h, w, 1e-3))
  for chunk in (7, 16, 50):
    chunked = jax.jit(lambda h, w, z: loss_lib.chunked_cross_entropy(h, w, t, m, chunk=chunk,
                                                                      z_loss=z),
                      static_argnums=2)
    got, sums = chunked(h, w, 0.0)
    assert np.isclose(float(got), want, rtol=1e-5) and float(sums["count"]) == float(m.sum())
    got_z, _ = chunked(h, w, 1e-3)
    assert np.isclose(float(got_z), want_z, rtol=1e-5)


def test_chunked_loss_gradient_equals_autodiff_of_full_logits():
  (h, w, t, m), full = _loss_case(1)
  for z in (0.0, 1e-2):
    want = jax.jit(jax.grad(full, argnums=(0, 1)))(h, w, z)
    for chunk in (7, 50):
      got = jax.jit(jax.grad(lambda h, w: 3.0 * loss_lib.chunked_cross_entropy(
          h, w, t, m, chunk=chunk, z_loss=z)[0], argnums=(0, 1)))(h, w)
      summed = jax.jit(jax.grad(lambda h, w: loss_lib.chunked_cross_entropy(
          h, w, t, m, chunk=chunk, z_loss=z)[1]["total"], argnums=(0, 1)))(h, w)
      for g, s, e in zip(got, summed, want):
        assert np.allclose(g, 3.0 * e, rtol=1e-4, atol=1e-6)
        assert np.allclose(s, e * float(m.sum()), rtol=1e-4, atol=1e-5)


def test_rope_linear_scaling_and_yarn():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 6, 2, 16)), jnp.float32)
  pos = jnp.arange(0, 24, 4)[None]
  linear = rope.apply(x, pos, RopeConfig(scaling="linear", factor=4.0))
  assert np.allclose(linear, rope.apply(x, pos // 4, RopeConfig()), atol=1e-5)
  base, yarn = RopeConfig(), RopeConfig(scaling="yarn", factor=8.0, original_length=4096)
  inv, inv_yarn = rope.inverse_frequencies(16, base), rope.inverse_frequencies(16, yarn)
  assert inv_yarn[0] == inv[0] and np.isclose(inv_yarn[-1], inv[-1] / 8)  # high kept, low scaled
  norms = np.linalg.norm(np.asarray(rope.apply(x, pos, base)), axis=-1)
  assert np.allclose(norms, np.linalg.norm(np.asarray(x), axis=-1), rtol=1e-5)


@pytest.mark.parametrize("size, vocab, low, high", [("150m", 32000, 120e6, 180e6),
                                                    ("1b", 128256, 1.0e9, 1.6e9),
                                                    ("8b", 128256, 7.0e9, 8.5e9)])
def test_named_sizes(size, vocab, low, high):
  cfg = config.from_dict({"model": {"size": size, "vocab_size": vocab},
                          "stages": [{"seq_len": 128, "batch": 1, "steps": 1}]})
  model = build.model_for(cfg, 0)
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), *build._dummy(model, 8)))
  n = build.count_params(shapes["params"])
  assert low <= n <= high, n


def test_flops_count_causal_attention():
  cfg = dataclasses.replace(make_config().model, vocab_size=V)
  dense = build.flops_per_token(cfg, L, attended=0)
  model = build.model_for(make_config(), 0)
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), *build._dummy(model, 8)))
  params = shapes["params"]
  params = nn.meta.unbox(params)
  matmul = build.count_params(params) - params["embedding"].size - sum(
      x.size for path, x in jax.tree_util.tree_leaves_with_path(nn.meta.unbox(params))
      if "norm" in jax.tree_util.keystr(path))
  assert dense == 6 * matmul
  causal = build.flops_per_token(cfg, L) - dense
  assert causal == 3 * cfg.n_layers * 4 * cfg.n_heads * cfg.head_dim * (L + 1) / 2
  seg = np.repeat(np.arange(1, 5), 16)[None]
  assert build.mean_attended(seg) == 17 / 2

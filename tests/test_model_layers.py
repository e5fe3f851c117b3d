"""The layer plan (maxlm/model/layers.py): which layer is which, and scanned groups equal to
the unrolled model."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from maxlm import config as config_lib
from maxlm.model import layers
from maxlm.model.transformer import Decoder, Settings


def _model_cfg(*overrides, **fields):
  cfg = config_lib.load("configs/demo.yaml", list(overrides)).model
  return dataclasses.replace(cfg, vocab_size=64, d_model=32, n_heads=2, n_kv_heads=1,
                             head_dim=16, d_ff=48, **fields)


def test_specs_follow_the_documented_rules():
  cfg = _model_cfg("model.n_layers=7", "model.moe.experts=4", "model.moe.first_dense=1",
                   "model.moe.every=2", "model.attention.window=16",
                   "model.attention.global_every=3")
  got = [(s.moe, s.window) for s in layers.specs(cfg)]
  assert got == [(False, 16), (False, 16), (True, 0), (False, 16), (True, 16), (False, 0),
                 (True, 16)]


def test_hash_routed_layers_are_the_first_moe_layers_and_a_group_of_their_own():
  cfg = _model_cfg("model.n_layers=7", "model.moe.experts=4", "model.moe.first_dense=1",
                   "model.moe.hash_layers=2")
  assert [s.hashed for s in layers.specs(cfg)] == [False, True, True, False, False, False, False]
  assert [(g.first, g.repeats, len(g.unit)) for g in layers.groups(cfg)] == [
      (0, 1, 1), (1, 2, 1), (3, 4, 1)]


def test_a_uniform_model_is_one_stack_named_layers_as_before():
  cfg = _model_cfg("model.n_layers=3")
  assert layers.groups(cfg) == (layers.Group(0, (layers.LayerSpec(),), 3),)
  assert layers.layer_names(cfg) == ["layers"]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 13), experts=st.sampled_from([0, 4]), first=st.integers(0, 3),
       every=st.integers(1, 3), window=st.sampled_from([0, 8]),
       g=st.sampled_from([0, 2, 3, 4]),  # 1 with a window is refused (test_config)
       hashed=st.integers(0, 3))
def test_groups_cover_every_layer_once_with_its_spec(n, experts, first, every, window, g,
                                                     hashed):
  first = min(first, n - 1)
  every = min(every, n - first)  # a larger one leaves no MoE layer: refused (test_config)
  hashed = min(hashed, (n - first) // every) if experts else 0
  cfg = _model_cfg(f"model.n_layers={n}", f"model.moe.experts={experts}",
                   f"model.moe.first_dense={first}", f"model.moe.every={every}",
                   f"model.attention.window={window}", f"model.attention.global_every={g}",
                   f"model.moe.hash_layers={hashed}")
  flat = []
  for group in layers.groups(cfg):
    assert group.first == len(flat)
    flat += list(group.unit) * group.repeats
  assert tuple(flat) == layers.specs(cfg)


def _inputs():
  tokens = jnp.arange(24).reshape(2, 12) % 64
  positions = jnp.tile(jnp.arange(12), (2, 1))
  segments = jnp.concatenate([jnp.ones((2, 7), jnp.int32), 2 * jnp.ones((2, 5), jnp.int32)], 1)
  return tokens, positions, segments


@pytest.mark.parametrize("n_layers", [5, 6])
def test_scanned_groups_equal_the_unrolled_model_on_the_same_weights(n_layers):
  cfg = _model_cfg(f"model.n_layers={n_layers}", "model.attention.window=4",
                   "model.attention.global_every=2")
  run = Settings(rope=config_lib.RopeConfig(), impl="reference")
  scanned = Decoder(cfg, run)
  params = nn.meta.unbox(jax.jit(scanned.init)(jax.random.key(0), *_inputs())["params"])
  assert "group_0" in params and "layers" not in params
  unrolled_cfg = dataclasses.replace(cfg, scan_layers=False)
  per_layer = layers.per_layer(params, cfg)
  assert len(per_layer) == n_layers
  unrolled = {k: v for k, v in params.items() if k not in layers.layer_names(cfg)}
  unrolled.update(layers.from_per_layer(per_layer, unrolled_cfg))
  assert sorted(k for k in unrolled if k.startswith("layer_")) == sorted(
      f"layer_{i}" for i in range(n_layers))
  h_scanned = jax.jit(scanned.apply)({"params": params}, *_inputs())[0]
  h_unrolled = jax.jit(Decoder(unrolled_cfg, run).apply)({"params": unrolled}, *_inputs())[0]
  np.testing.assert_allclose(h_scanned, h_unrolled, atol=2e-6)
  restacked = layers.from_per_layer(per_layer, cfg, stack=jnp.stack)
  for a, b in zip(jax.tree_util.tree_leaves(restacked),
                  jax.tree_util.tree_leaves({k: params[k] for k in layers.layer_names(cfg)})):
    np.testing.assert_array_equal(a, b)

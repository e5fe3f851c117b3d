import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from randparams import random_params

from maxlm import config
from maxlm.config_model import MoeConfig
from maxlm.model import build, experts, grouped as grouped_lib, layers, moe

B, L, D, E, F = 2, 24, 32, 6, 16
# jitted once each: op-by-op dispatch of the eager functions is slower than compiling them
grouped = jax.jit(experts.experts_grouped, static_argnums=(5,), static_argnames=("impl",))
loop = jax.jit(experts.experts_loop, static_argnums=(5,))
route = jax.jit(moe.route, static_argnums=(3,))


def model_config(**moe_keys):
  keys = {"experts": E, "top_k": 2, "d_ff": F, **moe_keys}
  return config.from_dict({
      "model": {"size": "tiny", "vocab_size": 64, "d_model": D, "dtype": "float32",
                "moe": keys},
      "stages": [{"seq_len": L, "batch": B, "steps": 1}]}).model


def inputs(seed=0, n=B * L):
  return jax.random.normal(jax.random.key(seed), (n, D), jnp.float32)


def weights(seed=1, n_experts=E, d_ff=F):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(k1, (D, n_experts)) * 0.5,
          jax.random.normal(k2, (n_experts, D, 2, d_ff)) * 0.2,
          jax.random.normal(k3, (n_experts, d_ff, D)) * 0.2)


def segments():
  seg = np.repeat(np.arange(1, 4), L // 3)[None].repeat(B, 0).astype(np.int32)
  seg[1, L - 5:] = 0  # padding at the end of the second row
  return jnp.asarray(seg)


def apply_layer(cfg, params, x_BxLxD, seg_BxL, bias=None):
  """One jitted apply, traced afresh each call (tests swap moe._experts_fn between calls)."""
  variables = {"params": params}
  if bias is not None:
    variables["moe_bias"] = bias
  return jax.jit(lambda v, x, s: moe.MoeMlp(cfg).apply(v, x, s, mutable=["moe"]))(
      variables, x_BxLxD, seg_BxL)


@pytest.mark.parametrize("score,norm_topk,shared", [
    ("softmax", True, 0), ("softmax", False, 1), ("sigmoid", True, 1), ("sigmoid", False, 0)])
def test_layer_grouped_equals_loop_outputs_and_grads(monkeypatch, score, norm_topk, shared):
  cfg = model_config(score=score, norm_topk=norm_topk, shared_experts=shared)
  x_BxLxD = inputs().reshape(B, L, D)
  seg = segments()
  variables = jax.jit(moe.MoeMlp(cfg).init)(jax.random.key(3), x_BxLxD, seg)
  params = jax.tree_util.tree_map(lambda p: p * 10, nn.meta.unbox(variables["params"]))
  bias = {"bias": jnp.linspace(-0.1, 0.1, E)}

  def loss(p, x):
    y, _ = moe.MoeMlp(cfg).apply({"params": p, "moe_bias": bias}, x, seg, mutable=["moe"])
    return jnp.sum(jnp.sin(y)), y

  results = {}
  for name, fn in (("grouped", experts.experts_grouped), ("loop", experts.experts_loop)):
    monkeypatch.setattr(moe, "_experts_fn", lambda _s, fn=fn: fn)
    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        params, x_BxLxD)
    results[name] = (y, grads)
  (y_g, grads_g), (y_l, grads_l) = results["grouped"], results["loop"]
  assert float(jnp.max(jnp.abs(y_l))) > 1e-2  # the layer computes something
  np.testing.assert_allclose(y_g, y_l, atol=1e-5, rtol=1e-5)
  flat_g = jax.tree_util.tree_leaves_with_path(grads_g)
  flat_l = jax.tree_util.tree_leaves(grads_l)
  assert len(flat_g) == len(flat_l) == 4 + (2 if shared else 0)
  for (path, g), l in zip(flat_g, flat_l):
    assert float(jnp.max(jnp.abs(l))) > 0, path
    np.testing.assert_allclose(g, l, atol=1e-5, rtol=1e-5, err_msg=str(path))


def test_params_and_logical_names_follow_the_contract():
  cfg = model_config(shared_experts=2)
  boxed = jax.eval_shape(lambda: moe.MoeMlp(cfg).init(
      jax.random.key(0), jnp.zeros((B, L, D)), segments()))
  leaves = {"/".join(k.key for k in path): (leaf.value.shape, leaf.names)
            for path, leaf in jax.tree_util.tree_leaves_with_path(
                boxed["params"], is_leaf=lambda v: isinstance(v, nn.LogicallyPartitioned))}
  assert leaves == {
      "router/kernel": ((D, E), ("embed", None)),
      "experts/gate_up": ((E, D, 2, F), ("expert", "embed", "gate_up", "mlp")),
      "experts/down": ((E, F, D), ("expert", "mlp", "embed")),
      "shared/gate_up/kernel": ((D, 2, 2 * F), ("embed", "gate_up", "mlp")),
      "shared/down/kernel": ((2 * F, D), ("mlp", "embed"))}
  assert boxed["moe_bias"]["bias"].shape == (E,)
  assert boxed["moe_bias"]["bias"].dtype == jnp.float32


def test_capacity_drops_exactly_the_overflow_slots():
  # 8 tokens, k=2, 3 experts, capacity 3; slots in token order per expert:
  expert_TxK = jnp.array([[0, 1], [0, 2], [1, 0], [0, 1], [2, 1], [1, 0], [2, 0], [1, 2]])
  capacity = 3
  # expert 0 slots: t0,t1,t2,t3,t5,t6 -> keep t0..t2; expert 1: t0,t2,t3,t4,t5,t7 -> keep
  # t0,t2,t3; expert 2: t1,t4,t6,t7 -> keep t1,t4,t6
  kept_TxK = np.array([[1, 1], [1, 1], [1, 1], [0, 1], [1, 0], [0, 0], [1, 0], [0, 0]], bool)
  x_TxD = inputs(n=8)
  _, gate_up, down = weights(n_experts=3)
  weight_TxK = jax.random.uniform(jax.random.key(5), (8, 2)) + 0.5
  y = grouped(x_TxD, expert_TxK, weight_TxK, gate_up, down, capacity)
  y_loop = loop(x_TxD, expert_TxK, weight_TxK, gate_up, down, capacity)
  y_masked = grouped(x_TxD, expert_TxK, jnp.where(kept_TxK, weight_TxK, 0.0),
                                 gate_up, down, 0)
  y_dropless = grouped(x_TxD, expert_TxK, weight_TxK, gate_up, down, 0)
  np.testing.assert_allclose(y, y_masked, atol=1e-6)
  np.testing.assert_allclose(y_loop, y_masked, atol=1e-6)
  assert float(jnp.max(jnp.abs(y - y_dropless))) > 1e-3
  load_E = jnp.bincount(expert_TxK.reshape(-1), length=3).astype(jnp.float32)
  assert float(experts.dropped_slots(load_E, capacity)) == (~kept_TxK).sum() == 7
  assert float(experts.dropped_slots(load_E, 0)) == 0


def test_capacity_mode_layer_sows_dropped_slots_and_matches_loop(monkeypatch):
  cfg = model_config(capacity_factor=0.5, top_k=2)
  capacity = experts.capacity_for(cfg.moe, B * L)
  assert capacity == math.ceil(0.5 * B * L * 2 / E)
  x_BxLxD = inputs().reshape(B, L, D)
  seg = segments()
  params = nn.meta.unbox(jax.jit(moe.MoeMlp(cfg).init)(jax.random.key(3), x_BxLxD, seg)["params"])
  y, stats = apply_layer(cfg, params, x_BxLxD, seg)
  load_E = stats["moe"]["load"][0]
  expected = float(jnp.sum(jnp.maximum(load_E - capacity, 0)))
  assert expected > 0  # the factor is small enough that some expert overflows
  assert float(stats["moe"]["dropped"][0]) == expected
  monkeypatch.setattr(moe, "_experts_fn", lambda _s: experts.experts_loop)
  y_loop, _ = apply_layer(cfg, params, x_BxLxD, seg)
  np.testing.assert_allclose(y, y_loop, atol=1e-5)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_bias_changes_selection_not_weights(score):
  cfg = MoeConfig(experts=E, top_k=2, score=score, norm_topk=False)
  x_TxD = inputs(n=16)
  router, _, _ = weights()
  expert0, weight0, _ = route(x_TxD, router, jnp.zeros(E), cfg)
  bias_E = jnp.zeros(E).at[E - 1].set(10.0)
  expert1, weight1, _ = route(x_TxD, router, bias_E, cfg)
  assert bool(jnp.all(jnp.any(expert1 == E - 1, axis=-1)))  # the biased expert is chosen
  assert bool(jnp.any(expert1 != expert0))
  logits = x_TxD @ router
  scores = jax.nn.softmax(logits) if score == "softmax" else jax.nn.sigmoid(logits)
  np.testing.assert_allclose(weight1, jnp.take_along_axis(scores, expert1, -1), rtol=1e-5)
  np.testing.assert_allclose(weight0, jnp.take_along_axis(scores, expert0, -1), rtol=1e-5)


def test_norm_topk_weights_sum_to_one():
  cfg = MoeConfig(experts=E, top_k=3, score="sigmoid", norm_topk=True)
  _, weight, _ = route(inputs(n=16), weights()[0], jnp.zeros(E), cfg)
  np.testing.assert_allclose(jnp.sum(weight, -1), 1.0, rtol=1e-6)


def test_padding_tokens_are_not_routed_nor_counted():
  cfg = MoeConfig(experts=E, top_k=2)
  x_TxD = inputs(n=20)
  router, gate_up, down = weights()
  mask_T = jnp.arange(20) % 4 != 3  # 15 real tokens
  expert, weight, stats = route(x_TxD, router, jnp.zeros(E), cfg, mask_T)
  assert float(jnp.sum(stats["load"])) == 15 * 2
  assert bool(jnp.all(expert[~mask_T] == E)) and bool(jnp.all(weight[~mask_T] == 0))
  _, _, real_stats = route(x_TxD[mask_T], router, jnp.zeros(E), cfg)
  for name in ("load", "aux_loss", "z_loss", "entropy"):
    np.testing.assert_allclose(stats[name], real_stats[name], rtol=1e-5, err_msg=name)
  y = grouped(x_TxD, expert, weight, gate_up, down, 4)
  y_real = grouped(x_TxD[mask_T], expert[mask_T], weight[mask_T], gate_up, down, 4)
  np.testing.assert_allclose(y[mask_T], y_real, atol=1e-6)  # padding takes no capacity
  assert float(jnp.max(jnp.abs(y[~mask_T]))) == 0


def test_uniform_router_stats():
  cfg = MoeConfig(experts=E, top_k=2)
  _, _, stats = route(inputs(n=12), jnp.zeros((D, E)), jnp.zeros(E), cfg)
  np.testing.assert_allclose(stats["aux_loss"], 1.0, rtol=1e-6)  # E * sum_e f_e / E
  np.testing.assert_allclose(stats["z_loss"], math.log(E) ** 2, rtol=1e-6)
  np.testing.assert_allclose(stats["entropy"], math.log(E), rtol=1e-6)


def test_aux_loss_counts_imbalance():
  cfg = MoeConfig(experts=4, top_k=1)
  router = jnp.zeros((D, 4))
  bias_E = jnp.array([1.0, 0, 0, 0])  # every token to expert 0, scores still uniform
  _, _, stats = route(inputs(n=8), router, bias_E, cfg)
  np.testing.assert_allclose(stats["load"], [8, 0, 0, 0])
  np.testing.assert_allclose(stats["aux_loss"], 4 * 1.0 * 0.25, rtol=1e-6)


@pytest.mark.parametrize("sizes", [[30, 0, 41, 7, 0, 2], [0, 0, 80, 0, 0, 0], [1] * 6])
@pytest.mark.parametrize("impl", ["tiled", "megablox_interpret", "ragged_dot_tiles"])
def test_grouped_matmul_equals_ragged_dot(impl, sizes):
  m, k, n = 96, 24, 40  # rows past sum(sizes) must come out 0
  lhs = jax.random.normal(jax.random.key(0), (m, k))
  rhs = jax.random.normal(jax.random.key(1), (len(sizes), k, n))
  cotangent = jax.random.normal(jax.random.key(2), (m, n))
  sizes = jnp.asarray(sizes, jnp.int32)

  def run(which):
    fn = lambda a, b: grouped_lib.matmul(a, b, sizes, impl=which)
    return jax.jit(lambda a, b: (fn(a, b), jax.grad(
        lambda a, b: jnp.sum(fn(a, b) * cotangent), argnums=(0, 1))(a, b)))(lhs, rhs)

  (y_ref, grads_ref), (y, grads) = run("ragged_dot"), run(impl)
  np.testing.assert_allclose(y, y_ref, atol=1e-4, rtol=1e-5)
  assert float(jnp.max(jnp.abs(y[int(jnp.sum(sizes)):]))) == 0
  for a, b in zip(grads, grads_ref):
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-5)


def test_experts_grouped_equals_loop_with_each_grouped_impl():
  x_TxD = inputs(n=40)
  router, gate_up, down = weights()
  expert, weight, _ = route(x_TxD, router, jnp.zeros(E), MoeConfig(experts=E, top_k=2))
  y_loop = loop(x_TxD, expert, weight, gate_up, down, 0)
  for impl in ("tiled", "ragged_dot"):
    y = grouped(x_TxD, expert, weight, gate_up, down, 0, impl=impl)
    np.testing.assert_allclose(y, y_loop, atol=1e-5, rtol=1e-5, err_msg=impl)
  assert grouped_lib.default_impl() == "tiled"  # CPU here


def test_layer_without_bias_state_selects_unbiased():
  cfg = model_config()
  x_BxLxD = inputs().reshape(B, L, D)
  variables = jax.jit(moe.MoeMlp(cfg).init)(jax.random.key(3), x_BxLxD, segments())
  params = nn.meta.unbox(variables["params"])
  y_zero_bias, _ = apply_layer(cfg, params, x_BxLxD, segments(), {"bias": jnp.zeros(E)})
  y_params_only, _ = apply_layer(cfg, params, x_BxLxD, segments())
  np.testing.assert_array_equal(y_zero_bias, y_params_only)
  y_biased, _ = apply_layer(cfg, params, x_BxLxD, segments(),
                            {"bias": jnp.zeros(E).at[0].set(5.0)})
  assert float(jnp.max(jnp.abs(y_biased - y_zero_bias))) > 1e-4


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), top_k=st.integers(1, 3), score=st.sampled_from(
    ["softmax", "sigmoid"]))
def test_token_permutation_permutes_outputs(seed, top_k, score):
  cfg = MoeConfig(experts=E, top_k=top_k, score=score)
  x_TxD = inputs(seed, n=16)
  router, gate_up, down = weights(seed + 1)
  perm = np.random.default_rng(seed).permutation(16)

  def layer(x):
    expert, weight, stats = route(x, router, jnp.zeros(E), cfg)
    return grouped(x, expert, weight, gate_up, down, 0), stats["load"]

  y, load = layer(x_TxD)
  y_perm, load_perm = layer(x_TxD[perm])
  np.testing.assert_allclose(y_perm, y[perm], atol=1e-6)
  np.testing.assert_array_equal(load_perm, load)


@pytest.mark.parametrize("first_dense,every,moe_layers", [(1, 2, [2]), (0, 2, [1, 3])])
def test_decoder_places_moe_layers_by_the_plan(first_dense, every, moe_layers):
  cfg = config.from_dict({
      "model": {"size": "tiny", "vocab_size": 64, "d_model": D, "n_layers": 4, "dtype": "float32",
                "moe": {"experts": 4, "top_k": 2, "every": every, "first_dense": first_dense,
                        "shared_experts": 1, "d_ff": F}},
      "stages": [{"seq_len": L, "batch": B, "steps": 1, "attention": "reference"}]})
  assert [i for i, spec in enumerate(layers.specs(cfg.model)) if spec.moe] == moe_layers
  model = build.model_for(cfg, 0)
  tokens = jax.random.randint(jax.random.key(0), (B, L), 0, 64)
  positions = jnp.broadcast_to(jnp.arange(L), (B, L))
  seg = segments()
  variables = jax.jit(model.init)(jax.random.key(1), tokens, positions, seg)
  params = nn.meta.unbox(variables["params"])
  for i, layer in enumerate(layers.per_layer(params, cfg.model)):
    expected = {"moe"} if i in moe_layers else {"mlp"}
    assert {"moe", "mlp"} & set(layer) == expected, i
    if i in moe_layers:
      assert layer["moe"]["experts"]["gate_up"].shape == (4, D, 2, F)
      assert layer["moe"]["shared"]["down"]["kernel"].shape == (F, D)
  bias = variables["moe_bias"]
  (h, _, _), stats = jax.jit(lambda v: model.apply(v, tokens, positions, seg, mutable=["moe"]))(
      {"params": params, "moe_bias": bias})
  assert h.shape == (B, L, D) and bool(jnp.all(jnp.isfinite(h)))
  loads = [leaf.reshape(-1, 4) for path, leaf in jax.tree_util.tree_leaves_with_path(
      stats["moe"]) if "'load'" in jax.tree_util.keystr(path)]
  load_LxE = np.concatenate(loads)  # one row per MoE layer
  np.testing.assert_array_equal(load_LxE.sum(-1), [int(jnp.sum(seg > 0)) * 2] * len(moe_layers))
  assert sum(b.size for b in jax.tree_util.tree_leaves(bias)) == 4 * len(moe_layers)


def test_layer_computes_in_the_model_dtype_with_float32_params():
  cfg32 = model_config(shared_experts=1)
  cfg16 = dataclasses.replace(cfg32, dtype="bfloat16")
  x_BxLxD = inputs().reshape(B, L, D)
  variables = jax.jit(moe.MoeMlp(cfg16).init)(jax.random.key(3), x_BxLxD, segments())
  params = nn.meta.unbox(variables["params"])
  assert all(p.dtype == jnp.float32 for p in jax.tree_util.tree_leaves(params))
  y16, _ = apply_layer(cfg16, params, x_BxLxD, segments())
  y32, _ = apply_layer(cfg32, params, x_BxLxD, segments())
  assert y16.dtype == jnp.bfloat16 and y32.dtype == jnp.float32
  scale = float(jnp.max(jnp.abs(y32)))
  np.testing.assert_allclose(y16.astype(jnp.float32), y32, atol=0.05 * scale)


def test_deepseek_v4_routing_equals_transformers():
  """sqrt_softplus scores, the selection bias, route_scale and the clamped SwiGLU of routed and
  shared experts against transformers' DeepseekV4SparseMoeBlock (a learned-router layer)."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf
  limit = 0.4  # low enough that the clamp acts on these activations
  cfg = model_config(score="sqrt_softplus", route_scale=1.5, swiglu_limit=limit,
                     shared_experts=1)
  x_BxLxD = inputs(5).reshape(B, L, D)
  seg = jnp.ones((B, L), jnp.int32)
  params = random_params(moe.MoeMlp(cfg), (x_BxLxD, seg), seed=4)
  bias = jax.random.normal(jax.random.key(6), (E,)) * 0.1
  y, _ = apply_layer(cfg, params, x_BxLxD, seg, {"bias": bias})
  ref = hf.DeepseekV4SparseMoeBlock(transformers.DeepseekV4Config(
      hidden_size=D, moe_intermediate_size=F, n_routed_experts=E, num_experts_per_tok=2,
      n_shared_experts=1, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5,
      swiglu_limit=limit, num_hidden_layers=1, mlp_layer_types=["moe"], vocab_size=64,
      num_attention_heads=2, head_dim=16), 0)
  t = lambda a: torch.from_numpy(np.asarray(a, np.float32))  # noqa: E731
  gate_up, down = params["experts"]["gate_up"], params["experts"]["down"]  # [E,D,2,F], [E,F,D]
  shared_gate_up = params["shared"]["gate_up"]["kernel"]  # [D, 2, F]
  with torch.no_grad():
    ref.gate.weight.copy_(t(params["router"]["kernel"]).T)
    ref.gate.e_score_correction_bias.copy_(t(bias))
    ref.experts.gate_up_proj.copy_(t(gate_up).permute(0, 2, 3, 1).reshape(E, 2 * F, D))
    ref.experts.down_proj.copy_(t(down).transpose(1, 2))
    ref.shared_experts.gate_proj.weight.copy_(t(shared_gate_up[:, 0]).T)
    ref.shared_experts.up_proj.weight.copy_(t(shared_gate_up[:, 1]).T)
    ref.shared_experts.down_proj.weight.copy_(t(params["shared"]["down"]["kernel"]).T)
    expected = ref(t(x_BxLxD)).numpy()
  np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-5)


def test_hash_table_gives_each_token_k_distinct_experts_the_same_everywhere():
  table = moe.hash_table(1000, 6, 4)
  assert table.shape == (1000, 4) and table.min() >= 0 and table.max() < 6
  assert all(len(set(row)) == 4 for row in table.tolist())
  assert np.array_equal(table, moe.hash_table(1000, 6, 4))
  # every start and every stride coprime to 6 (1 and 5) occurs, and the load is even
  assert len({tuple(row) for row in table.tolist()}) == 12
  load = np.bincount(table.reshape(-1), minlength=6)
  assert load.min() > 0.85 * load.mean()


def test_a_hash_routed_layer_equals_transformers_hash_moe_block():
  """The experts come from the token id (our table loaded as transformers' tid2eid), the
  weights from the sqrt_softplus scores; the selection bias plays no part."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf
  cfg = dataclasses.replace(model_config(score="sqrt_softplus", route_scale=1.5, hash_layers=1),
                            vocab_size=64)
  x_BxLxD = inputs(7).reshape(B, L, D)
  seg = jnp.ones((B, L), jnp.int32)
  tokens = jax.random.randint(jax.random.key(8), (B, L), 0, 64)
  layer = moe.MoeMlp(cfg, hashed=True)
  params = nn.meta.unbox(jax.jit(layer.init)(jax.random.key(3), x_BxLxD, seg, tokens)["params"])
  bias = {"bias": jax.random.normal(jax.random.key(9), (E,))}  # would change a top-k choice
  y, _ = jax.jit(lambda v, x, s, t: layer.apply(v, x, s, t, mutable=["moe"]))(
      {"params": params, "moe_bias": bias}, x_BxLxD, seg, tokens)
  ref = hf.DeepseekV4SparseMoeBlock(transformers.DeepseekV4Config(
      hidden_size=D, moe_intermediate_size=F, n_routed_experts=E, num_experts_per_tok=2,
      n_shared_experts=1, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5,
      swiglu_limit=1e9, num_hidden_layers=1, mlp_layer_types=["hash_moe"], vocab_size=64,
      num_attention_heads=2, head_dim=16), 0)
  t = lambda a: torch.from_numpy(np.asarray(a))  # noqa: E731
  gate_up, down = params["experts"]["gate_up"], params["experts"]["down"]
  with torch.no_grad():
    ref.gate.weight.copy_(t(params["router"]["kernel"]).T)
    ref.gate.tid2eid.copy_(t(moe.hash_table(64, E, 2)).long())
    ref.experts.gate_up_proj.copy_(t(gate_up).permute(0, 2, 3, 1).reshape(E, 2 * F, D))
    ref.experts.down_proj.copy_(t(down).transpose(1, 2))
    for p in ref.shared_experts.parameters():
      p.zero_()  # this layer has no shared experts
    expected = ref(t(x_BxLxD), input_ids=t(tokens).long()).numpy()
  np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-5)

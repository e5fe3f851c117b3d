"""Mixture-of-experts MLP (`model.moe`): top-k routing, routed SwiGLU experts, shared experts.

`MoeMlp` replaces the dense `Mlp` in the layers `maxlm/model/layers.py` marks MoE. Routing is one
pure function; the expert computation after it is maxlm/model/experts.py's on one device, or
maxlm/model/expert_parallel.py's when the mesh splits the experts:

  route(x_TxD, router_DxE, bias_E, moe_cfg, mask_T) -> (expert_TxK, weight_TxK, stats)

Routing (DeepSeek-V3): router logits in float32; softmax, sigmoid or (DeepSeek-V4) square root
of softplus scores; the bias (collection "moe_bias", updated outside the gradient by the
training step) only chooses the top k, the weights are the unbiased scores of the chosen
experts, renormalized over them with `norm_topk`, times `route_scale`. `swiglu_limit` clamps
the experts' activations as DeepSeek-V4 does.
A slot whose token is padding (segment id 0) is routed to the sentinel expert E with weight 0:
the expert computation computes nothing for it and counts it in neither load nor capacity.

Per-layer statistics are sown into collection "moe": load [E] (real token slots per expert,
float32), aux_loss (Switch/GShard E * sum_e f_e P_e), z_loss (mean logsumexp^2 of the logits),
entropy (mean over tokens of the score distribution's entropy) and dropped (capacity mode: the
slots over their expert's capacity).
"""

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from maxlm.model import expert_parallel, experts, impl as impl_lib
from maxlm.model.mlp import Mlp


def hash_table(vocab, n_experts, k):
  """table_VxK: the experts a hash-routed layer sends token id v to, k distinct ones:
  (a_v + j s_v) mod E for j < k, with a_v and s_v (s_v coprime to E) drawn once from a fixed
  seed. A property of the model's shape, so every run and every process agrees."""
  rng = np.random.default_rng(0)
  units = np.array([s for s in range(1, n_experts + 1) if math.gcd(s, n_experts) == 1])
  start_V = rng.integers(0, n_experts, vocab)
  stride_V = units[rng.integers(0, len(units), vocab)]
  return ((start_V[:, None] + np.arange(k)[None] * stride_V[:, None]) % n_experts).astype(
      np.int32)


def route(x_TxD, router_DxE, bias_E, cfg, mask_T=None, chosen_TxK=None):
  """Top-k routing for T tokens; cfg is config_model.MoeConfig. mask_T (bool) marks real tokens.
  chosen_TxK: the experts, fixed in advance (a hash-routed layer); then only the weights come
  from the scores, and the bias is not used.

  Returns expert_TxK int32 (E for a masked token), weight_TxK float32 (0 for a masked token) and
  stats {load [E], aux_loss, z_loss, entropy} over the real tokens."""
  n_experts = router_DxE.shape[1]
  logits_TxE = jnp.dot(x_TxD.astype(jnp.float32), router_DxE.astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)
  if cfg.score == "softmax":
    scores_TxE = jax.nn.softmax(logits_TxE, axis=-1)
  elif cfg.score == "sqrt_softplus":
    scores_TxE = jnp.sqrt(jax.nn.softplus(logits_TxE))
  else:
    scores_TxE = jax.nn.sigmoid(logits_TxE)
  if chosen_TxK is None:
    choice_TxE = scores_TxE + jax.lax.stop_gradient(bias_E.astype(jnp.float32))
    _, expert_TxK = jax.lax.top_k(jax.lax.stop_gradient(choice_TxE), cfg.top_k)
  else:
    expert_TxK = chosen_TxK
  weight_TxK = jnp.take_along_axis(scores_TxE, expert_TxK, axis=-1)
  if cfg.norm_topk:
    weight_TxK = weight_TxK / (jnp.sum(weight_TxK, axis=-1, keepdims=True) + 1e-20)
  weight_TxK = weight_TxK * cfg.route_scale
  if mask_T is None:
    mask_T = jnp.ones(x_TxD.shape[0], bool)
  expert_TxK = jnp.where(mask_T[:, None], expert_TxK, n_experts).astype(jnp.int32)
  weight_TxK = jnp.where(mask_T[:, None], weight_TxK, 0.0)
  return expert_TxK, weight_TxK, _route_stats(logits_TxE, scores_TxE, expert_TxK, mask_T, cfg)


def _route_stats(logits_TxE, scores_TxE, expert_TxK, mask_T, cfg):
  n_experts = logits_TxE.shape[1]
  real_T = mask_T.astype(jnp.float32)
  n_real = jnp.maximum(jnp.sum(real_T), 1.0)
  load_E = jnp.bincount(expert_TxK.reshape(-1), length=n_experts).astype(jnp.float32)
  probs_TxE = scores_TxE
  if cfg.score != "softmax":  # sigmoid or sqrt_softplus scores, normalized per token
    probs_TxE = scores_TxE / (jnp.sum(scores_TxE, axis=-1, keepdims=True) + 1e-20)
  fraction_E = load_E / (n_real * cfg.top_k)
  mean_prob_E = jnp.sum(probs_TxE * real_T[:, None], axis=0) / n_real
  lse_T = jax.nn.logsumexp(logits_TxE, axis=-1)
  entropy_T = -jnp.sum(probs_TxE * jnp.log(jnp.maximum(probs_TxE, 1e-30)), axis=-1)
  return {"load": load_E,
          "aux_loss": n_experts * jnp.sum(fraction_E * mean_prob_E),
          "z_loss": jnp.sum(real_T * lse_T * lse_T) / n_real,
          "entropy": jax.lax.stop_gradient(jnp.sum(real_T * entropy_T) / n_real)}


class _Router(nn.Module):
  n_experts: int
  std: float

  @nn.compact
  def __call__(self, d):
    return self.param("kernel", nn.with_logical_partitioning(
        nn.initializers.normal(self.std), ("embed", None)), (d, self.n_experts), jnp.float32)


class _Experts(nn.Module):
  n_experts: int
  d_ff: int
  std: float
  out_std: float

  @nn.compact
  def __call__(self, d):
    e, f = self.n_experts, self.d_ff
    gate_up = self.param("gate_up", nn.with_logical_partitioning(
        nn.initializers.normal(self.std), ("expert", "embed", "gate_up", "mlp")),
        (e, d, 2, f), jnp.float32)
    down = self.param("down", nn.with_logical_partitioning(
        nn.initializers.normal(self.out_std), ("expert", "mlp", "embed")), (e, f, d), jnp.float32)
    return gate_up, down


def _experts_fn(settings):
  """experts_grouped, or the expert-parallel version when the mesh splits the experts, or
  splits the tokens on an accelerator: XLA cannot partition a kernel (megablox on TPU), and on
  GPU it partitions the sort and the ragged matmul over all tokens (the 150M MoE of
  tools/bench_compile_memory.py: 12.4 GiB a GPU, 3.1 sorted per device), so each device
  sorts and multiplies its own tokens, as under expert parallelism (with one expert shard: no
  exchange)."""
  mesh = getattr(settings, "mesh", None)
  impl = impl_lib.grouped_impl(getattr(settings, "platform", None) or jax.default_backend())
  per_device = mesh is not None and (mesh.shape.get("expert", 1) > 1 or (
      impl in ("megablox", "ragged_dot_tiles") and mesh.devices.size > 1))
  if per_device:
    return functools.partial(expert_parallel.experts_sharded, impl=impl, mesh=mesh, batch_axes=
                             expert_parallel.token_axes(settings.rules, mesh.axis_names))
  return functools.partial(experts.experts_grouped, impl=impl)


class MoeMlp(nn.Module):
  """Routed experts (+ shared experts) in place of a layer's Mlp; cfg is the ModelConfig."""
  cfg: Any
  settings: Any = None  # transformer.Settings; its mesh decides expert parallelism
  hashed: bool = False  # experts chosen by token id (hash_table), not by the router

  @nn.compact
  def __call__(self, x_BxLxD, segment_ids_BxL=None, tokens_BxL=None):
    c, m = self.cfg, self.cfg.moe
    dt = jnp.dtype(c.dtype)
    b, length, d = x_BxLxD.shape
    d_ff = m.d_ff or c.d_ff
    router_DxE = _Router(m.experts, c.init_std, name="router")(d)
    gate_up, down = _Experts(m.experts, d_ff, c.init_std, c.init_std / (2 * c.n_layers) ** 0.5,
                             name="experts")(d)
    if self.is_initializing() or self.has_variable("moe_bias", "bias"):
      bias_E = self.variable("moe_bias", "bias", jnp.zeros, (m.experts,), jnp.float32).value
    else:  # applied with parameters only (export, sampling): no bias state, selection unbiased
      bias_E = jnp.zeros((m.experts,), jnp.float32)
    x_TxD = x_BxLxD.astype(dt).reshape(b * length, d)
    mask_T = None if segment_ids_BxL is None else segment_ids_BxL.reshape(-1) > 0
    chosen_TxK = None
    if self.hashed:
      table_VxK = jnp.asarray(hash_table(c.vocab_size, m.experts, m.top_k))
      chosen_TxK = jnp.take(table_VxK, tokens_BxL.reshape(-1), axis=0)
    expert_TxK, weight_TxK, stats = route(x_TxD, router_DxE, bias_E, m, mask_T, chosen_TxK)
    capacity = experts.capacity_for(m, b * length)
    y_TxD = _experts_fn(self.settings)(x_TxD, expert_TxK, weight_TxK, gate_up, down, capacity,
                                       limit=m.swiglu_limit)
    stats["dropped"] = experts.dropped_slots(stats["load"], capacity)
    for name, value in stats.items():
      self.sow("moe", name, value)
    y_BxLxD = y_TxD.reshape(b, length, d).astype(dt)
    if m.shared_experts:
      shared_cfg = dataclasses.replace(c, d_ff=m.shared_experts * d_ff)
      y_BxLxD = y_BxLxD + Mlp(shared_cfg, m.swiglu_limit, name="shared")(x_BxLxD)
    return y_BxLxD

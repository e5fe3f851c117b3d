"""The decoder: Llama-style, in Flax Linen, every parameter and activation logically named.

Linen rather than NNX: its parameters are a plain pytree that jit shardings, optax and Orbax
take as they are, and `nn.scan` stacks the layers so compile time does not grow with depth.

embedding -> n x [RMSNorm -> GQA attention (RoPE on positions) -> RMSNorm -> SwiGLU] -> RMSNorm
With `model.mtp.depth` 1 one more block predicts the token after next (mtp.py). With
`model.mhc.streams` N > 0 the residual is N streams, collapsed into each block's input and
spread back from its output by hyper-connections (mhc.py), and collapsed once more at the end.
The forward returns the final hidden states and the largest attention logit; the vocabulary
projection happens inside the chunked loss (`loss`), so [B, L, vocab] is never built whole.
"""

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxlm import MaxlmError
from maxlm.model import impl as impl_lib, layers as layers_lib, mhc, moe, mqa, mtp
from maxlm.model import rope as rope_lib
from maxlm.model.dense import constrain, dense, init, rms
from maxlm.model.mlp import Mlp
from maxlm.model.attention import attention, decode as decode_attention
from maxlm.model.indexer import Indexer

_REMAT = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@dataclasses.dataclass(frozen=True)
class Settings:
  """What one stage decides about the model's forward pass."""
  rope: Any
  impl: str = "auto"
  block_q: int = 512
  block_k: int = 512
  mesh: Any = None
  rules: Any = None  # {logical: mesh axes}
  sparse: Any = None  # config.SparseConfig; None or mode dense: no indexer
  platform: Any = None  # cpu | tpu | gpu, where the step runs (None: this process's backend)


class RMSNorm(nn.Module):
  eps: float
  dtype: Any

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                       (x.shape[-1],), jnp.float32)
    return rms(x, self.eps, scale).astype(self.dtype)


class Attention(nn.Module):
  cfg: Any
  settings: Settings
  decode: bool = False  # sampling: keys and values accumulate in the "cache" collection
  window: int = 0  # a local layer's window (layers.LayerSpec); 0: global

  @nn.compact
  def __call__(self, x_BxLxD, positions_BxL, segment_ids_BxL):
    c, s = self.cfg, self.settings
    dt = jnp.dtype(c.dtype)
    out_std = c.init_std / (2 * c.n_layers) ** 0.5
    q = dense((c.n_heads, c.head_dim), -1, ("embed", "q_heads", "head_dim"), c.init_std, dt,
              "query")(x_BxLxD)
    k = dense((c.n_kv_heads, c.head_dim), -1, ("embed", "kv_heads", "head_dim"), c.init_std,
              dt, "key")(x_BxLxD)
    v = dense((c.n_kv_heads, c.head_dim), -1, ("embed", "kv_heads", "head_dim"), c.init_std,
              dt, "value")(x_BxLxD)
    q_BxLxHxD = constrain(rope_lib.apply(q, positions_BxL, s.rope),
                          ("batch", "length", "act_heads", None))
    k_BxLxKxD = constrain(rope_lib.apply(k, positions_BxL, s.rope),
                          ("batch", "length", "act_kv_heads", None))
    v_BxLxKxD = constrain(v, ("batch", "length", "act_kv_heads", None))
    mode = s.sparse.mode if s.sparse is not None else "dense"
    if self.window and mode != "dense":
      raise MaxlmError(f"sparse attention (mode {mode}) has no sliding window: set "
                       "model.attention.window=0 or the stage's sparse.mode=dense")
    index = None  # the indexer's parameters exist from the first non-dense stage on
    if mode != "dense":
      index = Indexer(c, s.sparse, s.rope, name="indexer")(x_BxLxD, positions_BxL)
    if self.decode:  # sampling attends densely over the cache
      out, peak = self._cached(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, segment_ids_BxL)
    else:
      out, peak = self._attend(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, segment_ids_BxL, index)
    out = constrain(out, ("batch", "length", "act_heads", None))
    y = dense(c.d_model, (-2, -1), ("q_heads", "head_dim", "embed"), out_std, dt, "out")(out)
    return y, peak

  def _attend(self, q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, segment_ids_BxL, index):
    """(out, peak) of the stage's attention; an indexer stage's statistics are sown."""
    c, s = self.cfg, self.settings
    rules = s.rules or {}
    result = attention(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, segment_ids_BxL, impl=s.impl,
                       block_q=s.block_q, block_k=s.block_k, mesh=s.mesh,
                       batch_axes=tuple(rules.get("batch", ())) or None,
                       head_axes=tuple(rules.get("act_heads", ())) or None,
                       max_logit=c.max_logit, window=self.window, platform=s.platform,
                       sparse=s.sparse if index is not None else None, index=index)
    if index is not None:
      out, peak, stats = result
      self._sow(stats)
      return out, peak
    return result if c.max_logit else (result, jnp.float32(jnp.nan))

  def _sow(self, stats):
    for name, value in stats.items():  # summed over layers by build.loss_fn
      self.sow("sparse", name, value)

  def _cached(self, q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, segment_ids_BxL):
    """Rows continued together (eval/sample.py): the new keys, values and segment ids are
    written at the cache index, one slot index shared by every row, and each query (slots
    index..index+L-1) attends to the cached slots up to itself that hold its own segment id.
    A slot of segment 0 (a shorter prompt's left padding, or not yet written) is never seen.
    The cache's length is the length of the input it was initialised with; it is laid out
    [B, K, slots, D] for attention.decode."""
    b, n, kh, d = k_BxLxKxD.shape
    initialised = self.has_variable("cache", "cached_key")
    key = self.variable("cache", "cached_key", jnp.zeros, (b, kh, n, d), k_BxLxKxD.dtype)
    value = self.variable("cache", "cached_value", jnp.zeros, (b, kh, n, d), v_BxLxKxD.dtype)
    segment = self.variable("cache", "cached_segment", jnp.zeros, (b, n), jnp.int32)
    index = self.variable("cache", "cache_index", lambda: jnp.zeros((), jnp.int32))
    if not initialised:
      return jnp.zeros_like(q_BxLxHxD), jnp.float32(0)
    i = index.value
    key.value = jax.lax.dynamic_update_slice(key.value, k_BxLxKxD.transpose(0, 2, 1, 3),
                                             (0, 0, i, 0))
    value.value = jax.lax.dynamic_update_slice(value.value, v_BxLxKxD.transpose(0, 2, 1, 3),
                                               (0, 0, i, 0))
    segment.value = jax.lax.dynamic_update_slice(segment.value,
                                                 segment_ids_BxL.astype(jnp.int32), (0, i))
    index.value = i + n
    return decode_attention.attention(q_BxLxHxD, key.value, value.value, segment_ids_BxL,
                                      segment.value, q_offset=i, window=self.window)


class Block(nn.Module):
  cfg: Any
  settings: Settings
  spec: layers_lib.LayerSpec = layers_lib.LayerSpec()
  decode: bool = False

  @nn.compact
  def __call__(self, x, positions_BxL, segment_ids_BxL, tokens_BxL):
    """x: the residual x_BxLxD, or with hyper-connections its streams x_BxLxNxD; tokens_BxL
    (the input ids) for a hash-routed MoE layer."""
    c = self.cfg
    dt = jnp.dtype(c.dtype)

    def attend(h_BxLxD):
      normed = RMSNorm(c.norm_eps, dt, name="attention_norm")(h_BxLxD)
      if c.mqa.enabled:
        return self._v4_attention(normed, positions_BxL, segment_ids_BxL)
      return Attention(c, self.settings, self.decode, self.spec.window, name="attention")(
          normed, positions_BxL, segment_ids_BxL)

    def mlp(h_BxLxD):
      return self._mlp(RMSNorm(c.norm_eps, dt, name="mlp_norm")(h_BxLxD), segment_ids_BxL,
                       tokens_BxL)

    if c.mhc.streams:
      return self._streams(x, attend, mlp)
    h, peak = attend(x)
    x_BxLxD = constrain(x + h, ("batch", "length", "act_embed"))
    x_BxLxD = x_BxLxD + mlp(x_BxLxD)
    return constrain(x_BxLxD, ("batch", "length", "act_embed")), peak

  def _streams(self, x_BxLxNxD, attend, mlp):
    """The same two blocks, each collapsing the streams on the way in and spreading its
    output over them on the way out (maxlm/model/mhc.py)."""
    c = self.cfg
    hc = (c.mhc.streams, c.mhc.sinkhorn_iters, c.mhc.eps, c.norm_eps, c.init_std)
    names = ("batch", "length", None, "act_embed")
    inp_BxLxD, post_BxLxN, res_BxLxNxN = mhc.HyperConnection(*hc, name="attention_hc")(
        x_BxLxNxD)
    h, peak = attend(inp_BxLxD)
    x_BxLxNxD = constrain(mhc.expand(x_BxLxNxD, h, post_BxLxN, res_BxLxNxN), names)
    inp_BxLxD, post_BxLxN, res_BxLxNxN = mhc.HyperConnection(*hc, name="mlp_hc")(x_BxLxNxD)
    x_BxLxNxD = mhc.expand(x_BxLxNxD, mlp(inp_BxLxD), post_BxLxN, res_BxLxNxN)
    return constrain(x_BxLxNxD, names), peak

  def _v4_attention(self, x_BxLxD, positions_BxL, segment_ids_BxL):
    """DeepSeek-V4's attention (maxlm/model/mqa.py); it reports no attention logit."""
    c = self.cfg
    if self.decode:
      raise MaxlmError("the decoder's key-value cache does not hold DeepSeek-V4's compressed "
                       "entries (model.mqa): sample it with eval/sample.py, which reruns the "
                       "forward per token")
    s = self.settings
    block = impl_lib.mqa_block(s.impl, s.block_q)
    mode = s.sparse.mode if s.sparse is not None else "dense"
    spec = mqa.spec_for(c, self.spec.compress, s.rope.theta, block, mode)
    out = mqa.Mqa(spec, jnp.dtype(c.dtype), name="attention")(x_BxLxD, positions_BxL,
                                                              segment_ids_BxL)
    return out, jnp.float32(jnp.nan)

  def _mlp(self, x_BxLxD, segment_ids_BxL, tokens_BxL):
    if not self.spec.moe:
      return Mlp(self.cfg, name="mlp")(x_BxLxD)
    return moe.MoeMlp(self.cfg, self.settings, self.spec.hashed, name="moe")(
        x_BxLxD, segment_ids_BxL, tokens_BxL)


class Unit(nn.Module):
  """One repeating unit of differing layers (layers.groups), scanned as one."""
  cfg: Any
  settings: Settings
  unit: tuple
  decode: bool = False

  @nn.compact
  def __call__(self, x_BxLxD, positions_BxL, segment_ids_BxL, tokens_BxL):
    block = _block_class(self.cfg, self.decode)
    peak = jnp.float32(-jnp.inf)
    for j, spec in enumerate(self.unit):
      x_BxLxD, p = block(self.cfg, self.settings, spec, self.decode,
                         name=layers_lib.block_name(j))(x_BxLxD, positions_BxL, segment_ids_BxL,
                                                        tokens_BxL)
      peak = jnp.maximum(peak, p)
    return x_BxLxD, peak


_SCANNED = {"params": 0, "cache": 0, "sparse": 0, "moe": 0, "moe_bias": 0}


def _block_class(c, decode):
  if c.remat != "none" and not decode:
    return nn.remat(Block, policy=_REMAT[c.remat], prevent_cse=not c.scan_layers)
  return Block


def _scan(module, length):
  return nn.scan(module, variable_axes=_SCANNED, split_rngs={"params": True},
                 in_axes=(nn.broadcast, nn.broadcast, nn.broadcast), length=length,
                 metadata_params={nn.PARTITION_NAME: "layers"})


class Decoder(nn.Module):
  cfg: Any  # config.ModelConfig with vocab_size resolved
  settings: Settings
  decode: bool = False

  @nn.compact
  def __call__(self, tokens_BxL, positions_BxL, segment_ids_BxL):
    c = self.cfg
    dt = jnp.dtype(c.dtype)
    table_VxD = self.param("embedding", nn.with_logical_partitioning(
        init(1.0 if not c.tied_embeddings else c.init_std), ("vocab", "embed")),
        (c.vocab_size, c.d_model), jnp.float32)
    x_BxLxD = constrain(jnp.take(table_VxD.astype(dt), tokens_BxL, axis=0),
                        ("batch", "length", "act_embed"))
    if c.mhc.streams:
      streams_BxLxNxD, peak = self._layers(mhc.widen(x_BxLxD, c.mhc.streams), positions_BxL,
                                           segment_ids_BxL, tokens_BxL)
      x_BxLxD = mhc.HyperHead(c.mhc.streams, c.mhc.eps, c.norm_eps, c.init_std,
                              name="mhc_head")(streams_BxLxNxD)
    else:
      x_BxLxD, peak = self._layers(x_BxLxD, positions_BxL, segment_ids_BxL, tokens_BxL)
    if c.mtp.depth and not self.decode:  # computed only where build.loss_fn collects it
      self.sow("mtp", "hidden", mtp.Mtp(c, self.settings, _block_class(c, False), name="mtp")(
          x_BxLxD, table_VxD, tokens_BxL, positions_BxL, segment_ids_BxL))
    h_BxLxD = RMSNorm(c.norm_eps, dt, name="final_norm")(x_BxLxD)
    if c.tied_embeddings:
      head_DxV = table_VxD.T
    else:
      head_DxV = self.param("head", nn.with_logical_partitioning(init(c.init_std),
                                                                 ("embed", "vocab")),
                            (c.d_model, c.vocab_size), jnp.float32)
    return h_BxLxD, head_DxV, peak

  def _layers(self, x_BxLxD, positions_BxL, segment_ids_BxL, tokens_BxL):
    """The layers as layers.py plans them: unrolled, one scanned stack, or scanned groups."""
    c, s, decode = self.cfg, self.settings, self.decode
    args = (positions_BxL, segment_ids_BxL, tokens_BxL)
    peak = jnp.float32(-jnp.inf)
    if not c.scan_layers:
      block = _block_class(c, decode)
      for i, spec in enumerate(layers_lib.specs(c)):
        x_BxLxD, p = block(c, s, spec, decode, name=f"layer_{i}")(x_BxLxD, *args)
        peak = jnp.maximum(peak, p)
      return x_BxLxD, peak
    if layers_lib.homogeneous(c):
      stack = _scan(_block_class(c, decode), c.n_layers)
      x_BxLxD, peaks = stack(c, s, layers_lib.specs(c)[0], decode, name="layers")(x_BxLxD, *args)
      return x_BxLxD, jnp.max(peaks)
    for g, group in enumerate(layers_lib.groups(c)):
      stack = _scan(Unit, group.repeats)
      x_BxLxD, peaks = stack(c, s, group.unit, decode, name=layers_lib.group_name(g))(
          x_BxLxD, *args)
      peak = jnp.maximum(peak, jnp.max(peaks))
    return x_BxLxD, peak


def mtp_param_shapes(cfg, rope):
  """The MTP block's parameters (maxlm/model/mtp.py) as a tree of ShapeDtypeStructs, unboxed;
  `rope`: any stage's RoPE config (the shapes do not depend on it)."""
  module = mtp.Mtp(cfg, Settings(rope=rope), _block_class(cfg, False))
  length = 8
  h = jax.ShapeDtypeStruct((1, length, cfg.d_model), jnp.float32)
  table = jax.ShapeDtypeStruct((max(cfg.vocab_size, 1), cfg.d_model), jnp.float32)
  ids = jax.ShapeDtypeStruct((1, length), jnp.int32)
  shapes = jax.eval_shape(lambda *a: module.init(jax.random.key(0), *a), h, table, ids, ids, ids)
  return nn.meta.unbox(shapes["params"])

"""DeepSeek-V4's attention layer on packed rows: one shared key-value head, RoPE on part of each
head, a sliding window of the query's own document, compressed entries (CSA or HCA,
compressed.py), a learned sink per head and a grouped output projection.

For a layer's input x_BxLxD (H heads of width K, R of them rotated, m the compression rate):
  queries   q = RMSNorm_unweighted(W_qb RMSNorm(W_qa x)) per head, the last R channels rotated
            at the query's position;
  key=value kv = RMSNorm(W_kv x), one head, rotated alike;
  entries   m = 0: none. HCA: every closed window of the query's document. CSA: the indexer's
            top-k of them (its own compressor, queries from W_qa x, compressed.select);
  indexer   CSA's stage mode (`index_mode`, the stage's sparse.mode): dense attends every
            visible entry and ignores the indexer; indexer_warmup attends every visible entry
            and the indexer learns the heads' attention over them (compressed.indexer_kl,
            sown as "sparse" kl/queries/selected); sparse attends its top k and it learns on
            those. Its inputs are cut from the gradient: only that KL trains it;
  attention over the window's tokens and the entries, with the sink (compressed.attend); the
            output's last R channels turned back by the query's angle (K = V carried it);
  output    heads split into G groups, each projected to O channels, then all G O to D.
The rotation base is `theta` without compression and `compress_theta` with it, as in V4.

Written here because no JAX library has it; tests/test_model_mqa.py checks it against
transformers' DeepseekV4Attention on single documents and against each document alone on
packed rows.
"""

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxlm.model import compressed, compressed_blocks, rope as rope_lib
from maxlm.model.dense import dense, init, rms


@dataclasses.dataclass(frozen=True)
class MqaSpec:
  """One V4 attention layer's shape."""
  heads: int
  head_dim: int
  rope_dim: int
  q_lora: int
  out_groups: int
  out_lora: int
  window: int
  rate: int = 0  # 0: window only; > 0 with overlap: CSA; > 0 without: HCA
  overlap: bool = False
  index_heads: int = 0
  index_dim: int = 0
  index_top_k: int = 0
  theta: float = 10000.0
  compress_theta: float = 160000.0
  norm_eps: float = 1e-6
  init_std: float = 0.02
  block: int = 0  # queries per block (compressed_blocks.py); 0: the dense reference
  index_mode: str = "sparse"  # CSA: dense | indexer_warmup | sparse (the stage's sparse.mode)


def spec_for(cfg, rate, theta, block=0, index_mode="sparse"):
  """The MqaSpec of a layer of ModelConfig `cfg` with compression rate `rate`; `theta`: the
  stage's RoPE base, which window-only layers use (a stage's RoPE scaling is not applied);
  `block`: queries per block, 0 for the dense reference (impl.mqa_block decides);
  `index_mode`: the stage's sparse.mode, what CSA's indexer does."""
  q = cfg.mqa
  return MqaSpec(heads=cfg.n_heads, head_dim=cfg.head_dim, rope_dim=q.rope_dim, q_lora=q.q_lora,
                 out_groups=q.out_groups, out_lora=q.out_lora, window=q.window, rate=rate,
                 overlap=rate == q.csa_rate, index_heads=q.index_heads, index_dim=q.index_dim,
                 index_top_k=q.index_top_k, theta=theta, compress_theta=q.compress_theta,
                 norm_eps=cfg.norm_eps, init_std=cfg.init_std, block=block,
                 index_mode=index_mode)


class Compressor(nn.Module):
  """The entries of one series (the layer's or the indexer's): projections, slot bias, norm."""
  spec: MqaSpec
  width: int  # an entry's channels

  @nn.compact
  def __call__(self, x_BxLxD, positions_BxL, segment_ids_BxL):
    s = self.spec
    c = self.width * (2 if s.overlap else 1)
    kv = dense(c, -1, ("embed", None), s.init_std, jnp.float32, "kv")(x_BxLxD)
    gate = dense(c, -1, ("embed", None), s.init_std, jnp.float32, "gate")(x_BxLxD)
    bias = self.param("slot_bias", nn.with_logical_partitioning(nn.initializers.zeros,
                                                                ("mqa_slot", None)),
                      (s.rate, c), jnp.float32)
    scale = self.param("norm", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                       (self.width,), jnp.float32)
    pooled, end_BxE, valid_BxE = compressed.pool(kv, gate, bias, positions_BxL,
                                                 segment_ids_BxL, s.rate, s.overlap)
    at_BxE = compressed.entry_positions(positions_BxL, end_BxE, s.rate)
    entries = compressed.normalize_and_rotate(pooled, scale, s.norm_eps, at_BxE,
                                              s.compress_theta, s.rope_dim)
    return entries, end_BxE, valid_BxE


class Mqa(nn.Module):
  spec: MqaSpec
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_BxLxD, positions_BxL, segment_ids_BxL):
    s, dt = self.spec, self.dtype
    theta = s.compress_theta if s.rate else s.theta
    q_low_BxLxQ = rms(self._dense(s.q_lora, ("embed", None), "q_a")(x_BxLxD), s.norm_eps,
                       self._scale(s.q_lora, "q_a_norm"))
    # the low-rank and per-group input axes are split like `embed` (over fsdp), so no large
    # kernel is replicated on every device
    q = self._dense((s.heads, s.head_dim), ("embed", "q_heads", "head_dim"), "q_b")(q_low_BxLxQ)
    q_BxLxHxK = rope_lib.apply_tail(rms(q, s.norm_eps), positions_BxL, theta, s.rope_dim)
    kv = rms(self._dense(s.head_dim, ("embed", "head_dim"), "kv")(x_BxLxD), s.norm_eps,
              self._scale(s.head_dim, "kv_norm"))
    kv_BxLxK = rope_lib.apply_tail(kv, positions_BxL, theta, s.rope_dim)
    entries_BxExK, end_BxE, valid_BxE, index = self._entries(x_BxLxD, q_low_BxLxQ,
                                                             positions_BxL, segment_ids_BxL)
    sink_H = self.param("sink", nn.with_logical_partitioning(nn.initializers.zeros,
                                                             ("q_heads",)), (s.heads,),
                        jnp.float32)
    q_BxLxHxK, kv_BxLxK, entries_BxExK = (x.astype(dt) for x in (q_BxLxHxK, kv_BxLxK,
                                                                  entries_BxExK))
    if s.block:
      out, sums = compressed_blocks.attend(q_BxLxHxK, kv_BxLxK, entries_BxExK, end_BxE,
                                           valid_BxE, segment_ids_BxL, s.window, sink_H,
                                           s.block, index)
    else:
      out, sums = self._reference(q_BxLxHxK, kv_BxLxK, entries_BxExK, end_BxE, valid_BxE,
                                  segment_ids_BxL, sink_H, index)
    for name, value in (sums or {}).items():  # summed over layers by build.loss_fn
      self.sow("sparse", name, value)
    out = rope_lib.apply_tail(out, positions_BxL, theta, s.rope_dim, inverse=True)
    b, length = out.shape[:2]
    grouped = out.reshape(b, length, s.out_groups, s.heads * s.head_dim // s.out_groups)
    w_a = self.param("o_a", nn.with_logical_partitioning(init(s.init_std),
                                                         ("mqa_group", "embed", None)),
                     (s.out_groups, grouped.shape[-1], s.out_lora), jnp.float32)
    low = jnp.einsum("blgi,gio->blgo", grouped, w_a.astype(dt)).reshape(b, length, -1)
    return self._dense(x_BxLxD.shape[-1], (None, "embed"), "o_b")(low)

  def _reference(self, q_BxLxHxK, kv_BxLxK, entries_BxExK, end_BxE, valid_BxE,
                 segment_ids_BxL, sink_H, index):
    """(out, the indexer's KL sums or None) by the dense reference (compressed.attend)."""
    s = self.spec
    mask_BxLxE = compressed.visible(segment_ids_BxL, end_BxE, valid_BxE)
    if index is None:
      return compressed.attend(q_BxLxHxK, kv_BxLxK, entries_BxExK, mask_BxLxE,
                               segment_ids_BxL, s.window, sink_H), None
    q_idx, w_idx, keys_BxExC, top_k = index
    scores_BxLxE = compressed.index_scores(q_idx, w_idx, keys_BxExC)
    mask_BxLxE = compressed.select(scores_BxLxE, mask_BxLxE, top_k)
    out, probs = compressed.attend_with_entry_probs(q_BxLxHxK, kv_BxLxK, entries_BxExK,
                                                    mask_BxLxE, segment_ids_BxL, s.window,
                                                    sink_H)
    return out, compressed.indexer_kl(probs, scores_BxLxE, mask_BxLxE)

  def _entries(self, x_BxLxD, q_low_BxLxQ, positions_BxL, segment_ids_BxL):
    """(entries_BxExK, end_BxE, valid_BxE, index): the compressed entries, where each one's
    window closed, and for CSA the indexer's (queries, head weights, keys, top_k: 0 for every
    visible entry); None for HCA and in a dense stage, where every visible entry is attended.
    A window-only layer has no entries."""
    s = self.spec
    b = x_BxLxD.shape[0]
    if not s.rate:
      return (jnp.zeros((b, 0, s.head_dim)), jnp.zeros((b, 0), jnp.int32),
              jnp.zeros((b, 0), bool), None)
    entries, end_BxE, valid_BxE = Compressor(s, s.head_dim, name="compressor")(
        x_BxLxD, positions_BxL, segment_ids_BxL)
    if not s.overlap:
      return entries, end_BxE, valid_BxE, None
    x_BxLxD, q_low_BxLxQ = jax.lax.stop_gradient((x_BxLxD, q_low_BxLxQ))
    keys_BxExC, _, _ = Compressor(s, s.index_dim, name="index_compressor")(
        x_BxLxD, positions_BxL, segment_ids_BxL)
    q_BxLxJxC = self._dense((s.index_heads, s.index_dim), ("embed", None, None), "index_q")(
        q_low_BxLxQ)
    q_BxLxJxC = rope_lib.apply_tail(q_BxLxJxC, positions_BxL, s.compress_theta, s.rope_dim)
    w_BxLxJ = self._dense(s.index_heads, ("embed", None), "index_weights")(x_BxLxD)
    if s.index_mode == "dense":  # its parameters exist for the later stages; unused here
      return entries, end_BxE, valid_BxE, None
    top_k = s.index_top_k if s.index_mode == "sparse" else 0
    index = (q_BxLxJxC, w_BxLxJ * s.index_heads ** -0.5, keys_BxExC, top_k)
    return entries, end_BxE, valid_BxE, index

  def _dense(self, features, names, name):
    return dense(features, -1, names, self.spec.init_std, self.dtype, name)

  def _scale(self, width, name):
    return self.param(name, nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                      (width,), jnp.float32)

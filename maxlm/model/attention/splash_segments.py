"""TPU splash attention that skips (query block, key block) pairs across document boundaries.

Splash's own mask machinery builds its block-level mask information (`MaskInfo`: which blocks
run, and which key/query block to fetch next) from a *static* mask in NumPy, so with segment ids
it only skips blocks above the causal diagonal: a row of 32 documents still computes the whole
lower triangle. Here the same `MaskInfo` arrays are built per batch row at run time from
`segment_ids` (jnp, under jit), and handed to splash's own kernels through its public pytree
`SplashAttentionKernel`: no kernel code of ours. A pair with no visible position has
`block_mask` 0, so its body never runs, and its `data_next` points at the next block that does
run, so the pipeline issues no copy for it either (forward, dQ and dKV kernels alike).

`visible_blocks` is the rule: a pair is visited iff it is at or below the causal diagonal and
the blocks' non-zero segment ranges overlap; with a window W (a local layer) also its key block
ends at or after the query block's first position - W + 1 (the mask function then adds
i - W < j). For packed rows (sorted segments, padding last) that is exactly the set of pairs
holding a visible position; for any other row it is a superset (splash still applies the exact
segment and causal mask inside each visited block).

Limits: the mask info is O((L / block)^2) per row in TPU scalar memory (int8 / int16), fine up
to ~128 blocks a side (64K at block 512); longer rows belong to context parallelism. Rows are
vmapped; Pallas runs a batch of per-row mask infos as a loop of per-row kernel calls.
"""

import jax
import jax.numpy as jnp
import numpy as np

from maxlm.model.attention import reference

_BIG = np.iinfo(np.int32).max


def _causal(q_ids, kv_ids):
  return q_ids >= kv_ids


def block_ranges(seg_BxL, block):
  """Per block: the lowest and highest non-zero segment id (BIG / -1 if all padding)."""
  s = seg_BxL.reshape(seg_BxL.shape[0], -1, block)
  lo = jnp.min(jnp.where(s > 0, s, _BIG), axis=-1)
  hi = jnp.max(jnp.where(s > 0, s, -1), axis=-1)
  return lo, hi


def visible_blocks(seg_BxL, bq, bk, window=0):
  """[B, nq, nk] bool: the (query block, key block) pairs that are visited."""
  qlo, qhi = block_ranges(seg_BxL, bq)
  klo, khi = block_ranges(seg_BxL, bk)
  nq, nk = qlo.shape[1], klo.shape[1]
  causal = (jnp.arange(nk) * bk)[None, :] <= ((jnp.arange(nq) + 1) * bq - 1)[:, None]
  if window:
    causal &= ((jnp.arange(nk) + 1) * bk - 1)[None, :] > (jnp.arange(nq) * bq - window)[:, None]
  overlap = (klo[:, None, :] <= qhi[:, :, None]) & (khi[:, None, :] >= qlo[:, :, None])
  return causal[None] & overlap


def _next_visited(vis_BxNxM):
  """Along the last axis: the next visited index at or after each entry, else the last visited
  one, else 0 (so a skipped step keeps the block already in VMEM: no copy)."""
  m = vis_BxNxM.shape[-1]
  idx = jnp.arange(m, dtype=jnp.int32)
  nxt = jax.lax.cummin(jnp.where(vis_BxNxM, idx, m), axis=vis_BxNxM.ndim - 1, reverse=True)
  last = jnp.max(jnp.where(vis_BxNxM, idx, -1), axis=-1, keepdims=True)
  return jnp.where(nxt < m, nxt, jnp.maximum(last, 0))


def _small(x, bound):
  return x.astype(jnp.int8 if bound <= 127 else jnp.int16 if bound <= 32767 else jnp.int32)


def mask_infos(seg_BxL, bq, bk, window=0):
  """(fwd/dq MaskInfo, dkv MaskInfo), each array [B, 1, nq, nk], from segment ids."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as mi
  vis = visible_blocks(seg_BxL, bq, bk, window)
  nq, nk = vis.shape[1:]
  block_mask = _small(vis.astype(jnp.int32), 2)[:, None]
  q_sequence = jnp.arange(seg_BxL.shape[1], dtype=jnp.int32)
  fwd = mi.MaskInfo(data_next=_small(_next_visited(vis), nk)[:, None], mask_next=None,
                    block_mask=block_mask, partial_mask_blocks=None, q_sequence=q_sequence,
                    is_dynamic_mask=None)
  dkv_next = _next_visited(vis.transpose(0, 2, 1)).transpose(0, 2, 1)
  dkv = fwd._replace(data_next=_small(dkv_next, nq)[:, None])
  return fwd, dkv


def block_count(seg_BxL, bq, bk, window=0):
  """Blocks each of the three kernels (forward, dQ, dKV) computes, summed over rows and heads
  once: the number of visited pairs."""
  return int(jnp.sum(visible_blocks(seg_BxL, bq, bk, window)))


def splash(q, k, v, segment_ids, *, block=512, interpret=False, mask_function=_causal,
           window=0):
  """q [B,L,H,D], k/v [B,L,K,D], segment_ids [B,L] -> [B,L,H,D]; GQA, any length; window W > 0:
  i also needs i - W < j."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  b, length, h, d = q.shape
  kh = k.shape[2]
  block = min(block, -(-length // 128) * 128)
  pad = -length % block
  if pad:
    q, k, v = (jnp.pad(x, [(0, 0), (0, pad), (0, 0), (0, 0)]) for x in (q, k, v))
    segment_ids = jnp.pad(segment_ids, [(0, 0), (0, pad)])
  sizes = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                        block_q_dq=block, block_kv_dq=block)
  fwd, dkv = mask_infos(segment_ids, block, block, window)
  if window:
    mask_function = reference.Windowed(mask_function, int(window))
  q = (q / np.sqrt(d).astype(q.dtype)).transpose(0, 2, 1, 3)
  k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

  def row(qr, kr, vr, sr, fwd_r, dkv_r):
    kernel = sk.SplashAttentionKernel(
        fwd_r, fwd_r, dkv_r, block_sizes=sizes, is_mqa=False, save_residuals=False,
        mask_value=sk.DEFAULT_MASK_VALUE, attn_logits_soft_cap=None,
        residual_checkpoint_name=None, mask_function=mask_function, interpret=interpret)
    return kernel(qr, kr, vr, segment_ids=sk.SegmentIds(q=sr, kv=sr))

  axes = fwd._replace(data_next=0, block_mask=0, q_sequence=None)
  out = jax.vmap(row, in_axes=(0, 0, 0, 0, axes, axes))(q, k, v, segment_ids, fwd, dkv)
  out = out.transpose(0, 2, 1, 3)
  # a query block with nothing visible is never visited: its (padding) rows come back 0/0
  return jnp.where((segment_ids > 0)[:, :, None, None], out, 0).astype(q.dtype)[:, :length]

"""Pallas-Triton (GPU) attention that visits only the key blocks a query block can see.

jax's `pallas.ops.gpu.attention.mha` masks segments inside its tiles but loops every query block
over all key blocks up to the causal diagonal, so a packed row of 32 documents costs a whole
causal row (measured 2x slower than our pure-JAX `blockwise` at 64K x 32 documents). Its loop
bounds are fixed by the grid, so it cannot be told otherwise: this module is our own kernel,
written after that one (same online softmax in base 2, same three-kernel backward structure),
with the loop bounds read per (row, block) from small int32 arrays computed from `segment_ids`
before the kernel:

  forward and dQ: query block i visits key blocks [first key block of its earliest document,
                  the causal diagonal];
  dK/dV:          key block j visits query blocks [the causal diagonal, the last query block
                  of its latest document].

With a window W the forward and dQ ranges start no earlier than the key block holding the query
block's first position - W + 1, and the dK/dV ranges stop after the query block holding the key
block's last position + W - 1; the tile mask adds i - W < j.
For packed rows (sorted segments, padding last) these ranges are exactly the blocks holding a
visible pair; for any other row they are a superset (the exact mask is applied in every tile).
GQA is native in the forward and dQ kernels (the K/V tile of head h // groups); dK/dV are
computed per query head and summed over each group outside the kernel. `mask_function(q_pos,
k_pos)` is the causal rule; tests pass a counting one to count the tiles the kernels compute.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from maxlm.model.attention import blockwise, reference

_MASKED = -0.7 * float(np.finfo(np.float32).max)
_LOG2E = math.log2(math.e)


def _causal(q_pos, k_pos):
  return q_pos >= k_pos


def q_ranges(seg_BxL, bq, bk, window=0):
  """[B, nq] start and stop key block for each query block (forward and dQ)."""
  start, stop, _ = blockwise._plan(seg_BxL, seg_BxL, 0, bq, bk, window)
  return start, stop


def k_ranges(seg_BxL, bq, bk, window=0):
  """[B, nk] start and stop query block for each key block (dK/dV)."""
  qlo, _ = blockwise._block_ranges(seg_BxL, bq)
  _, khi = blockwise._block_ranges(seg_BxL, bk)
  nq, nk = qlo.shape[1], khi.shape[1]
  suffix_min = lax.cummin(qlo, axis=1, reverse=True)  # non-decreasing along the row
  stop = jax.vmap(lambda s, x: jnp.searchsorted(s, x, side="right"))(suffix_min, khi)
  start = jnp.broadcast_to((jnp.arange(nk) * bk) // bq, stop.shape)
  if window:  # past the query block holding the key block's last position + W - 1
    stop = jnp.minimum(stop, ((jnp.arange(nk) + 1) * bk + window - 2) // bq + 1)
  stop = jnp.minimum(jnp.maximum(stop, start), nq)
  return start.astype(jnp.int32), stop.astype(jnp.int32)


def block_count(seg_BxL, bq, bk, window=0):
  """Tiles the forward kernel computes per head: sum over rows and query blocks of the range."""
  start, stop = q_ranges(seg_BxL, bq, bk, window)
  return int(jnp.sum(stop - start))


def _tile_scores(q, k, qs, ks, q_pos, k_pos, scale, mask_function):
  s = pl.dot(q, k, trans_b=True) * (scale * _LOG2E)
  mask = (qs[:, None] == ks[None, :]) & mask_function(q_pos[:, None], k_pos[None, :])
  return jnp.where(mask, s, _MASKED)


def _fwd_kernel(start_ref, stop_ref, q_ref, k_ref, v_ref, seg_ref, o_ref, lse_ref, m_ref, *,
                scale, bq, bk, mask_function):
  i = pl.program_id(0)
  q = q_ref[...]
  qs = seg_ref[pl.ds(i * bq, bq)]
  q_pos = i * bq + jnp.arange(bq)

  def body(j, carry):
    o, m, l = carry
    sl = pl.ds(j * bk, bk)
    s = _tile_scores(q, k_ref[sl, :], qs, seg_ref[sl], q_pos, j * bk + jnp.arange(bk), scale,
                     mask_function)
    m_new = jnp.maximum(m, s.max(axis=-1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    v = v_ref[sl, :]
    o = alpha[:, None] * o + pl.dot(p.astype(v.dtype), v)
    return o, m_new, alpha * l + p.sum(axis=-1)

  init = (jnp.zeros((bq, q.shape[-1]), jnp.float32), jnp.full((bq,), -jnp.inf, jnp.float32),
          jnp.zeros((bq,), jnp.float32))
  o, m, l = lax.fori_loop(start_ref[0], stop_ref[0], body, init)
  seen = l > 0
  o_ref[...] = (o / jnp.where(seen, l, 1.0)[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), jnp.inf)
  m_ref[...] = m  # each row's largest logit (base 2): the max logit comes free


def _dq_kernel(start_ref, stop_ref, q_ref, k_ref, v_ref, seg_ref, do_ref, lse_ref, delta_ref,
               dq_ref, *, scale, bq, bk, mask_function):
  i = pl.program_id(0)
  q, do = q_ref[...], do_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]
  qs = seg_ref[pl.ds(i * bq, bq)]
  q_pos = i * bq + jnp.arange(bq)

  def body(j, dq):
    sl = pl.ds(j * bk, bk)
    k, v = k_ref[sl, :], v_ref[sl, :]
    s = _tile_scores(q, k, qs, seg_ref[sl], q_pos, j * bk + jnp.arange(bk), scale,
                     mask_function)
    p = jnp.exp2(s - lse[:, None])
    dp = pl.dot(do, v, trans_b=True) - delta[:, None]
    return dq + pl.dot((p * dp * scale).astype(k.dtype), k)

  dq = lax.fori_loop(start_ref[0], stop_ref[0], body, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(start_ref, stop_ref, q_ref, k_ref, v_ref, seg_ref, do_ref, lse_ref, delta_ref,
                dk_ref, dv_ref, *, scale, bq, bk, mask_function):
  j = pl.program_id(0)
  k, v = k_ref[...], v_ref[...]
  ks = seg_ref[pl.ds(j * bk, bk)]
  k_pos = j * bk + jnp.arange(bk)

  def body(i, carry):
    dk, dv = carry
    sl = pl.ds(i * bq, bq)
    q, do = q_ref[sl, :], do_ref[sl, :]
    s = _tile_scores(q, k, seg_ref[sl], ks, i * bq + jnp.arange(bq), k_pos, scale,
                     mask_function)
    p = jnp.exp2(s - lse_ref[sl][:, None])
    dv = dv + pl.dot(p.astype(do.dtype), do, trans_a=True)
    dp = pl.dot(do, v, trans_b=True) - delta_ref[sl][:, None]
    dk = dk + pl.dot((p * dp * scale).astype(q.dtype), q, trans_a=True)
    return dk, dv

  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = lax.fori_loop(start_ref[0], stop_ref[0], body, (zeros, zeros))
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _call(kernel, grid, in_specs, out_specs, out_shape, interpret, num_warps, name, *args):
  kw = {}
  if not interpret:
    from jax.experimental.pallas import triton as plgpu
    kw["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps, num_stages=2)
  return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
                        out_shape=out_shape, interpret=interpret, name=name, **kw)(*args)


def _specs(b, length, bq, bk, d, groups):
  """BlockSpecs over the grid (block index, batch row, query head)."""
  whole_q = pl.BlockSpec((None, length, None, d), lambda n, r, h: (r, 0, h, 0))
  whole_kv = pl.BlockSpec((None, length, None, d), lambda n, r, h: (r, 0, h // groups, 0))
  return {
      "range": pl.BlockSpec((None, 1), lambda n, r, h: (r, n)),
      "q_tile": pl.BlockSpec((None, bq, None, d), lambda n, r, h: (r, n, h, 0)),
      "kv_tile": pl.BlockSpec((None, bk, None, d), lambda n, r, h: (r, n, h // groups, 0)),
      "dkv_tile": pl.BlockSpec((None, bk, None, d), lambda n, r, h: (r, n, h, 0)),
      "whole_q": whole_q, "whole_kv": whole_kv,
      "seg": pl.BlockSpec((None, length), lambda n, r, h: (r, 0)),
      "row_q": pl.BlockSpec((None, None, bq), lambda n, r, h: (r, h, n)),
      "row_whole": pl.BlockSpec((None, None, length), lambda n, r, h: (r, h, 0)),
  }


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9))
def _attention(q, k, v, seg, scale, blocks, interpret, num_warps, mask_function, window):
  return _forward(q, k, v, seg, scale, blocks, interpret, num_warps, mask_function, window)[0]


def _forward(q, k, v, seg, scale, blocks, interpret, num_warps, mask_function, window):
  bq = bk = blocks[0]
  b, length, h, d = q.shape
  sp = _specs(b, length, bq, bk, d, h // k.shape[2])
  start, stop = q_ranges(seg, bq, bk, window)
  kernel = functools.partial(_fwd_kernel, scale=scale, bq=bq, bk=bk, mask_function=mask_function)
  rows = jax.ShapeDtypeStruct((b, h, length), jnp.float32)
  out, lse, m = _call(kernel, (length // bq, b, h),
                      [sp["range"], sp["range"], sp["q_tile"], sp["whole_kv"], sp["whole_kv"],
                       sp["seg"]],
                      [sp["q_tile"], sp["row_q"], sp["row_q"]],
                      [jax.ShapeDtypeStruct(q.shape, q.dtype), rows, rows],
                      interpret, num_warps, "segments_fwd", start, stop, q, k, v, seg)
  return (out, m), (q, k, v, seg, out, lse)


def _bwd(scale, blocks, interpret, num_warps, mask_function, window, res, cotangents):
  bq = bk = blocks[1]
  q, k, v, seg, out, lse = res
  d_out, _ = cotangents  # the row maxima are reported, not differentiated
  b, length, h, d = q.shape
  kh = k.shape[2]
  groups = h // kh
  sp = _specs(b, length, bq, bk, d, groups)
  delta = jnp.einsum("blhd,blhd->bhl", out.astype(jnp.float32), d_out.astype(jnp.float32))
  common = dict(scale=scale, bq=bq, bk=bk, mask_function=mask_function)
  qs, qe = q_ranges(seg, bq, bk, window)
  dq = _call(functools.partial(_dq_kernel, **common), (length // bq, b, h),
             [sp["range"], sp["range"], sp["q_tile"], sp["whole_kv"], sp["whole_kv"], sp["seg"],
              sp["q_tile"], sp["row_q"], sp["row_q"]],
             sp["q_tile"], jax.ShapeDtypeStruct(q.shape, q.dtype), interpret, num_warps,
             "segments_dq", qs, qe, q, k, v, seg, d_out, lse, delta)
  ks, ke = k_ranges(seg, bq, bk, window)
  kv_shape = jax.ShapeDtypeStruct((b, length, h, d), jnp.float32)
  dk, dv = _call(functools.partial(_dkv_kernel, **common), (length // bk, b, h),
                 [sp["range"], sp["range"], sp["whole_q"], sp["kv_tile"], sp["kv_tile"],
                  sp["seg"], sp["whole_q"], sp["row_whole"], sp["row_whole"]],
                 [sp["dkv_tile"], sp["dkv_tile"]], [kv_shape, kv_shape], interpret, num_warps,
                 "segments_dkv", ks, ke, q, k, v, seg, d_out, lse, delta)
  dk = dk.reshape(b, length, kh, groups, d).sum(3).astype(k.dtype)
  dv = dv.reshape(b, length, kh, groups, d).sum(3).astype(v.dtype)
  return dq, dk, dv, None


_attention.defvjp(lambda *a: _forward(*a), _bwd)


def gpu(q, k, v, segment_ids, *, block=64, block_bwd=64, interpret=False, num_warps=None,
        mask_function=_causal, window=0):
  """q [B,L,H,D], k/v [B,L,K,D], segment_ids [B,L] -> ([B,L,H,D], the largest visible logit);
  GQA, any length and head dim. Tiles: `block` (forward), min(block, block_bwd) (backward:
  three accumulators per tile, as jax's kernel uses smaller backward tiles). Window W > 0: i
  also needs i - W < j."""
  b, length, h, d = q.shape
  block = min(1 << (max(block, 16).bit_length() - 1), max(16, pl.next_power_of_2(length)))
  blocks = (block, min(block, block_bwd))  # Triton tiles are powers of two
  dp = max(16, pl.next_power_of_2(d))
  num_warps = num_warps or (4 if dp <= 64 else 8)
  pad_l = -length % block
  if pad_l or dp != d:
    q, k, v = (jnp.pad(x, [(0, 0), (0, pad_l), (0, 0), (0, dp - d)]) for x in (q, k, v))
  seg = jnp.pad(segment_ids, [(0, 0), (0, pad_l)]).astype(jnp.int32)
  window = int(window)
  if window:
    mask_function = reference.Windowed(mask_function, window)
  out, m_BxHxL = _attention(q, k, v, seg, 1.0 / math.sqrt(d), blocks, interpret, num_warps,
                            mask_function, window)
  real = seg > 0
  peak = jnp.max(jnp.where(real[:, None, :], m_BxHxL, -jnp.inf)) / _LOG2E
  out = jnp.where(real[:, :, None, None], out, 0).astype(q.dtype)[:, :length, :, :d]
  return out, jax.lax.stop_gradient(peak)

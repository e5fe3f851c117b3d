"""Block-sparse DeepSeek attention (`sparse.select: block`, the default): top-k KV blocks per
query block, with our own backward pass, and the recall of the selection.

Each block of c queries attends to the kb = topk // c key blocks of highest indexer score (the
largest I(t, s) over its queries and the block's visible keys; the diagonal block always among
them), masked causally and by segment inside; a query block with at most kb visible blocks sees
them all, which is dense attention exactly. One gather per query block, dense matmuls inside.

Why a custom VJP. Differentiating a `lax.map` over query chunks keeps each chunk's inputs and
cotangents as stacked [n, B, c, ...] copies of q-sized arrays, and XLA (on CPU at least) widens
bf16 loop-carried ones to f32: at L = 131072 the sparse layer's forward + backward held 5 GiB.
Here the forward loop writes each chunk's output into place and keeps only the selected block
indices ([n, B, kb] int32); the backward loop recomputes one chunk at a time (`jax.vjp` of the
chunk's own function), writes dq / dqI / dw into place and scatter-adds the gathered blocks'
cotangents into f32 accumulators for dk, dv and dkI. Memory: the inputs, their gradients, two
f32 [L, K, D] accumulators and one chunk's working set; never [L, L].

Recall (`recall`): the share of the dense attention mass (mean over heads) the selected keys
carry, measured on `recall_blocks` query blocks per call spread evenly over the row; the dense
log-sum-exp is accumulated over key tiles up to the diagonal, forward only. With 4 blocks of 64
and k = 2048 that is 256 queries over half the row on average: 1/16 of the sparse forward's
score work, at any L.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from maxlm.model.attention import sparse as base

_TILE_KEYS = 4096  # keys per step of the indexer's selection loop
_BIG = np.iinfo(np.int32).max


def sparse_blocks(q, k, v, iq, iw, ik, q_seg, kv_seg, q_offset=0, *, topk, block=64,
                  recall_blocks=0):
  """(out [B,Lq,H,D], max selected logit, stats). q [B,Lq,H,D], k/v [B,Lk,K,D], iq [B,Lq,J,E],
  iw [B,Lq,J], ik [B,Lk,E], segments [B,L]; q_offset: the global position of query 0.

  Gradients: the output's reach q, k, v only; the KL's (on the selected keys) reach iq, iw,
  ik only."""
  lq = q.shape[1]
  (q, iq, iw), q_seg_p = base._pad_queries([q, iq, iw], q_seg, block)
  (k, v, ik), kv_seg_p = base._pad_queries([k, v, ik], kv_seg, block)
  offset = jnp.asarray(q_offset, jnp.int32)
  out, peak, kl, selected = _attention(q, k, v, iq, iw, ik, q_seg_p, kv_seg_p, offset, topk,
                                       block)
  stats = base._stats(kl[:, :lq], selected[:, :lq], q_seg)
  if recall_blocks:
    stats.update(_recall(*(jax.lax.stop_gradient(x) for x in (q, k, iq, iw, ik)), q_seg_p,
                         kv_seg_p, q_offset, topk, block, recall_blocks))
  return out[:, :lq], peak, stats


def _select(iq_c, iw_c, ik, qs_c, kv_seg, q_pos, diagonal, c, kb):
  """Block indices [B, kb] and which are live [B, kb] for one query block.

  The indexer scores only the key tiles from the first one that can hold the query block's
  lowest segment up to the diagonal (as blockwise attention skips them): a row packed with
  documents of n tokens costs O(L * n), not O(L^2), which is what lets L = 2^20 run on a CPU
  (configs/tiny_1m.yaml). Keys outside that range are invisible, so the choice is the same."""
  b, nk = ik.shape[0], ik.shape[1] // c
  tile = math.gcd(nk, max(1, _TILE_KEYS // c))  # key blocks scored per loop step
  lowest = jnp.min(jnp.where(qs_c > 0, qs_c, _BIG))
  reach = jnp.max(jnp.where(kv_seg > 0, kv_seg, -1).reshape(b, nk, c), axis=(0, 2))
  reached = reach >= lowest
  first = jnp.where(jnp.any(reached), jnp.argmax(reached), nk)  # none: all padding, no keys
  last = jnp.minimum(diagonal // tile + 1, nk // tile)

  def score_tile(t, per_block):
    ik_t, seg_t = _chunk(ik, t, tile * c), _chunk(kv_seg, t, tile * c)
    vis = base._visible(qs_c, seg_t, q_pos - t * tile * c)
    scores = base.indexer_scores(iq_c, iw_c, ik_t)
    tile_max = jnp.max(jnp.where(vis, scores, -jnp.inf).reshape(b, c, tile, c), axis=(1, 3))
    return jax.lax.dynamic_update_slice_in_dim(per_block, tile_max, t * tile, 1)

  per_block = jax.lax.fori_loop(first // tile, last, score_tile,
                                jnp.full((b, nk), -jnp.inf, jnp.float32))
  is_diagonal = jnp.arange(nk) == diagonal
  per_block = jnp.where(is_diagonal & jnp.isfinite(per_block), jnp.inf, per_block)
  vals, idx = jax.lax.top_k(per_block, kb)
  return idx, vals > -jnp.inf


def _gather(x_blocks, idx):
  """x_blocks [B, nk, c, ...] by block indices [B, kb] -> [B, kb*c, ...]."""
  return jax.vmap(lambda xb, ib: xb[ib].reshape(-1, *xb.shape[2:]))(x_blocks, idx)


def _blocks_of(x, c):
  return x.reshape(x.shape[0], x.shape[1] // c, c, *x.shape[2:])


def _chunk(x, i, c):
  """Positions [i*c, (i+1)*c) of x along axis 1."""
  return jax.lax.dynamic_slice_in_dim(x, i * c, c, axis=1)


def _put(buf, x, i, c):
  """buf with positions [i*c, (i+1)*c) along axis 1 replaced by x."""
  return jax.lax.dynamic_update_slice_in_dim(buf, x.astype(buf.dtype), i * c, 1)


def _mask(qs_c, kv_seg, q_pos, idx, chosen, c):
  """[B, c, kb*c]: causal, same segment, live block."""
  b, kb = idx.shape
  k_pos = (idx[:, :, None] * c + jnp.arange(c)).reshape(b, kb * c)
  seg_sel = _gather(_blocks_of(kv_seg, c), idx)
  live = jnp.repeat(chosen, c, axis=1)[:, None, :]
  return ((q_pos[None, :, None] >= k_pos[:, None, :]) & (qs_c[:, :, None] == seg_sel[:, None])
          & (qs_c > 0)[:, :, None] & live)


def _attend(q_c, iq_c, iw_c, k_sel, v_sel, ik_sel, mask):
  """One query block over its selected keys: (out [B,c,H,D] f32, peak, kl [B,c])."""
  b, c, h, d = q_c.shape
  kh = k_sel.shape[2]
  q5 = q_c.reshape(b, c, kh, h // kh, d)
  logits = jnp.einsum("bckgd,bskd->bkgcs", q5, k_sel, preferred_element_type=jnp.float32)
  logits = logits * (1.0 / np.sqrt(d).astype(np.float32))
  m5 = mask[:, None, None]
  probs = jnp.exp(base._log_softmax(logits, m5)) * m5
  out = jnp.einsum("bkgcs,bskd->bckgd", probs.astype(v_sel.dtype), v_sel,
                   preferred_element_type=jnp.float32).reshape(b, c, h, d)
  peak = jnp.max(jnp.where(m5, jax.lax.stop_gradient(logits), -jnp.inf))
  p = jax.lax.stop_gradient(jnp.mean(probs, axis=(1, 2)))  # [B, c, kb*c]
  sel_scores = base.indexer_scores(iq_c, iw_c, ik_sel)
  return out, peak, base._kl(p, base._log_softmax(sel_scores, mask), mask)


def _chunk_inputs(i, c, kb, q, iq, iw, q_seg, ik, kv_seg, offset, gathered, idx=None,
                  chosen=None):
  """Query block i's (q, iq, iw, the selected blocks of each array in `gathered`, mask), its
  block indices and which are live; selected here unless idx/chosen are given."""
  q_c, iq_c, iw_c, qs_c = (_chunk(x, i, c) for x in (q, iq, iw, q_seg))
  q_pos = offset + i * c + jnp.arange(c)
  if idx is None:
    idx, chosen = _select(iq_c, iw_c, ik, qs_c, kv_seg, q_pos, offset // c + i, c, kb)
  mask = _mask(qs_c, kv_seg, q_pos, idx, chosen, c)
  sel = [_gather(_blocks_of(x, c), idx) for x in gathered]
  return (q_c, iq_c, iw_c, *sel, mask), idx, chosen


def _sizes(q, k, topk, c):
  n, nk = q.shape[1] // c, k.shape[1] // c
  return n, max(1, min(topk // c, nk))


def _forward(q, k, v, iq, iw, ik, q_seg, kv_seg, offset, topk, c):
  b, lq = q_seg.shape
  n, kb = _sizes(q, k, topk, c)

  def step(i, carry):
    out, peak, kl, selected, idx_all, chosen_all = carry
    args, idx, chosen = _chunk_inputs(i, c, kb, q, iq, iw, q_seg, ik, kv_seg, offset,
                                      (k, v, ik))
    o, pk, kl_c = _attend(*args)
    return (_put(out, o, i, c), jnp.maximum(peak, pk), _put(kl, kl_c, i, c),
            _put(selected, args[-1].sum(-1).astype(jnp.float32), i, c),
            idx_all.at[i].set(idx), chosen_all.at[i].set(chosen))

  init = (jnp.zeros(q.shape, q.dtype), jnp.float32(-jnp.inf), jnp.zeros((b, lq), jnp.float32),
          jnp.zeros((b, lq), jnp.float32), jnp.zeros((n, b, kb), jnp.int32),
          jnp.zeros((n, b, kb), bool))
  return jax.lax.fori_loop(0, n, step, init)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10))
def _attention(q, k, v, iq, iw, ik, q_seg, kv_seg, offset, topk, c):
  return _forward(q, k, v, iq, iw, ik, q_seg, kv_seg, offset, topk, c)[:4]


def _attention_fwd(q, k, v, iq, iw, ik, q_seg, kv_seg, offset, topk, c):
  out, peak, kl, selected, idx_all, chosen_all = _forward(q, k, v, iq, iw, ik, q_seg, kv_seg,
                                                          offset, topk, c)
  return (out, peak, kl, selected), (q, k, v, iq, iw, ik, q_seg, kv_seg, offset, idx_all,
                                     chosen_all)


def _attention_bwd(topk, c, residuals, cotangents):
  q, k, v, iq, iw, ik, q_seg, kv_seg, offset, idx_all, chosen_all = residuals
  ct_out, _, ct_kl, _ = cotangents
  n, kb = _sizes(q, k, topk, c)
  f32 = lambda x: jnp.zeros(_blocks_of(x, c).shape, jnp.float32)  # noqa: E731
  add = jax.vmap(lambda acc, i, g: acc.at[i].add(g.reshape(i.shape[0], c, *g.shape[1:])))

  def step(i, carry):
    dq, diq, diw, dk, dv, dik = carry
    args, idx, _ = _chunk_inputs(i, c, kb, q, iq, iw, q_seg, ik, kv_seg, offset, (k, v, ik),
                                 idx_all[i], chosen_all[i])
    mask = args[-1]

    def out_and_kl(*xs):  # the differentiable outputs of _attend
      o, _, kl = _attend(*xs, mask)
      return o.astype(q.dtype), kl

    _, vjp = jax.vjp(out_and_kl, *args[:-1])
    g_q, g_iq, g_iw, g_k, g_v, g_ik = vjp((_chunk(ct_out, i, c), _chunk(ct_kl, i, c)))
    return (_put(dq, g_q, i, c), _put(diq, g_iq, i, c), _put(diw, g_iw, i, c),
            add(dk, idx, g_k), add(dv, idx, g_v), add(dik, idx, g_ik))

  init = (jnp.zeros_like(q), jnp.zeros_like(iq), jnp.zeros_like(iw), f32(k), f32(v), f32(ik))
  dq, diq, diw, dk, dv, dik = jax.lax.fori_loop(0, n, step, init)
  back = lambda acc, x: acc.reshape(x.shape).astype(x.dtype)  # noqa: E731
  return dq, back(dk, k), back(dv, v), diq, diw, back(dik, ik), None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _recall(q, k, iq, iw, ik, q_seg, kv_seg, offset, topk, c, blocks):
  """{recall, recall_queries}: the dense attention mass on the selected keys, summed over the
  valid queries of `blocks` query blocks spread evenly over the whole row (the keys' length),
  each measured by the call whose queries hold it: the same blocks under context parallelism.

  A Python offset picks this call's blocks while tracing; a traced one (inside context
  parallelism's shard_map, one program per device) branches with lax.cond. Not under plain jit:
  a branch that GSPMD fills with collectives can deadlock devices on the CPU. The blocks run
  one after another (a scan): unrolled, XLA ran them together (+0.41 GiB at L = 131072 with 4
  blocks, +0.03 with 1)."""
  n, kb = _sizes(q, k, topk, c)
  nk = k.shape[1] // c
  picks = sorted({min(nk - 1, (2 * j + 1) * nk // (2 * blocks)) for j in range(blocks)})
  static = isinstance(offset, int)
  if static:  # only the blocks this call's queries hold
    picks = [g for g in picks if offset // c <= g < offset // c + n]
  measure = lambda i: _block_recall(i, q, k, iq, iw, ik, q_seg, kv_seg, offset, c, kb)  # noqa

  def one(sums, g):
    i = g - offset // c  # the query block of this call, if it holds global block g
    if static:
      mass, valid = measure(i)
    else:
      mass, valid = jax.lax.cond((i >= 0) & (i < n), lambda i: measure(jnp.clip(i, 0, n - 1)),
                                 lambda i: (jnp.float32(0.0), jnp.float32(0.0)), i)
    return (sums[0] + mass, sums[1] + valid), None

  (total, queries), _ = jax.lax.scan(one, (jnp.float32(0.0), jnp.float32(0.0)),
                                     jnp.asarray(picks, jnp.int32))
  return {"recall": total, "recall_queries": queries}


def _block_recall(i, q, k, iq, iw, ik, q_seg, kv_seg, offset, c, kb):
  """(mass summed over the valid queries of query block i, their count)."""
  b, _, h, d = q.shape
  kh = k.shape[2]
  nk = k.shape[1] // c
  tile = c * math.gcd(nk, max(1, 8192 // c))  # keys per step of the dense log-sum-exp
  scale = 1.0 / np.sqrt(d).astype(np.float32)
  (q_c, _, _, k_sel, mask), _, _ = _chunk_inputs(i, c, kb, q, iq, iw, q_seg, ik, kv_seg,
                                                  offset, (k,))
  qs_c = _chunk(q_seg, i, c)
  q_pos = offset + i * c + jnp.arange(c)
  q5 = q_c.reshape(b, c, kh, h // kh, d)

  def tile_step(t, carry):
    m, s = carry
    k_t, seg_t = _chunk(k, t, tile), _chunk(kv_seg, t, tile)
    pos_t = t * tile + jnp.arange(tile)
    vis = ((q_pos[:, None] >= pos_t[None])[None] & (qs_c[:, :, None] == seg_t[:, None])
           & (qs_c > 0)[:, :, None])[:, None, None]
    x = jnp.einsum("bckgd,blkd->bkgcl", q5, k_t, preferred_element_type=jnp.float32) * scale
    x = jnp.where(vis, x, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(x, axis=-1))
    safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    s = s * jnp.exp(jnp.where(jnp.isfinite(m), m - safe, -jnp.inf)) + jnp.sum(
        jnp.exp(x - safe[..., None]), axis=-1)
    return m_new, s

  last = (offset + (i + 1) * c + tile - 1) // tile  # key tiles up to the diagonal
  init = (jnp.full((b, kh, h // kh, c), -jnp.inf), jnp.zeros((b, kh, h // kh, c)))
  upper = (min if isinstance(last, int) else jnp.minimum)(last, k.shape[1] // tile)
  m, s = jax.lax.fori_loop(0, upper, tile_step, init)
  lse = jnp.where(s > 0, jnp.log(jnp.where(s > 0, s, 1.0)) + jnp.where(
      jnp.isfinite(m), m, 0.0), 0.0)
  x = jnp.einsum("bckgd,bskd->bkgcs", q5, k_sel, preferred_element_type=jnp.float32) * scale
  mass = jnp.sum(jnp.where(mask[:, None, None], jnp.exp(x - lse[..., None]), 0.0), axis=-1)
  valid = (qs_c > 0).astype(jnp.float32)
  return jnp.sum(jnp.mean(mass, axis=(1, 2)) * valid), jnp.sum(valid)

"""DeepSeek sparse attention: the lightning indexer's scores, top-k selection, the KL target.

The indexer scores query t against key s as I(t,s) = sum_j w(t,j) * ReLU(qI(t,j) . kI(s)),
only where s <= t and both are in the same non-zero segment. In `sparse` mode each query
attends to its top-k keys by I (a query with fewer than k visible keys sees all of them, which
is dense attention exactly); in `indexer_warmup` mode the caller runs dense attention and this
module only computes the indexer's KL loss against the dense distribution.

Two selections, both chunked over queries so memory is O(L * k) plus one chunk's working set
and [L, L] is never built; the full indexer scoring runs under stop_gradient (selection is
discrete, and the indexer gets no gradient from the language-model loss), its KL loss flows
through the selected keys only:
  - `sparse` (select: token): each query's own top-k keys, gathered per query ([C, k, K, D]
    per chunk of C queries), a `lax.map` whose chunks are rematerialised in the backward pass
    keeping only the selected indices. The method's definition; slow on CPU (one gather per
    query).
  - block selection (`select: block`, the default) lives in `sparse_blocks.py`: top-k KV
    blocks per query block, with its own backward pass; chosen by measurement
    (tools/bench_sparse.py, docs/schedule.md).
We wrote it in pure JAX (no kernel library offers DSA on CPU, TPU and GPU alike).

KL target p(t, .): the main attention probabilities summed over heads and renormalised (the
mean over heads, since each head sums to 1), under stop_gradient; KL(p || softmax(I(t, .))).
Stats per call (sums over valid queries): kl, selected (keys per query), queries, and recall
(dense attention mass on the top-k keys by I) over recall_queries: every query in warm-up,
sampled query blocks in sparse mode (`sparse_blocks.py`).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

_BUDGET = 2**25  # floats in one chunk's largest intermediate ([B, C, heads, L] or [B, C, k, K, D])


def indexer_scores(iq_BxCxJxE, iw_BxCxJ, ik_BxLxE):
  dots = jnp.einsum("bcje,ble->bcjl", iq_BxCxJxE, ik_BxLxE, preferred_element_type=jnp.float32)
  return jnp.einsum("bcj,bcjl->bcl", iw_BxCxJ.astype(jnp.float32), jax.nn.relu(dots))


def chunk_size(length, width, batch, chunk=0):
  """Queries per chunk: `chunk` if set, else the largest power of two keeping one chunk's
  [B, C, width] intermediate within _BUDGET floats (at least 8, at most 512)."""
  if chunk:
    return min(chunk, length)
  c = 512
  while c > 8 and batch * c * width > _BUDGET:
    c //= 2
  return min(c, length)


def _visible(q_seg_BxC, kv_seg_BxL, q_pos_C):
  causal = q_pos_C[:, None] >= jnp.arange(kv_seg_BxL.shape[1])[None, :]
  same = q_seg_BxC[:, :, None] == kv_seg_BxL[:, None, :]
  return causal[None] & same & (q_seg_BxC > 0)[:, :, None]


def _log_softmax(x, mask):
  m = jnp.max(jnp.where(mask, x, -jnp.inf), axis=-1, keepdims=True)
  m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))  # log-softmax is shift-free
  xs = jnp.where(mask, x - m, 0.0)
  z = jnp.sum(jnp.where(mask, jnp.exp(xs), 0.0), axis=-1, keepdims=True)
  return jnp.where(mask, xs - jnp.log(jnp.where(z > 0, z, 1.0)), 0.0)


def _kl(p, log_q, mask):
  log_p = jnp.log(jnp.where(p > 0, p, 1.0))
  return jnp.sum(jnp.where(mask & (p > 0), p * (log_p - log_q), 0.0), axis=-1)


def _chunks(x, n, c):
  """[B, n*c, ...] -> [n, B, c, ...]."""
  return jnp.moveaxis(x.reshape(x.shape[0], n, c, *x.shape[2:]), 1, 0)


def _pad_queries(xs, q_seg, c):
  extra = -q_seg.shape[1] % c
  if not extra:
    return xs, q_seg
  pad = lambda x: jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2))
  return [pad(x) for x in xs], pad(q_seg)


def _stats(kl, selected, q_seg, recall=None):
  valid = (q_seg > 0).astype(jnp.float32)
  out = {"kl": jnp.sum(kl * valid), "selected": jnp.sum(selected * valid),
         "queries": jnp.sum(valid)}
  if recall is not None:
    out["recall"], out["recall_queries"] = jnp.sum(recall * valid), out["queries"]
  return out


def warmup(q, k, iq, iw, ik, q_seg, kv_seg, q_offset=0, *, topk, chunk=0):
  """The indexer's KL against dense attention (gradients reach iq, iw, ik only) and stats.

  q [B,Lq,H,D], k [B,Lk,K,D], iq [B,Lq,J,E], iw [B,Lq,J], ik [B,Lk,E], segments [B,L]."""
  b, lq, h, d = q.shape
  kh = k.shape[2]
  q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
  c = chunk_size(lq, h * k.shape[1], b, chunk)
  (q, iq, iw), q_seg_p = _pad_queries([q, iq, iw], q_seg, c)
  n = q.shape[1] // c
  kk = min(topk, k.shape[1])

  @jax.checkpoint
  def body(args):
    i, q_c, iq_c, iw_c, qs_c = args
    vis = _visible(qs_c, kv_seg, q_offset + i * c + jnp.arange(c))
    q5 = q_c.reshape(b, c, kh, h // kh, d)
    logits = jnp.einsum("bckgd,blkd->bkgcl", q5, k,
                        preferred_element_type=jnp.float32) / np.sqrt(d).astype(np.float32)
    probs = jnp.exp(_log_softmax(logits, vis[:, None, None])) * vis[:, None, None]
    p = jnp.mean(probs, axis=(1, 2))  # [B, C, L]
    scores = indexer_scores(iq_c, iw_c, ik)
    kl = _kl(p, _log_softmax(scores, vis), vis)
    vals, idx = jax.lax.top_k(jnp.where(vis, jax.lax.stop_gradient(scores), -jnp.inf), kk)
    chosen = jnp.isfinite(vals)
    recall = jnp.sum(jnp.where(chosen, jnp.take_along_axis(p, idx, axis=-1), 0.0), -1)
    return kl, chosen.sum(-1).astype(jnp.float32), recall

  kl, selected, recall = jax.lax.map(
      body, (jnp.arange(n), _chunks(q, n, c), _chunks(iq, n, c), _chunks(iw, n, c),
             _chunks(q_seg_p, n, c)))
  unchunk = lambda x: jnp.moveaxis(x, 0, 1).reshape(b, n * c)[:, :lq]
  return _stats(unchunk(kl), unchunk(selected), q_seg, unchunk(recall))


def sparse(q, k, v, iq, iw, ik, q_seg, kv_seg, q_offset=0, *, topk, chunk=0):
  """(out [B,Lq,H,D], max selected logit, stats): each query attends to its top-k keys by I.

  Gradients: the output's reach q, k, v only; the KL's (on the selected keys) reach iq, iw,
  ik only."""
  b, lq, h, d = q.shape
  kh = k.shape[2]
  kk = min(topk, k.shape[1])
  width = max(iq.shape[2] * k.shape[1], kk * kh * d)
  c = chunk_size(lq, width, b, chunk)
  (q, iq, iw), q_seg_p = _pad_queries([q, iq, iw], q_seg, c)
  n = q.shape[1] // c
  scale = 1.0 / np.sqrt(d).astype(np.float32)
  gather = jax.vmap(lambda x, i: x[i])  # [L, ...] rows picked per batch row by [C, k] indices

  @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.save_only_these_names(
      "sparse_idx", "sparse_chosen"))
  def body(args):
    i, q_c, iq_c, iw_c, qs_c = args
    vis = _visible(qs_c, kv_seg, q_offset + i * c + jnp.arange(c))
    scores = jax.lax.stop_gradient(indexer_scores(iq_c, iw_c, ik))
    vals, idx = jax.lax.top_k(jnp.where(vis, scores, -jnp.inf), kk)
    idx = checkpoint_name(idx, "sparse_idx")
    chosen = checkpoint_name(jnp.isfinite(vals), "sparse_chosen")
    k_sel, v_sel = gather(k, idx), gather(v, idx)  # [B, C, k, K, D]
    q5 = q_c.reshape(b, c, kh, h // kh, d)
    logits = jnp.einsum("bckgd,bcskd->bckgs", q5, k_sel, preferred_element_type=jnp.float32)
    logits = logits * scale
    mask = chosen[:, :, None, None]
    probs = jnp.exp(_log_softmax(logits, mask)) * mask
    out = jnp.einsum("bckgs,bcskd->bckgd", probs.astype(v.dtype), v_sel,
                     preferred_element_type=jnp.float32).reshape(b, c, h, d)
    peak = jnp.max(jnp.where(mask, jax.lax.stop_gradient(logits), -jnp.inf))
    p = jax.lax.stop_gradient(jnp.mean(probs, axis=(2, 3)))  # [B, C, k]
    dots = jnp.einsum("bcje,bcse->bcjs", iq_c, gather(ik, idx),
                      preferred_element_type=jnp.float32)
    sel_scores = jnp.einsum("bcj,bcjs->bcs", iw_c.astype(jnp.float32), jax.nn.relu(dots))
    kl = _kl(p, _log_softmax(sel_scores, chosen), chosen)
    return out.astype(q.dtype), peak, kl, chosen.sum(-1).astype(jnp.float32)

  return _map_chunks(body, q, iq, iw, q_seg_p, q_seg, n, c, lq)


def _map_chunks(body, q, iq, iw, q_seg_p, q_seg, n, c, lq):
  """Runs body over the n query chunks of c positions; (out, peak, stats) unpadded to lq."""
  b, _, h, d = q.shape
  out, peak, kl, selected = jax.lax.map(
      body, (jnp.arange(n), _chunks(q, n, c), _chunks(iq, n, c), _chunks(iw, n, c),
             _chunks(q_seg_p, n, c)))
  out = jnp.moveaxis(out, 0, 1).reshape(b, n * c, h, d)[:, :lq]
  unchunk = lambda x: jnp.moveaxis(x, 0, 1).reshape(b, n * c)[:, :lq]  # noqa: E731
  return out, jnp.max(peak), _stats(unchunk(kl), unchunk(selected), q_seg)

"""DeepSeek-V4's attention (compressed.attend's rule) computed by query blocks, so that a query
costs its window and its entries rather than the whole row.

For a block of b queries starting at row offset s:
  window   the keys at offsets s - W + 1 .. s + b - 1 only (b + W - 1 of them), masked to each
           query's own document, causally and to its last W positions;
  entries  HCA: every entry, masked to the closed ones of the query's document (E = L / m' is
           small: 512 at 64K with m' = 128); CSA: the lightning indexer's scores of every entry
           for the block's queries (the indexer's own O(L E) cost, as in V4), the top k of the
           visible ones gathered, so the attention itself sees k entries, not E;
  softmax  jointly over both and the head's sink, in float32, as the dense reference does.
With an indexer, each block also returns the indexer's KL sums (compressed.indexer_kl) over the
entries its queries attend. Blocks run one after another under `lax.map`, each recomputed in the
backward pass (jax.checkpoint), so memory holds one block's scores and gathered entries
(B x b x k x K: 1 GiB in bfloat16 for 512 queries of 4 rows at V4-Flash's k = K = 512) and
keeps only each block's output. The result
equals compressed.attend over compressed.select's mask (tests/test_model_compressed_blocks.py):
the same visible set, the same top k (jax.lax.top_k over the same scores), the same softmax.

Written here because V4's attention (a shared K = V head with entries, a window and sinks)
is in no JAX library; the dense reference stays for the tests and short rows.
"""

import jax
import jax.numpy as jnp

from maxlm.model import compressed


def attend(q_BxLxHxK, kv_BxLxK, entries_BxExK, end_BxE, valid_BxE, segment_ids_BxL, window,
           sink_H, block, index=None):
  """(out_BxLxHxK, the indexer's KL sums or None). `end_BxE`, `valid_BxE`: where each entry's
  window closed (compressed.window_ends); `index`: None (every visible entry, no indexer) or
  (q_BxLxJxC, w_BxLxJ, keys_BxExC, top_k) for CSA's indexer (top_k 0: every visible entry,
  the indexer learning beside them)."""
  b, length, heads, k = q_BxLxHxK.shape
  block = min(block, length)
  pad = -length % block
  if pad:
    q_BxLxHxK, kv_BxLxK, segment_ids_BxL = (
        jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        for x in (q_BxLxHxK, kv_BxLxK, segment_ids_BxL))
    if index is not None:
      index = (*(jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) for x in index[:2]),
               *index[2:])
  owner_BxE = jnp.take_along_axis(segment_ids_BxL, jnp.clip(end_BxE, 0, length - 1), axis=1)
  halo = window - 1
  kv_padded = jnp.pad(kv_BxLxK, [(0, 0), (halo, 0), (0, 0)])
  seg_padded = jnp.pad(segment_ids_BxL, [(0, 0), (halo, 0)])

  def one(start):
    rows = start + jnp.arange(block)
    q = jax.lax.dynamic_slice_in_dim(q_BxLxHxK, start, block, axis=1).astype(jnp.float32)
    seg_q = jax.lax.dynamic_slice_in_dim(segment_ids_BxL, start, block, axis=1)
    keys = jax.lax.dynamic_slice_in_dim(kv_padded, start, block + halo, axis=1)
    seg_k = jax.lax.dynamic_slice_in_dim(seg_padded, start, block + halo, axis=1)
    cols = start - halo + jnp.arange(block + halo)
    near = (cols[None] <= rows[:, None]) & (cols[None] > rows[:, None] - window)
    token_mask = near[None] & (seg_k[:, None, :] == seg_q[:, :, None]) & (seg_q[:, :, None] > 0)
    seen = (valid_BxE[:, None] & (owner_BxE[:, None] == seg_q[:, :, None])
            & (end_BxE[:, None] <= rows[None, :, None]) & (seg_q[:, :, None] > 0))
    picked, entry_mask, scores = _entries(entries_BxExK, seen, index, start, block)
    out, probs = _softmax_out(q, keys, picked, token_mask, entry_mask, sink_H)
    return out, (None if index is None else compressed.indexer_kl(probs, scores, entry_mask))

  starts = jnp.arange(0, length + pad, block)
  out_NxBxbxHxK, stats = jax.lax.map(jax.checkpoint(one), starts)
  out = jnp.moveaxis(out_NxBxbxHxK, 0, 1).reshape(b, length + pad, heads, k)[:, :length]
  sums = None if index is None else {name: jnp.sum(v) for name, v in stats.items()}
  return out.astype(q_BxLxHxK.dtype), sums


def _entries(entries_BxExK, seen_BxbxE, index, start, block):
  """(entries each query attends to, [B, b, n, K] or shared [B, E, K]; mask [B, b, n]; the
  indexer's scores of them [B, b, n], None without an indexer)."""
  if index is None:
    return entries_BxExK, seen_BxbxE, None
  q_idx, w_idx, keys_BxExC, top_k = index
  q = jax.lax.dynamic_slice_in_dim(q_idx, start, block, axis=1)
  w = jax.lax.dynamic_slice_in_dim(w_idx, start, block, axis=1)
  scores_BxbxE = compressed.index_scores(q, w, keys_BxExC)
  k = min(top_k, entries_BxExK.shape[1])
  if k == 0:
    return entries_BxExK, seen_BxbxE, scores_BxbxE
  _, picks_Bxbxk = jax.lax.top_k(jnp.where(seen_BxbxE, scores_BxbxE, -jnp.inf), k)
  chosen_Bxbxk = jnp.take_along_axis(seen_BxbxE, picks_Bxbxk, axis=-1)
  gathered = jax.vmap(lambda e, p: e[p])(entries_BxExK, picks_Bxbxk)  # [B, b, k, K]
  return gathered, chosen_Bxbxk, jnp.take_along_axis(scores_BxbxE, picks_Bxbxk, axis=-1)


def _softmax_out(q_BxbxHxK, keys_BxSxK, entries, token_mask_BxbxS, entry_mask_Bxbxn, sink_H):
  scale = q_BxbxHxK.shape[-1] ** -0.5
  tokens = jnp.einsum("bqhd,bsd->bhqs", q_BxbxHxK, keys_BxSxK.astype(jnp.float32)) * scale
  entries = entries.astype(jnp.float32)
  shared = entries.ndim == 3
  spec = "bqhd,bed->bhqe" if shared else "bqhd,bqed->bhqe"
  near = jnp.einsum(spec, q_BxbxHxK, entries) * scale
  logits = jnp.concatenate([jnp.where(token_mask_BxbxS[:, None], tokens, -jnp.inf),
                            jnp.where(entry_mask_Bxbxn[:, None], near, -jnp.inf)], axis=-1)
  sink = jnp.broadcast_to(sink_H.astype(jnp.float32)[None, :, None, None],
                          (*logits.shape[:3], 1))
  probs = jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1]
  s = keys_BxSxK.shape[1]
  out = jnp.einsum("bhqs,bsd->bqhd", probs[..., :s], keys_BxSxK.astype(jnp.float32))
  spec = "bhqe,bed->bqhd" if shared else "bhqe,bqed->bqhd"
  return out + jnp.einsum(spec, probs[..., s:], entries), probs[..., s:]

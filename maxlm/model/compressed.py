"""Compressed key-value entries on packed rows (DeepSeek-V4's CSA and HCA, report section 2.3).

A layer with compression rate m turns every m tokens of a document into one key-value entry:
each channel is a softmax-weighted sum over the window's tokens, with the weights read from a
gate projection plus a learned bias per slot of the window. Then come an RMSNorm and RoPE at
the window's first position.
- HCA (`overlap=False`, m = 128): windows of m tokens that do not overlap.
- CSA (`overlap=True`, m = 4): the projections are 2C wide. Entry w mixes the first C channels
  of window w - 1's tokens with the last C channels of window w's tokens, one softmax over 2m
  slots. A document's first window has no previous window, so those m slots weigh nothing.
A query sees an entry once the entry's window has closed: its last token is at or before the
query.

**Packed rows.** Windows are counted per document. Window w of a document holds its positions
w m .. w m + m - 1, so an entry never mixes two documents. RoPE uses the document's own
positions. A window the document ends inside never closes and gives no entry. An entry is
visible only to queries of its own document (`visible`). Rows may hold any packing: no window
is aligned to the row.

**Layout.** A row has at most E = L // m closed windows. Entry e of a row is the e-th window
to close, left to right; `end_BxE` holds the row offset of its last token (L for a slot no
window fills). Entries are gathered from the rows, not scattered, so the cost is that of
reading the row once (B x E x m x C = B x L x C).

Written here because transformers' DeepseekV4 compressors assume one document a row (their
windows are aligned to the row's start). tests/test_model_compressed.py checks ours against
them on single documents, and checks that no packing leaks.
"""

import jax
import jax.numpy as jnp

from maxlm.model import rope as rope_lib
from maxlm.model.dense import rms


def closing(positions_BxL, segment_ids_BxL, span):
  """Whether each token ends a run of `span` tokens of its own document at consecutive
  positions (itself and the span - 1 before it in the row)."""
  length = positions_BxL.shape[1]
  first = jnp.arange(length) - (span - 1)
  ok = first >= 0
  first = jnp.clip(first, 0, length - 1)
  same = segment_ids_BxL[:, first] == segment_ids_BxL
  consecutive = positions_BxL[:, first] == positions_BxL - (span - 1)
  return ok[None] & same & consecutive & (segment_ids_BxL > 0)


def window_ends(positions_BxL, segment_ids_BxL, rate):
  """(end_BxE, valid_BxE): the row offset of each closed window's last token, in order, and
  whether the slot holds one. A window closes at a token whose position is m - 1 modulo m and
  whose m - 1 predecessors in the row are its own document's, at consecutive positions."""
  length = positions_BxL.shape[1]
  entries = length // rate
  closes_BxL = ((positions_BxL % rate) == rate - 1) & closing(positions_BxL, segment_ids_BxL,
                                                              rate)
  end_BxE = jax.vmap(lambda c: jnp.nonzero(c, size=entries, fill_value=length)[0])(closes_BxL)
  return end_BxE, end_BxE < length


def _gather(x_BxLxC, idx_BxExS):
  b, e, s = idx_BxExS.shape
  flat = jnp.take_along_axis(x_BxLxC, idx_BxExS.reshape(b, e * s)[..., None], axis=1)
  return flat.reshape(b, e, s, x_BxLxC.shape[-1])


def pool(kv_BxLxC, gate_BxLxC, bias_MxC, positions_BxL, segment_ids_BxL, rate, overlap):
  """The entries before norm and RoPE: (entries_BxExD, end_BxE, valid_BxE), D = C (HCA) or
  C / 2 (CSA). Softmax over the window's slots in float32; a slot no window fills is 0."""
  length = kv_BxLxC.shape[1]
  end_BxE, valid_BxE = window_ends(positions_BxL, segment_ids_BxL, rate)
  span = 2 * rate if overlap else rate
  idx_BxExS = jnp.clip(end_BxE[..., None] - (span - 1) + jnp.arange(span), 0, length - 1)
  kv_BxExSxC = _gather(kv_BxLxC.astype(jnp.float32), idx_BxExS)
  gate_BxExSxC = _gather(gate_BxLxC.astype(jnp.float32), idx_BxExS)
  if overlap:
    d = kv_BxLxC.shape[-1] // 2
    # slots 0..m-1: the previous window's first half of the channels; m..2m-1: this window's
    # second half; each slot's bias is the bias of its place in its own window
    kv_BxExSxD = jnp.concatenate([kv_BxExSxC[:, :, :rate, :d], kv_BxExSxC[:, :, rate:, d:]], 2)
    gate_BxExSxD = jnp.concatenate([gate_BxExSxC[:, :, :rate, :d] + bias_MxC[:, :d],
                                    gate_BxExSxC[:, :, rate:, d:] + bias_MxC[:, d:]], axis=2)
    has_previous_BxE = jnp.take_along_axis(
        closing(positions_BxL, segment_ids_BxL, 2 * rate), jnp.clip(end_BxE, 0, length - 1),
        axis=1)
    slot_ok_BxExS = jnp.concatenate([
        jnp.broadcast_to(has_previous_BxE[..., None], (*end_BxE.shape, rate)),
        jnp.ones((*end_BxE.shape, rate), bool)], axis=-1)
    gate_BxExSxD = jnp.where(slot_ok_BxExS[..., None], gate_BxExSxD, -jnp.inf)
  else:
    kv_BxExSxD, gate_BxExSxD = kv_BxExSxC, gate_BxExSxC + bias_MxC
  weights = jax.nn.softmax(gate_BxExSxD, axis=2)
  entries_BxExD = jnp.sum(weights * kv_BxExSxD, axis=2)
  return jnp.where(valid_BxE[..., None], entries_BxExD, 0.0), end_BxE, valid_BxE


def normalize_and_rotate(entries_BxExD, scale_D, eps, positions_BxE, theta, rope_dim):
  """The entries' RMSNorm (weighted) and RoPE on their last `rope_dim` channels."""
  return rope_lib.apply_tail(rms(entries_BxExD, eps, scale_D), positions_BxE, theta, rope_dim)


def entry_positions(positions_BxL, end_BxE, rate):
  """Each entry's position for RoPE: its window's first position in the document."""
  length = positions_BxL.shape[1]
  last = jnp.take_along_axis(positions_BxL, jnp.clip(end_BxE, 0, length - 1), axis=1)
  return last - (rate - 1)


def visible(segment_ids_BxL, end_BxE, valid_BxE):
  """visible_BxLxE: a query sees an entry of its own document whose window has closed at or
  before it."""
  length = segment_ids_BxL.shape[1]
  owner_BxE = jnp.take_along_axis(segment_ids_BxL, jnp.clip(end_BxE, 0, length - 1), axis=1)
  t = jnp.arange(length)
  return (valid_BxE[:, None, :] & (owner_BxE[:, None, :] == segment_ids_BxL[:, :, None])
          & (end_BxE[:, None, :] <= t[None, :, None]) & (segment_ids_BxL[:, :, None] > 0))


def index_scores(q_BxLxHxC, weights_BxLxH, keys_BxExC):
  """The lightning indexer's score of each entry for each query: sum over its heads h of
  w_h relu(q_h . k), with 1 / sqrt(C) on the dot products (the report's eq. 16)."""
  dots = jnp.einsum("blhc,bec->blhe", q_BxLxHxC.astype(jnp.float32),
                    keys_BxExC.astype(jnp.float32))
  relu = jax.nn.relu(dots) * q_BxLxHxC.shape[-1] ** -0.5
  return jnp.einsum("blhe,blh->ble", relu, weights_BxLxH.astype(jnp.float32))


def select(scores_BxLxE, visible_BxLxE, top_k):
  """chosen_BxLxE: the top_k visible entries by score for each query (all of them when fewer
  are visible). Ties go to the lower index, as in jax.lax.top_k."""
  k = min(top_k, scores_BxLxE.shape[-1])
  if k == 0:
    return visible_BxLxE
  masked = jnp.where(visible_BxLxE, scores_BxLxE, -jnp.inf)
  _, picks_BxLxK = jax.lax.top_k(masked, k)
  chosen = jnp.zeros(scores_BxLxE.shape, bool)
  chosen = jax.vmap(jax.vmap(lambda c, p: c.at[p].set(True)))(chosen, picks_BxLxK)
  return chosen & visible_BxLxE


def attend(q_BxLxHxD, kv_BxLxD, entries_BxExD, entry_mask_BxLxE, segment_ids_BxL, window,
           sink_H):
  """Shared-head attention (K = V) over the query's sliding window of its own document's
  tokens and the entries `entry_mask` lets it see, with a learned logit per head that takes
  softmax mass and gives nothing (the sink). Dense: [B, H, L, L + E] scores, float32; the
  reference that kernels are checked against. Returns out_BxLxHxD."""
  return attend_with_entry_probs(q_BxLxHxD, kv_BxLxD, entries_BxExD, entry_mask_BxLxE,
                                 segment_ids_BxL, window, sink_H)[0]


def attend_with_entry_probs(q_BxLxHxD, kv_BxLxD, entries_BxExD, entry_mask_BxLxE,
                            segment_ids_BxL, window, sink_H):
  """(out_BxLxHxD, probs_BxHxLxE): `attend` and the attention each head gives each entry, what
  the indexer learns from (indexer_kl)."""
  length = kv_BxLxD.shape[1]
  scale = q_BxLxHxD.shape[-1] ** -0.5
  q = q_BxLxHxD.astype(jnp.float32)
  t = jnp.arange(length)
  near = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - window)
  same = (segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :]) & (
      segment_ids_BxL[:, :, None] > 0)
  token_BxLxL = near[None] & same
  tokens = jnp.einsum("blhd,bsd->bhls", q, kv_BxLxD.astype(jnp.float32)) * scale
  entries = jnp.einsum("blhd,bed->bhle", q, entries_BxExD.astype(jnp.float32)) * scale
  logits = jnp.concatenate([jnp.where(token_BxLxL[:, None], tokens, -jnp.inf),
                            jnp.where(entry_mask_BxLxE[:, None], entries, -jnp.inf)], axis=-1)
  sink = jnp.broadcast_to(sink_H.astype(jnp.float32)[None, :, None, None],
                          (*logits.shape[:3], 1))
  probs = jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1]
  values = jnp.concatenate([kv_BxLxD, entries_BxExD], axis=1).astype(jnp.float32)
  out = jnp.einsum("bhls,bsd->blhd", probs, values)
  return out.astype(q_BxLxHxD.dtype), probs[..., length:]


def indexer_kl(probs_BxHxQxN, scores_BxQxN, mask_BxQxN):
  """What CSA's indexer learns from, as DeepSeek-V3.2's lightning indexer does: for each query,
  KL(p || softmax(scores)) over the N entries `mask` lets it see, p the attention its heads
  give those entries (summed over heads, normalised, no gradient). Returns the sums
  {"kl", "queries", "selected"} over the queries that see an entry."""
  p_BxQxN = jax.lax.stop_gradient(jnp.sum(probs_BxHxQxN, axis=1)) * mask_BxQxN
  has_BxQ = jnp.any(mask_BxQxN, axis=-1)
  p_BxQxN = p_BxQxN / jnp.maximum(jnp.sum(p_BxQxN, axis=-1, keepdims=True), 1e-30)
  # a large finite floor, not -inf, so a query that sees nothing has no NaN in its gradient
  log_q = jax.nn.log_softmax(jnp.where(mask_BxQxN, scores_BxQxN, -1e30), axis=-1)
  positive = p_BxQxN > 0
  log_p = jnp.log(jnp.where(positive, p_BxQxN, 1.0))
  kl_BxQ = jnp.sum(jnp.where(positive, p_BxQxN * (log_p - log_q), 0.0), axis=-1)
  return {"kl": jnp.sum(jnp.where(has_BxQ, kl_BxQ, 0.0)),
          "queries": jnp.sum(has_BxQ).astype(jnp.float32),
          "selected": jnp.sum(mask_BxQxN).astype(jnp.float32)}

"""Assembly: a row of planned pieces + the token store -> the six arrays of the batch contract
(docs/batch.md): inputs, targets, segment_ids, positions, loss_mask and roles (FIELDS).

Each piece becomes the segment [BOS if it starts the document] + context + body + [EOS if it
ends it], its body FIM-rearranged when planned so; `inputs = s[:-1]` and `targets = s[1:]` are
taken inside the segment, so no position predicts the next document's first token. `loss_mask`
is 0 on padding, on targets inside the context, and on a chat document's prompt targets and EOS.
A preference pair is two adjacent segments (pairs.py), marked in `roles` (1 chosen, 2 rejected,
0 for everything else): the rejected answer is always the segment after its chosen one.
"""

import numpy as np

from maxlm.data import fim, pairs

FIELDS = ("inputs", "targets", "segment_ids", "positions", "loss_mask", "roles")


def segment(store, special, seed, piece):
  """(tokens, counts_as_target) of one piece's segment."""
  _, doc, start, end, ctx, mode = piece[:6]
  index = store.index
  tokens = store.read(doc, start - ctx, end)
  body = tokens[ctx:]
  if mode != fim.NONE:
    i, j = fim.split_points(seed, doc, start, len(body))
    body = fim.apply(body, mode, i, j, special)
  bos, eos = start == 0, end == int(index.length[doc])
  parts = ([[special.bos]] if bos else []) + [tokens[:ctx], body] + ([[special.eos]] if eos else [])
  seg = np.concatenate([np.asarray(p, np.int32) for p in parts])
  weight = np.ones(len(seg), np.int32)
  weight[int(bos):int(bos) + ctx] = 0
  if index.is_chat[doc]:
    offset = int(bos) + ctx - start  # segment index of document token t is t + offset
    for a, b in index.no_loss(doc):
      weight[max(a, start) + offset:max(min(b, end), start) + offset] = 0
    if eos:
      weight[-1] = 0
  return seg, weight


def segments(store, special, seed, piece):
  """[(tokens, counts_as_target, role)]: one segment, or a pair's two."""
  p, c = store.index.pair_of(piece[1])
  if p:
    return pairs.segments(store.read(piece[1], 0, int(store.index.length[piece[1]])), p, c,
                          special)
  return [(*segment(store, special, seed, piece), pairs.NONE)]


def row_arrays(store, special, seed, pieces, seq_len):
  """The int32 arrays [seq_len] of one row."""
  out = {f: np.zeros(seq_len, np.int32) for f in FIELDS}
  at = 0
  segs = [(s, piece) for piece in pieces for s in segments(store, special, seed, piece)]
  for k, ((seg, weight, role), piece) in enumerate(segs, 1):
    n = len(seg) - 1
    if at + n > seq_len:
      raise ValueError(f"row overflows {seq_len} positions at piece {piece}")
    out["inputs"][at:at + n] = seg[:-1]
    out["targets"][at:at + n] = seg[1:]
    out["segment_ids"][at:at + n] = k
    out["positions"][at:at + n] = np.arange(n, dtype=np.int32)
    out["loss_mask"][at:at + n] = weight[1:]
    out["roles"][at:at + n] = role
    at += n
  out["inputs"][at:] = special.pad
  out["targets"][at:] = special.pad
  return out


def without_document_mask(arrays):
  """A row's arrays with its documents merged into one segment whose positions run across
  the row (data.document_mask: false): every token sees the documents before it in the row.
  Targets, loss mask and roles are unchanged, so no position learns to predict the next
  document's first token in either form."""
  used = arrays["segment_ids"] > 0
  out = dict(arrays)
  out["segment_ids"] = used.astype(np.int32)
  out["positions"] = np.where(used, np.arange(len(used), dtype=np.int32), 0).astype(np.int32)
  return out

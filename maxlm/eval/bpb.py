"""Held-out loss and bits per byte, per source, on the documents `prepare` held out.

Held-out documents are cut like training documents (with the same overlap as read-only
context) and first-fit packed, in index order, into at most `max_rows` rows. A document counts
toward bits per byte only if all of it was evaluated: the summed NLL of its tokens (in nats)
over ln 2 and over the UTF-8 bytes of its original text. Chat documents count toward the loss
but not toward bits per byte, since only their replies are scored.
"""

import math

import numpy as np

from maxlm.data import assemble, chunk, store


def heldout_rows(index, seq_len, overlap, min_cut, max_rows, split=store.VAL):
  """(rows of pieces, set of documents whose every piece made it into a row)."""
  rows, space, complete = [], [], set()
  for doc in np.flatnonzero(index.split == split).tolist():
    n = int(index.length[doc])
    pos, lvl = index.bounds(doc)
    pieces = [(int(index.source[doc]), doc, a, b, ctx, 0)
              for a, b, ctx in chunk.cut(n, 0, n, pos, lvl, seq_len + 1, overlap, min_cut)]
    placed = True
    for piece in pieces:
      size = chunk.positions(int(piece[2] == 0), piece[4], piece[3] - piece[2],
                             int(piece[3] == n), 0)
      slot = next((i for i, free in enumerate(space) if free >= size), None)
      if slot is None:
        if len(rows) >= max_rows:
          placed = False
          break
        rows.append([])
        space.append(seq_len)
        slot = len(rows) - 1
      rows[slot].append(piece)
      space[slot] -= size
    if placed:
      complete.add(doc)
  return rows, complete


def evaluate(nll_fn, data, seq_len, batch_rows, max_rows, split=store.VAL):
  """{'val_loss', 'val_bpb', 'val_loss/<source>', 'val_bpb/<source>'} using nll_fn(batch)->
  per-position NLL [rows, L]."""
  cfg = data.config.data
  index = data.index
  rows, complete = heldout_rows(index, seq_len, cfg.overlap, cfg.min_cut, max_rows, split)
  if not rows:
    return {}
  names = index.sources
  nll_src = np.zeros(len(names))
  count_src = np.zeros(len(names))
  nll_doc = {}
  for first in range(0, len(rows), batch_rows):
    group = rows[first:first + batch_rows]
    arrays = [assemble.row_arrays(data.store, data.special, data.config.seed, r, seq_len)
              for r in group]
    arrays += [{f: np.zeros(seq_len, np.int32) for f in assemble.FIELDS}] * (
        batch_rows - len(group))
    batch = {f: np.stack([a[f] for a in arrays]) for f in assemble.FIELDS}
    nll = np.asarray(nll_fn(batch), np.float64)
    for r, pieces in enumerate(group):
      seg = batch["segment_ids"][r]
      for k, piece in enumerate(pieces, 1):
        at = seg == k
        value = float(nll[r][at].sum())
        nll_src[piece[0]] += value
        count_src[piece[0]] += int(batch["loss_mask"][r][at].sum())
        nll_doc[piece[1]] = nll_doc.get(piece[1], 0.0) + value
  out = {"val_loss": float(nll_src.sum() / max(count_src.sum(), 1))}
  bits, nbytes = np.zeros(len(names)), np.zeros(len(names))
  for doc in complete:
    if not index.is_chat[doc]:
      bits[index.source[doc]] += nll_doc.get(doc, 0.0) / math.log(2)
      nbytes[index.source[doc]] += int(index.nbytes[doc])
  out["val_bpb"] = float(bits.sum() / nbytes.sum()) if nbytes.sum() else float("nan")
  for i, name in enumerate(names):
    if count_src[i]:
      out[f"val_loss/{name}"] = float(nll_src[i] / count_src[i])
    if nbytes[i]:
      out[f"val_bpb/{name}"] = float(bits[i] / nbytes[i])
  return out

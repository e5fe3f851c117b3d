"""Held-out loss and bits per byte, per source, on the documents `prepare` held out.

Which rows are evaluated (`heldout_rows`) is a fixed rule, so every source is represented and
an evaluation at step 100 scores exactly the rows of the one at step 50:
  1. Equal rows per source. Of `max_rows` rows, each source with held-out documents gets
     the same number of rows, or all its held-out documents fill if fewer; rows left over go
     one each to the first sources in index order (`row_quotas`). Equal rows, not rows in
     proportion to tokens, because the per-source numbers are what runs are compared on, and
     equal rows make each about equally precise: a small source is not left with a row or two.
     So `all` (val_loss, val_bpb) weighs the sources about equally; it is neither the training
     mix nor the held-out one, and the per-source values are the ones to read.
  2. A source's documents are taken in a fixed permutation (seeded by the source's name, not by
     the run's seed, so runs with different seeds are scored on the same rows and adding a
     source does not change another's), cut like training documents (with the same overlap as
     read-only context) and first-fit packed into its rows (`pack`): whole documents first,
     passing over those that do not fit, so a long document does not crowd out the short ones
     after it; then the passed-over ones fill the room left from their start, for the loss.
The rows depend only on the data dir, the split, seq_len, data.overlap, data.min_cut and
max_rows: not on the batch size, the hosts or the step.

A document counts toward bits per byte only if all of it was evaluated: the summed NLL of its
tokens (in nats) over ln 2 and over the UTF-8 bytes of its original text. Chat documents count
toward the loss but not toward bits per byte, since only their replies are scored.
"""

import math
import zlib

import numpy as np

from maxlm.data import assemble, chunk, store

FIELDS = ("rows", "tokens", "bytes", "loss", "bpb")


def source_order(index, source, split=store.VAL):
  """The held-out documents of one source in their fixed evaluation order (preference pairs
  are not text to score: left out)."""
  docs = np.flatnonzero((index.split == split) & (index.source == source)
                        & (index.pair[:, 0] == 0))
  name = index.sources[source].encode()
  return docs[np.random.default_rng([zlib.crc32(name), 0xE7A1]).permutation(len(docs))].tolist()


def pack(index, docs, seq_len, overlap, min_cut, max_rows, patience=64):
  """(rows of pieces, documents in them whole): docs first-fit packed in the given order into
  at most max_rows rows, in two passes. First whole documents: one that does not fit whole is
  passed over, and the pass ends once all rows are open and `patience` documents in a row have
  not fit. Then the passed-over documents, in the same order, fill the room left piece by
  piece from their start (for the loss only: bits per byte needs the whole document), so a
  source of long documents still fills its rows."""
  rows, space, complete, passed = [], [], [], []
  for doc in docs:
    pieces = _pieces(index, doc, seq_len, overlap, min_cut)
    slots = _first_fit([size for size, _ in pieces], space, seq_len, max_rows)
    if slots is None:
      passed.append(pieces)
      if len(rows) == max_rows and len(passed) >= patience and all(
          p is not None for p in passed[-patience:]):
        break
      continue
    passed.append(None)  # a fit: the run of misses starts again
    _place(rows, space, seq_len, pieces, slots)
    complete.append(doc)
  for pieces in (p for p in passed if p is not None):
    for piece in pieces:
      slots = _first_fit([piece[0]], space, seq_len, max_rows)
      if slots is None:
        break
      _place(rows, space, seq_len, [piece], slots)
  return rows, complete


def _pieces(index, doc, seq_len, overlap, min_cut):
  """[(positions, piece)] of a document cut as for training."""
  n = int(index.length[doc])
  pos, lvl = index.bounds(doc)
  return [(chunk.positions(int(a == 0), ctx, b - a, int(b == n), 0),
           (int(index.source[doc]), doc, a, b, ctx, 0))
          for a, b, ctx in chunk.cut(n, 0, n, pos, lvl, seq_len + 1, overlap, min_cut)]


def _first_fit(sizes, space, seq_len, max_rows):
  """The row of each size when first-fit after the rows' free `space`, or None."""
  free, slots = list(space), []
  for size in sizes:
    slot = next((i for i, f in enumerate(free) if f >= size), None)
    if slot is None:
      if len(free) >= max_rows or size > seq_len:
        return None
      free.append(seq_len)
      slot = len(free) - 1
    free[slot] -= size
    slots.append(slot)
  return slots


def _place(rows, space, seq_len, pieces, slots):
  for (size, piece), slot in zip(pieces, slots):
    while slot >= len(rows):
      rows.append([])
      space.append(seq_len)
    rows[slot].append(piece)
    space[slot] -= size


def row_quotas(wanted, max_rows):
  """Rows per source: the largest equal share t with sum(min(wanted, t)) <= max_rows (a
  source gets t rows, or all it can fill: wanted[i]), then one more each, while rows are left,
  to the first sources in index order that can fill more."""
  level = 0
  while level < max(wanted, default=0) and sum(min(w, level + 1) for w in wanted) <= max_rows:
    level += 1
  quota = [min(w, level) for w in wanted]
  left = max_rows - sum(quota)
  for i, w in enumerate(wanted):
    if left > 0 and quota[i] < w:
      quota[i] += 1
      left -= 1
  return quota


def heldout_rows(index, seq_len, overlap, min_cut, max_rows, split=store.VAL):
  """(rows of pieces, set of documents whose every piece made it into a row), by the rule in
  the module docstring; rows are grouped by source, in source index order."""
  orders = [source_order(index, i, split) for i in range(len(index.sources))]
  packed = [pack(index, docs, seq_len, overlap, min_cut, max_rows) for docs in orders]
  quotas = row_quotas([len(rows) for rows, _ in packed], max_rows)
  rows, complete = [], set()
  for docs, (full, done), quota in zip(orders, packed, quotas):
    if quota < len(full):
      full, done = pack(index, docs, seq_len, overlap, min_cut, quota)
    rows += full
    complete.update(done)
  return rows, complete


def evaluate_table(nll_fn, data, seq_len, batch_rows, max_rows, split=store.VAL):
  """{"sources": {name: {rows, tokens, bytes, loss, bpb}}, "all": {...}} using nll_fn(batch)->
  per-position NLL [rows, L]; {} when the split has no documents. tokens: loss positions
  scored; bytes: UTF-8 bytes of the documents that count toward bits per byte."""
  cfg = data.config.data
  rows, complete = heldout_rows(data.index, seq_len, cfg.overlap, cfg.min_cut, max_rows, split)
  return score(nll_fn, data, rows, complete, seq_len, batch_rows)


def score(nll_fn, data, rows, complete, seq_len, batch_rows):
  """`evaluate_table` of given rows of pieces and complete documents; a source's `rows` are
  those holding any of its pieces."""
  index = data.index
  if not rows:
    return {}
  n_src = len(index.sources)
  nll_src, count_src, rows_src = np.zeros(n_src), np.zeros(n_src), np.zeros(n_src, np.int64)
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
      rows_src[sorted({p[0] for p in pieces})] += 1
      seg = batch["segment_ids"][r]
      for k, piece in enumerate(pieces, 1):
        at = seg == k
        value = float(nll[r][at].sum())
        nll_src[piece[0]] += value
        count_src[piece[0]] += int(batch["loss_mask"][r][at].sum())
        nll_doc[piece[1]] = nll_doc.get(piece[1], 0.0) + value
  bits, nbytes = np.zeros(n_src), np.zeros(n_src, np.int64)
  for doc in complete:
    if not index.is_chat[doc]:
      bits[index.source[doc]] += nll_doc.get(doc, 0.0) / math.log(2)
      nbytes[index.source[doc]] += int(index.nbytes[doc])

  def entry(rows_n, count, nll_sum, bits_sum, bytes_n):
    return {"rows": int(rows_n), "tokens": int(count),
            "bytes": int(bytes_n), "loss": float(nll_sum / count) if count else float("nan"),
            "bpb": float(bits_sum / bytes_n) if bytes_n else float("nan")}

  sources = {name: entry(rows_src[i], count_src[i], nll_src[i], bits[i], nbytes[i])
             for i, name in enumerate(index.sources) if rows_src[i]}
  return {"sources": sources, "all": entry(len(rows), count_src.sum(), nll_src.sum(),
                                           bits.sum(), nbytes.sum())}


def as_metrics(table):
  """The flat metrics.jsonl / TensorBoard keys: val_loss, val_bpb, val_loss/<source>,
  val_bpb/<source> (a source without complete documents has no val_bpb/<source>)."""
  if not table:
    return {}
  out = {"val_loss": table["all"]["loss"], "val_bpb": table["all"]["bpb"]}
  for name, e in table["sources"].items():
    if e["tokens"]:
      out[f"val_loss/{name}"] = e["loss"]
    if e["bytes"]:
      out[f"val_bpb/{name}"] = e["bpb"]
  return out


def evaluate(nll_fn, data, seq_len, batch_rows, max_rows, split=store.VAL):
  """`as_metrics` of `evaluate_table`."""
  return as_metrics(evaluate_table(nll_fn, data, seq_len, batch_rows, max_rows, split))


def jsonable(value):
  """value with NaN (nothing to divide by, a diverged step) as None, for strict JSON."""
  if isinstance(value, dict):
    return {k: jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [jsonable(v) for v in value]
  return None if isinstance(value, float) and math.isnan(value) else value

"""Which held-out text an evaluation scores, and how it is laid out in rows of the stage's L.

The text depends only on the data dir, the split and the per-source token budget
(train.eval_tokens): not on L, the batch size, the hosts or the step, so every evaluation of a
run, at every stage, scores the same tokens of the same documents (`heldout_docs`):
  1. A source's held-out documents in a fixed permutation, seeded by the source's name (not by
     the run's seed, so runs with different seeds score the same text, and adding a source
     does not change another's). Preference pairs are not text to score: left out.
  2. The budget takes documents from the start of that order, whole, while the next one still
     fits (always at least one, so a source of one long document is still scored): a fixed
     prefix, so a larger budget scores a superset, and whole documents, so their bytes are
     the ones the index records.
Each taken document is then scored whole at the stage's L (`heldout_rows`): cut into windows
where training would cut it (`chunk.cut`), each window after the first carrying the
`context_tokens` before it as read-only, loss-masked context, so every token of the document
and its EOS is a target exactly once whatever L is (L changes how much context a token sees,
not which tokens count). The windows are first-fit packed, in order, into rows of L
positions, a row holding one source.
"""

import zlib

import numpy as np

from maxlm.data import chunk, store

FIT_LOOKBACK = 64  # open rows a window may go back to: packing stays linear in the windows


def source_order(index, source, split=store.VAL):
  """The held-out documents of one source in their fixed evaluation order."""
  docs = np.flatnonzero((index.split == split) & (index.source == source)
                        & (index.pair[:, 0] == 0))
  name = index.sources[source].encode()
  return docs[np.random.default_rng([zlib.crc32(name), 0xE7A1]).permutation(len(docs))].tolist()


def take(index, docs, budget):
  """The longest prefix of docs whose tokens fit `budget`, and at least the first document."""
  if not docs:
    return []
  lengths = np.asarray(index.length)[np.asarray(docs, np.int64)].astype(np.int64)
  fits = int(np.searchsorted(np.cumsum(lengths), budget, "right"))
  return list(docs[:max(fits, 1)])


def heldout_docs(index, budget, split=store.VAL):
  """[the documents scored] per source, in source index order (empty: nothing held out)."""
  return [take(index, source_order(index, s, split), budget) for s in range(len(index.sources))]


def context_tokens(overlap, seq_len):
  """Read-only context of a window after the first: data.overlap, at least one token (without
  it a window's first token would be no target), under half of L (as training checks)."""
  return max(1, min(overlap, (seq_len - 1) // 2))


def windows(index, doc, seq_len, context, min_cut):
  """[(positions, piece)] covering document `doc` whole, in rows of seq_len positions."""
  n = int(index.length[doc])
  pos, lvl = index.bounds(doc)
  return [(chunk.positions(int(a == 0), ctx, b - a, int(b == n), 0),
           (int(index.source[doc]), int(doc), a, b, ctx, 0))
          for a, b, ctx in chunk.cut(n, 0, n, pos, lvl, seq_len + 1, context, min_cut)]


def pack(sized_pieces, seq_len):
  """Rows of pieces: each (positions, piece) first-fit, in order, into the last FIT_LOOKBACK
  rows, or a new row."""
  rows, free = [], []
  for size, piece in sized_pieces:
    first = max(0, len(rows) - FIT_LOOKBACK)
    slot = next((i for i in range(first, len(rows)) if free[i] >= size), None)
    if slot is None:
      rows.append([])
      free.append(seq_len)
      slot = len(rows) - 1
    rows[slot].append(piece)
    free[slot] -= size
  return rows


def heldout_rows(index, docs_per_source, seq_len, overlap, min_cut):
  """Rows of pieces covering every document of docs_per_source whole, grouped by source."""
  context = context_tokens(overlap, seq_len)
  rows = []
  for docs in docs_per_source:
    rows += pack([w for d in docs for w in windows(index, d, seq_len, context, min_cut)],
                 seq_len)
  return rows

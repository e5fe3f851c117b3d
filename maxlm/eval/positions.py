"""Held-out loss by position: does a stage use its longer context?

Held-out loss averages over positions, so a model that ignores everything beyond 4K scores
about the same as one that uses it. Here each source's loss is split by how much of its
document a token sees: the token at row position p of a document (p = 0 predicts the first
token from BOS alone) sees p tokens before it.

Buckets (`buckets`): edges at 64 x 4^k (64, 256, 1K, 4K, 16K, 64K, 256K, 1M), the last bucket
ending at the stage's L: L = 1024 gives 0-64, 64-256, 256-1024; L = 4096 adds 1024-4096, and
L = 2^20 has eight. The same edges at every L, so a bucket means the same positions at every
stage and the curves of a run's stages overlay (after a longer stage, loss beyond the old
length should fall).

Documents (`documents`): per source, the longest held-out documents (ties in the source's
fixed evaluation order, maxlm/eval/windows.py) while their tokens fit the budget
(train.eval_tokens; at least one): the same set at every stage. Each is scored from its start
in one piece of up to L positions (rows packed first-fit), and a bucket [a, b) counts only the
documents whose scored targets reach position b - 1 ("long enough to fill it"), so a bucket is
the same documents and tokens at every stage where b <= L, and a short document cannot pull
down the early buckets alone. A bucket no document fills is left out.
"""

import numpy as np

from maxlm.data import store
from maxlm.eval import bpb, windows

FIRST_EDGE = 64
GROWTH = 4


def buckets(seq_len):
  """[(start, end)] position buckets up to seq_len (end exclusive)."""
  edges, e = [0], FIRST_EDGE
  while e < seq_len:
    edges.append(e)
    e *= GROWTH
  edges.append(seq_len)
  return list(zip(edges[:-1], edges[1:]))


def bucket_name(start, end):
  return f"{start}-{end}"


def documents(index, budget, split=store.VAL):
  """[the documents scored] per source: the longest held-out ones within `budget` tokens."""
  out = []
  for s in range(len(index.sources)):
    docs = windows.source_order(index, s, split)
    docs = [d for d in docs if not index.is_chat[d]]
    lengths = np.asarray(index.length)[np.asarray(docs, np.int64)] if docs else np.zeros(0)
    longest = [docs[i] for i in np.argsort(-lengths, kind="stable")]
    out.append(windows.take(index, longest, budget))
  return out


def piece(index, doc, seq_len):
  """(positions, piece): document `doc` from its start in at most seq_len positions."""
  n = int(index.length[doc])
  end = n if n + 1 <= seq_len else (seq_len if n > seq_len else seq_len - 1)
  return end + int(end == n), (int(index.source[doc]), int(doc), 0, end, 0, 0)


def by_position(nll_fn, data, seq_len, batch_rows, budget, split=store.VAL):
  """{source: {bucket name: {tokens, loss}}} with nll_fn(batch) -> per-position NLL [rows, L];
  {} when the split has no documents."""
  index = data.index
  docs = documents(index, budget, split)
  rows = []
  for source_docs in docs:
    rows += windows.pack([piece(index, d, seq_len) for d in source_docs], seq_len)
  if not rows:
    return {}
  spans = buckets(seq_len)
  nll_sum = np.zeros((len(index.sources), len(spans)))
  count = np.zeros((len(index.sources), len(spans)), np.int64)
  for group, batch, nll in bpb.scored_batches(nll_fn, data, rows, seq_len, batch_rows):
    for r, pieces in enumerate(group):
      add_row(nll[r], batch, r, pieces, spans, nll_sum, count)
  return table(index.sources, spans, nll_sum, count)


def add_row(nll_L, batch, r, pieces, spans, nll_sum, count):
  """Adds row r's scored targets to the buckets its documents fill (segment k = pieces[k-1])."""
  seg, pos, mask = batch["segment_ids"][r], batch["positions"][r], batch["loss_mask"][r]
  for k, p in enumerate(pieces, 1):
    at = (seg == k) & (mask > 0)
    reach = int(pos[at].max()) + 1 if at.any() else 0  # targets at positions 0..reach-1
    for b, (start, end) in enumerate(spans):
      if reach < end:
        break
      inside = at & (pos >= start) & (pos < end)
      nll_sum[p[0], b] += float(nll_L[inside].sum())
      count[p[0], b] += int(inside.sum())


def table(sources, spans, nll_sum, count):
  out = {}
  for s, name in enumerate(sources):
    cells = {bucket_name(*span): {"tokens": int(count[s, b]),
                                  "loss": float(nll_sum[s, b] / count[s, b])}
             for b, span in enumerate(spans) if count[s, b]}
    if cells:
      out[name] = cells
  return out


def as_metrics(positions):
  """Flat metrics.jsonl keys: val_pos_loss/<source>/<bucket>, val_pos_tokens/<source>/<bucket>."""
  out = {}
  for source, cells in positions.items():
    for bucket, e in cells.items():
      out[f"val_pos_loss/{source}/{bucket}"] = e["loss"]
      out[f"val_pos_tokens/{source}/{bucket}"] = e["tokens"]
  return out


def from_metrics(row):
  """{source: {bucket: loss}} from a metrics row (inverse of as_metrics' loss keys)."""
  out = {}
  for key, value in row.items():
    if key.startswith("val_pos_loss/"):
      _, source, bucket = key.split("/", 2)
      out.setdefault(source, {})[bucket] = value
  return out

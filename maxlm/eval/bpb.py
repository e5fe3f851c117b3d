"""Held-out loss and bits per byte, per source, over the same text at every stage.

What is scored is fixed by maxlm/eval/windows.py: per source, a fixed prefix of whole held-out
documents within train.eval_tokens, each scored whole in windows of the stage's L, so every
evaluation of a run scores the same tokens and the same bytes whatever L, the batch or the
hosts (the `tokens` and `bytes` columns say so: `val_tokens/<source>`, `val_bytes/<source>`).

Per source: `documents` scored, `tokens` (the targets scored), `bytes` (UTF-8 bytes of exactly
the text scored), `nll` (their summed negative log-likelihood, nats), `loss` = nll / tokens
and `bpb` = nll / ln 2 / bytes, so both are recomputable from the columns. The bytes of a text
document are those of its cleaned text as it was tokenized (the index's `nbytes`; its targets
are its tokens and its EOS); a chat document is scored on its replies only, so its bytes are
the replies' (decoded from their tokens: the tokenizer round-trips text exactly). `all` sums
the sources' columns, so it weighs each source by its scored tokens, which the per-source
budget keeps about equal: it is neither the training mix nor the held-out one, and the
per-source values are the ones to read. A source scored on fewer than SMALL_TOKENS tokens is
`small`: its numbers are noisy (a few documents decide them).
"""

import math

import numpy as np

from maxlm import io
from maxlm.data import assemble, store, tokenizer
from maxlm.eval import windows

FIELDS = ("documents", "tokens", "bytes", "nll", "loss", "bpb", "small")
SMALL_TOKENS = 10_000


def scored_bytes(data, doc):
  """UTF-8 bytes of the text of `doc` an evaluation scores."""
  index = data.index
  if not index.is_chat[doc]:
    return int(index.nbytes[doc])
  tokens = data.store.read(doc, 0, int(index.length[doc]))
  keep = np.ones(len(tokens), bool)
  for a, b in index.no_loss(doc):
    keep[a:b] = False
  replies = [int(t) for t in tokens[keep] if t != data.special.chat_end]
  return len(_tokenizer(data.config.data.dir).decode(replies).encode())


_TOKENIZERS = {}


def _tokenizer(data_dir):
  if data_dir not in _TOKENIZERS:
    _TOKENIZERS[data_dir] = tokenizer.load(io.read_bytes(io.join(data_dir, "tokenizer.model")))
  return _TOKENIZERS[data_dir]


def evaluate_table(nll_fn, data, seq_len, batch_rows, budget, split=store.VAL):
  """{"sources": {name: {FIELDS}}, "all": {...}} using nll_fn(batch) -> per-position NLL
  [rows, L] (0 where the loss mask is 0); {} when the split has no documents to score."""
  cfg = data.config.data
  docs = windows.heldout_docs(data.index, budget, split)
  rows = windows.heldout_rows(data.index, docs, seq_len, cfg.overlap, cfg.min_cut)
  return score(nll_fn, data, docs, rows, seq_len, batch_rows)


def score(nll_fn, data, docs_per_source, rows, seq_len, batch_rows):
  """`evaluate_table` of the documents per source, laid out in the given rows of pieces."""
  index = data.index
  if not rows:
    return {}
  n_src = len(index.sources)
  nll_src, count_src = np.zeros(n_src), np.zeros(n_src, np.int64)
  for group, batch, nll in scored_batches(nll_fn, data, rows, seq_len, batch_rows):
    for r, pieces in enumerate(group):
      seg = batch["segment_ids"][r]
      for k, piece in enumerate(pieces, 1):
        at = seg == k
        nll_src[piece[0]] += float(nll[r][at].sum())
        count_src[piece[0]] += int(batch["loss_mask"][r][at].sum())
  sources = {}
  for i, docs in enumerate(docs_per_source):
    if docs:
      sources[index.sources[i]] = entry(len(docs), count_src[i],
                                        sum(scored_bytes(data, d) for d in docs), nll_src[i])
  total = [sum(e[f] for e in sources.values()) for f in ("documents", "tokens", "bytes", "nll")]
  return {"sources": sources, "all": entry(*total)}


def scored_batches(nll_fn, data, rows, seq_len, batch_rows):
  """(rows of pieces, batch, per-position NLL [batch_rows, L] in float64) for each batch of
  `rows`, the last padded with empty rows to batch_rows."""
  for first in range(0, len(rows), batch_rows):
    group = rows[first:first + batch_rows]
    arrays = [assemble.row_arrays(data.store, data.special, data.config.seed, r, seq_len)
              for r in group]
    arrays += [{f: np.zeros(seq_len, np.int32) for f in assemble.FIELDS}] * (
        batch_rows - len(group))
    batch = {f: np.stack([a[f] for a in arrays]) for f in assemble.FIELDS}
    yield group, batch, np.asarray(nll_fn(batch), np.float64)


def entry(documents, tokens, nbytes, nll):
  """One row of the table: its counts and sums, and the loss and bits per byte they give."""
  return {"documents": int(documents), "tokens": int(tokens), "bytes": int(nbytes),
          "nll": float(nll), "loss": float(nll / tokens) if tokens else float("nan"),
          "bpb": float(nll / math.log(2) / nbytes) if nbytes else float("nan"),
          "small": bool(tokens < SMALL_TOKENS)}


def small_sources(table):
  """[(source, tokens scored)] of the sources scored on fewer than SMALL_TOKENS tokens."""
  return [(name, e["tokens"]) for name, e in table.get("sources", {}).items() if e["small"]]


def small_note(small):
  """One line on the sources with too little held-out text to trust, or ''."""
  if not small:
    return ""
  names = ", ".join(f"{name} ({tokens:,} tokens)" for name, tokens in small)
  return (f"small held-out set, under {SMALL_TOKENS:,} tokens scored: {names}; a few "
          "documents decide its loss and bits per byte (more held-out text: `maxlm prepare "
          "--val-fraction`, or a larger train.eval_tokens)")


def as_metrics(table):
  """The flat metrics.jsonl / TensorBoard keys: val_loss, val_bpb, val_tokens, val_bytes and
  per source val_loss/<source>, val_bpb/<source>, val_tokens/<source>, val_bytes/<source>
  (a source without scored targets or bytes has no loss or bits per byte)."""
  if not table:
    return {}
  out = {}
  for suffix, e in [("", table["all"]), *((f"/{n}", e) for n, e in table["sources"].items())]:
    out[f"val_tokens{suffix}"], out[f"val_bytes{suffix}"] = e["tokens"], e["bytes"]
    if e["tokens"]:
      out[f"val_loss{suffix}"] = e["loss"]
    if e["bytes"]:
      out[f"val_bpb{suffix}"] = e["bpb"]
  return out


def evaluate(nll_fn, data, seq_len, batch_rows, budget, split=store.VAL):
  """`as_metrics` of `evaluate_table`."""
  return as_metrics(evaluate_table(nll_fn, data, seq_len, batch_rows, budget, split))


def jsonable(value):
  """value with NaN (nothing to divide by, a diverged step) as None, for strict JSON."""
  if isinstance(value, dict):
    return {k: jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [jsonable(v) for v in value]
  return None if isinstance(value, float) and math.isnan(value) else value

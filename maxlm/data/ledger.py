"""The ledger: exact token accounting per stage and source, computed from the plan alone.

Per source: pieces, body tokens, marker tokens (BOS, EOS, FIM), context (overlap) tokens read
twice, row positions, loss positions, unique documents, pieces cut inside a word (ending before
their document at no boundary the index records: the planner's last resort, chunk.py), and
exposure (body tokens consumed over the source's training tokens: 1.0 is one epoch). Per stage:
rows, positions, padding. The rules match `assemble` exactly; a test checks the ledger against
the assembled batches.
"""

import numpy as np

from maxlm.data import chunk, fim, plan

FIELDS = ("pieces", "body", "bos", "eos", "fim_markers", "context", "positions", "loss",
          "documents", "in_word", "pairs", "prompt", "answer")
# pairs: preference pairs (pairs.py); prompt: their prompt tokens as the rows hold them (twice a
# pair, once per segment); answer: their chosen and rejected tokens (EOS not included).
PAIR_COLUMNS = ("pairs", "prompt", "answer")


def piece_counts(index, block):
  """Per-piece int64 arrays: markers, positions and loss positions."""
  bos = (block.start == 0).astype(np.int64)
  eos = (block.end == index.length[block.doc]).astype(np.int64)
  fim_markers = np.where(block.fim != fim.NONE, chunk.FIM_MARKERS, 0).astype(np.int64)
  body = (block.end - block.start).astype(np.int64)
  ctx = block.ctx.astype(np.int64)
  positions = bos + ctx + body + eos + fim_markers - 1
  loss = positions - np.maximum(ctx - 1, 0)
  for k in np.flatnonzero(index.is_chat[block.doc]):
    loss[k] -= chat_masked_targets(index, int(block.doc[k]), int(block.start[k]),
                                   int(block.end[k]), int(ctx[k]), bool(eos[k]))
  prompt = index.pair[block.doc, 0].astype(np.int64)
  pair = prompt > 0  # two segments [BOS] prompt answer [EOS], loss on the answers and EOS
  bos[pair], eos[pair] = 2, 2
  positions[pair] = body[pair] + prompt[pair] + 2
  loss[pair] = body[pair] - prompt[pair] + 2
  return {"body": body, "bos": bos, "eos": eos, "fim_markers": fim_markers, "context": ctx,
          "positions": positions, "loss": loss, "in_word": in_word(index, block),
          "pairs": pair.astype(np.int64), "prompt": 2 * prompt,
          "answer": np.where(pair, body - prompt, 0)}


def in_word(index, block):
  """Per piece, 1 where it ends before its document does at no recorded boundary."""
  doc, end = block.doc.astype(np.int64), block.end.astype(np.int64)
  out = (end < index.length[doc]).astype(np.int64)
  cut = np.flatnonzero(out)
  if not len(cut) or not len(index.bound_pos):
    return out
  end, first = end[cut], index.bound_ptr[doc[cut]].astype(np.int64)
  lo, hi = first.copy(), index.bound_ptr[doc[cut] + 1].astype(np.int64)
  last = len(index.bound_pos) - 1
  while (open_ := lo < hi).any():  # per piece, the first recorded boundary >= its end
    mid = (lo + hi) // 2
    right = open_ & (index.bound_pos[np.minimum(mid, last)] < end)
    lo, hi = np.where(right, mid + 1, lo), np.where(open_ & ~right, mid, hi)
  at = (lo < index.bound_ptr[doc[cut] + 1]) & (index.bound_pos[np.minimum(lo, last)] == end)
  out[cut[at]] = 0
  return out


def chat_masked_targets(index, doc, start, end, ctx, eos):
  """Body targets of a chat piece that fall in no-loss ranges, plus its EOS."""
  first_target = start + (1 if start > 0 and ctx == 0 else 0)
  masked = int(eos)
  for a, b in index.no_loss(doc):
    masked += max(0, min(b, end) - max(a, first_target))
  return masked


def _first_seen(seen, doc, pool, n_src):
  """Per pool, how many of `doc` are not yet marked in the bitmap `seen`; marks them."""
  doc, first = np.unique(doc.astype(np.int64), return_index=True)
  byte, bit = doc >> 3, (1 << (doc & 7)).astype(np.uint8)
  new = (seen[byte] & bit) == 0
  np.bitwise_or.at(seen, byte[new], bit[new])
  return np.bincount(pool[first[new]], minlength=n_src)


def stage_ledger(planner, s):
  """{'rows', 'seq_len', 'positions', 'padding', 'sources': {name: {field: count}}}."""
  index = planner.index
  n_src = len(index.sources)
  sums = {f: np.zeros(n_src, np.int64) for f in FIELDS}
  seen = np.zeros((len(index) + 7) // 8, np.uint8)  # a bit per document: 1/8 byte each
  for b in range(planner.num_blocks(s)):
    block = planner.block(s, b)
    counts = piece_counts(index, block)
    pool = block.pool.astype(np.int64)
    sums["pieces"] += np.bincount(pool, minlength=n_src)
    for field, values in counts.items():
      sums[field] += np.bincount(pool, weights=values, minlength=n_src).astype(np.int64)
    sums["documents"] += _first_seen(seen, block.doc, pool, n_src)
  L = planner.config.stages[s].seq_len
  rows = planner.stage_rows(s)
  sources = {}
  for i, name in enumerate(index.sources):
    if not sums["pieces"][i]:
      continue
    entry = {f: int(sums[f][i]) for f in FIELDS}
    train = planner.pools[i].train_tokens
    entry["exposure"] = round(entry["body"] / train, 6) if train else 0.0
    sources[name] = entry
  used = int(sums["positions"].sum())
  return {"rows": rows, "seq_len": L, "positions": rows * L, "padding": rows * L - used,
          "sources": sources}


def ledger(planner):
  """The ledger of every stage, plus totals over the schedule."""
  stages = [stage_ledger(planner, s) for s in range(len(planner.config.stages))]
  totals = {}
  for st in stages:
    for name, entry in st["sources"].items():
      acc = totals.setdefault(name, {f: 0 for f in entry if f not in ("documents", "exposure")})
      for f in acc:
        acc[f] += entry[f]
  for name, acc in totals.items():
    train = planner.pools[planner.index.sources.index(name)].train_tokens
    acc["exposure"] = round(acc["body"] / train, 6) if train else 0.0
  return {"stages": stages, "totals": totals,
          "padding": sum(st["padding"] for st in stages),
          "positions": sum(st["positions"] for st in stages),
          "not_trained": plan.untrained(planner.config, planner.index.sources)}


def format_table(led, names=None):
  """A human-readable ledger, one line per stage and source."""
  cols = ("pieces", "body", "bos", "eos", "fim_markers", "context", "loss", "documents",
          "in_word", "exposure")
  if any(e.get("pairs") for st in led["stages"] for e in st["sources"].values()):
    cols += PAIR_COLUMNS
  head = f"{'stage':>5} {'L':>6} {'source':<12}" + "".join(f"{c:>12}" for c in cols)
  lines = [head, "-" * len(head)]
  for s, st in enumerate(led["stages"]):
    label = (names or {}).get(s, str(s))
    for name, e in st["sources"].items():
      lines.append(f"{label:>5} {st['seq_len']:>6} {name:<12}" + "".join(
          f"{e[c]:>12.3f}" if c == "exposure" else f"{e[c]:>12,}" for c in cols))
    pad = st["padding"] / st["positions"]
    lines.append(f"{label:>5} {st['seq_len']:>6} {'(padding)':<12}{st['padding']:>12,} "
                 f"positions of {st['positions']:,} ({pad:.2%}) in {st['rows']:,} rows")
  if led.get("not_trained"):
    lines.append(f"warning: {plan.unmixed_line(led['not_trained'])}")
  return "\n".join(lines)

"""Held-out bits per byte across the stages of a run, by the former rule and the current one.

Trains a run through its stages (the demo's by default: L = 128, 256, 1024), stopping after
each evaluation (train.eval_every) to score that checkpoint both ways at its stage's L:
  before  equal rows per source (the former train.eval_rows rule), bits per byte over only the
          documents that fit whole in the rows: which documents count depends on L;
  now     maxlm/eval/bpb.py: the same whole documents per source at every stage (a fixed
          prefix within train.eval_tokens), long ones scored in windows.
It prints per source the tokens and bytes each rule scored, its loss per token and its bits per
byte, and checks the current rule's numbers equal those training logged in metrics.jsonl.

  python tools/bench_eval_strata.py [--config demo] [--workdir /tmp/bench_eval] [--rows 16]
      [--data DIR] [--json] [key=value ...]
"""

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from maxlm.data import chunk, store  # noqa: E402
from maxlm.eval import bpb, windows  # noqa: E402


# The former rule, verbatim from maxlm/eval/bpb.py before every stage scored the same text (only
# `source_order` now lives in maxlm/eval/windows.py, unchanged): equal rows per source,
# documents first-fit packed whole, bits per byte over the documents that fit whole.

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
  orders = [windows.source_order(index, i, split) for i in range(len(index.sources))]
  packed = [pack(index, docs, seq_len, overlap, min_cut, max_rows) for docs in orders]
  quotas = row_quotas([len(rows) for rows, _ in packed], max_rows)
  rows, complete = [], set()
  for docs, (full, done), quota in zip(orders, packed, quotas):
    if quota < len(full):
      full, done = pack(index, docs, seq_len, overlap, min_cut, quota)
    rows += full
    complete.update(done)
  return rows, complete


def score(nll_fn, data, rows, complete, seq_len, batch_rows):
  """`evaluate_table` of given rows of pieces and complete documents; a source's `rows` are
  those holding any of its pieces."""
  index = data.index
  if not rows:
    return {}
  n_src = len(index.sources)
  nll_src, count_src, rows_src = np.zeros(n_src), np.zeros(n_src), np.zeros(n_src, np.int64)
  nll_doc = {}
  for group, batch, nll in bpb.scored_batches(nll_fn, data, rows, seq_len, batch_rows):
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


def score_checkpoint(run_dir, rows_before):
  """{step, stage, seq_len, before, now, seconds} for the run's latest checkpoint."""
  import jax
  from maxlm.train import open_run
  from maxlm.parallel import mesh as mesh_lib
  from maxlm.train import step as step_lib
  config, data, s, mesh, model, params, step, _ = open_run.open_run(run_dir)
  stage = config.stages[s]
  fn = jax.jit(step_lib.make_eval_step(model, config.rules, model.cfg))

  def nll(batch):
    with mesh:
      return jax.device_get(fn(params, mesh_lib.place_batch(batch, mesh, config.rules)))

  d = config.data
  t0 = time.perf_counter()
  rows, complete = heldout_rows(data.index, stage.seq_len, d.overlap, d.min_cut, rows_before)
  before = score(nll, data, rows, complete, stage.seq_len, stage.batch)["sources"]
  t1 = time.perf_counter()
  now = bpb.evaluate_table(nll, data, stage.seq_len, stage.batch, config.train.eval_tokens)
  t2 = time.perf_counter()
  return {"step": step, "stage": s, "seq_len": stage.seq_len, "before": before,
          "now": {n: {k: e[k] for k in ("documents", "tokens", "bytes", "nll", "loss", "bpb")}
                  for n, e in now["sources"].items()},
          "seconds": {"before": round(t1 - t0, 2), "now": round(t2 - t1, 2)}}


def prepare_demo_data(data_dir):
  from maxlm import demo
  from maxlm.data import corpus, prepare
  raw = os.path.join(os.path.dirname(data_dir), "raw")
  if not os.path.exists(os.path.join(raw, "code.jsonl")):
    corpus.build(raw)
  prepare.prepare([os.path.join(raw, "prose.jsonl"), os.path.join(raw, "code.jsonl")], data_dir,
                  prepare.Options(vocab_size=4096, overwrite=True, quality=demo.DEMO_QUALITY,
                                  progress=False))


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("overrides", nargs="*", help="config key=value")
  ap.add_argument("--config", default="demo")
  ap.add_argument("--workdir", default="/tmp/bench_eval_strata")
  ap.add_argument("--data", default=None, help="a prepared data dir (default: the demo's, "
                  "prepared under --workdir)")
  ap.add_argument("--rows", type=int, default=16, help="the former rule's rows (the demo's "
                  "former train.eval_rows)")
  ap.add_argument("--json", action="store_true")
  args = ap.parse_args()
  from maxlm import config as config_lib
  from maxlm.train import loop, metrics
  data_dir = args.data or os.path.join(args.workdir, "data")
  if args.data is None and not os.path.exists(os.path.join(data_dir, "manifest.json")):
    prepare_demo_data(data_dir)
  run_dir = os.path.join(args.workdir, "run")
  cfg = config_lib.load(args.config, [f"data.dir={data_dir}", f"run_dir={run_dir}",
                                      "train.checkpoint_every=100000", *args.overrides])
  every = cfg.train.eval_every
  total = sum(st.num_steps for st in cfg.stages)
  results = []
  while not results or results[-1]["step"] + every <= total:
    loop.train(cfg, stop_after=every, log=lambda *_: None)
    results.append(score_checkpoint(run_dir, args.rows))
  logged = {r["step"]: r for r in metrics.read_jsonl(run_dir) if "val_loss" in r}
  for r in results:  # training logged the same numbers at the step before the checkpoint
    row = logged[r["step"] - 1]
    for name, e in r["now"].items():
      assert (row[f"val_tokens/{name}"], row[f"val_bytes/{name}"]) == (e["tokens"], e["bytes"])
      assert math.isclose(row[f"val_bpb/{name}"], e["bpb"], rel_tol=1e-6), (row, e)
  out = {"config": args.config, "eval_tokens": cfg.train.eval_tokens, "rows_before": args.rows,
         "checkpoints": results}
  if args.json:
    from maxlm.eval import bpb
    print(json.dumps(bpb.jsonable(out)))
    return
  _print(out)


def _print(out):
  print(f"{out['config']}: former rule {out['rows_before']} rows in all; now "
        f"train.eval_tokens={out['eval_tokens']:,} per source")
  names = sorted(out["checkpoints"][0]["now"])
  print(f"{'step':>5} {'L':>5} {'source':<7}| {'before: tokens':>14} {'bytes':>7} {'loss':>7} "
        f"{'bpb':>6} | {'now: tokens':>11} {'bytes':>7} {'loss':>7} {'bpb':>6}")
  for r in out["checkpoints"]:
    for name in names:
      b, n = r["before"][name], r["now"][name]
      print(f"{r['step']:>5} {r['seq_len']:>5} {name:<7}| {b['tokens']:>14,} {b['bytes']:>7,} "
            f"{b['loss']:>7.4f} {b['bpb']:>6.3f} | {n['tokens']:>11,} "
            f"{n['bytes']:>7,} {n['loss']:>7.4f} {n['bpb']:>6.3f}")
    print(f"{'':>12} eval seconds: before {r['seconds']['before']}, now {r['seconds']['now']}")


if __name__ == "__main__":
  main()

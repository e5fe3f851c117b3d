"""Held-out evaluation of a run's latest checkpoint: the rows in index order (the rule before
stratified evaluation: documents first-fit packed in index order, so the first source fills
every row) side by side with equal rows per source (maxlm/eval/bpb.py), and the training
loss of the run's last steps for comparison.

  python tools/bench_eval_strata.py runs/demo [--rows 16] [--json]
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402


def index_order_rows(index, seq_len, overlap, min_cut, max_rows):
  """The former rule: every held-out document in index order into at most max_rows rows."""
  from maxlm.data import chunk, store
  rows, space, complete = [], [], set()
  for doc in np.flatnonzero(index.split == store.VAL).tolist():
    n = int(index.length[doc])
    pos, lvl = index.bounds(doc)
    placed = True
    for a, b, ctx in chunk.cut(n, 0, n, pos, lvl, seq_len + 1, overlap, min_cut):
      size = chunk.positions(int(a == 0), ctx, b - a, int(b == n), 0)
      slot = next((i for i, free in enumerate(space) if free >= size), None)
      if slot is None:
        if len(rows) >= max_rows:
          placed = False
          break
        rows.append([])
        space.append(seq_len)
        slot = len(rows) - 1
      rows[slot].append((int(index.source[doc]), doc, a, b, ctx, 0))
      space[slot] -= size
    if placed:
      complete.add(doc)
  return rows, complete


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("run_dir")
  ap.add_argument("--rows", type=int, default=None, help="default: the run's train.eval_rows")
  ap.add_argument("--last", type=int, default=10, help="training steps averaged")
  ap.add_argument("--json", action="store_true")
  args = ap.parse_args()
  import jax
  from maxlm.eval import bpb, run
  from maxlm.parallel import mesh as mesh_lib
  from maxlm.train import metrics, step as step_lib
  config, data, s, mesh, model, params, step = run.open_run(args.run_dir)
  stage = config.stages[s]
  fn = jax.jit(step_lib.make_eval_step(model, config.rules, model.cfg))

  def nll(batch):
    with mesh:
      return jax.device_get(fn(params, mesh_lib.place_batch(batch, mesh, config.rules)))

  n = args.rows or config.train.eval_rows
  d = config.data
  old = bpb.score(nll, data, *index_order_rows(data.index, stage.seq_len, d.overlap, d.min_cut,
                                               n), stage.seq_len, stage.batch)
  new = bpb.evaluate_table(nll, data, stage.seq_len, stage.batch, n)
  rows = [r for r in metrics.read_jsonl(args.run_dir) if "loss" in r and r["step"] < step]
  last = {r["step"]: r for r in rows}
  tail = [last[k] for k in sorted(last)[-args.last:]]
  train = {"steps": [tail[0]["step"], tail[-1]["step"]],
           "loss": float(np.mean([r["loss"] for r in tail]))}
  out = {"run_dir": args.run_dir, "checkpoint": step, "stage": s, "rows": n,
         "train_loss_last_steps": train, "index_order": old, "equal_rows_per_source": new}
  if args.json:
    print(json.dumps(bpb.jsonable(out)))
    return
  print(f"{args.run_dir} checkpoint {step} (stage {s}, L={stage.seq_len}), {n} rows; train loss "
        f"over steps {train['steps'][0]}..{train['steps'][1]}: {train['loss']:.4f}")
  for title, table in (("index order (before)", old), ("equal rows per source (now)", new)):
    print(f"  {title}")
    for name, e in [*table["sources"].items(), ("all", table["all"])]:
      print(f"    {name:<10}{e['rows']:>5} rows {e['tokens']:>7,} tokens {e['bytes']:>9,} bytes "
            f"loss {e['loss']:.4f} bpb {e['bpb']:.4f}")


if __name__ == "__main__":
  main()

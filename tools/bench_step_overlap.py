"""The train loop with and without its one-step lookahead (`loop.train(..., lookahead=False)`, maxlm/train/planned.py): step
k+1 queued, its batch placed, before step k's metrics are read; side by side in one process.

`maxlm train` on the demo corpus (prepared here, in a temporary folder), one stage of the demo
model; both modes share the compiled step (a warm-up run compiles it first; every run uses the same
run_dir, emptied before it) and alternate, so machine noise hits both. Throughput is wall clock between the first and the last step's
progress line (what a user waits for), in positions per second.

  python tools/bench_step_overlap.py [--json] [--seq-len 256] [--batch 8] [--steps 30]
      [--repeats 5]
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

from maxlm import config as config_lib
from maxlm.data import corpus, prepare
from maxlm.train import loop


def run(base, data_dir, args, lookahead):
  cfg = config_lib.from_dict({
      "seed": 0, "run_dir": os.path.join(base, "run"), "data": {"dir": data_dir},
      "stages": [{"seq_len": args.seq_len, "batch": args.batch, "steps": args.steps,
                  "block_q": 128, "block_k": 128}],
      "model": {"size": "demo", "dtype": "float32", "remat": "none", "loss_chunk": 256},
      "train": {"checkpoint_every": 10 ** 6, "eval_every": 0, "async_checkpoints": False}})
  stamps = []

  def log(line):
    if " step " in line and line.startswith("stage "):
      stamps.append(time.perf_counter())

  shutil.rmtree(cfg.run_dir, ignore_errors=True)  # one run_dir: every run reuses the compiled step
  loop.train(cfg, log=log, lookahead=lookahead)
  steps = len(stamps) - 1
  return steps * args.seq_len * args.batch / (stamps[-1] - stamps[0])


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--seq-len", type=int, default=256)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--steps", type=int, default=30)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--json", action="store_true")
  args = ap.parse_args(argv)
  with tempfile.TemporaryDirectory() as base:
    raw = corpus.build(os.path.join(base, "raw"), bytes_per_source=400_000)
    data_dir = os.path.join(base, "data")
    prepare.prepare(raw, data_dir, prepare.Options(vocab_size=1024, progress=False))
    run(base, data_dir, args, True)  # compiles the step
    before, after = [], []
    for _ in range(args.repeats):
      before.append(run(base, data_dir, args, False))
      after.append(run(base, data_dir, args, True))
  out = {"seq_len": args.seq_len, "batch": args.batch, "steps": args.steps,
         "positions_per_s_without_lookahead": [round(x) for x in before],
         "positions_per_s_with_lookahead": [round(x) for x in after],
         "speedup_median": round(sorted(a / b for a, b in zip(after, before))[len(after) // 2],
                                 3)}
  print(json.dumps(out) if args.json else json.dumps(out, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""`maxlm memory`'s estimate held to the TPU and GPU compilers: for each case (remat policy,
fsdp, tensor, context, expert, sparse stages, MoE, loss_chunk, grad_accum, dpo) a stage of the
150M config is compiled for --target on this CPU machine (maxlm/compile/: libtpu's XLA:TPU for
a v5e slice by default, or the CUDA plugin's XLA:GPU, e.g. --target gpu:h200:1x1x8), and the
estimate (maxlm/train/memory.py, the target's platform) is printed beside the compiler's bytes a
device, with their ratio. Needs the aot extra.

  python tools/bench_compile_memory.py [--json] [--cases NAME,...] [--target tpu:v5e:2x4]
  python tools/bench_compile_memory.py --fit RESULTS.json   # refit memory.FIT for that target

`--fit` reads a `--json` run and searches the platform's `memory.FIT` (the bytes an element of
the backward pass's live set, and the logits chunk's copies) for the most cases within 25%,
then the smallest worst ratio; it prints the fit and each case's ratio under it.
"""

import argparse
import math
import json
import os
import sys
import time

from maxlm import config as config_lib
from maxlm.compile import stage as compile_stage, target as target_lib
from maxlm.train import memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "tpu_v5e8_150m.yaml")
MESH = lambda data, fsdp, tensor=1, context=1, expert=1: [
    f"stages.0.mesh.{k}={v}" for k, v in (("data", data), ("fsdp", fsdp), ("tensor", tensor),
                                          ("context", context), ("expert", expert))]
SHORT = ["stages.0.batch=64"]  # 128K tokens a step: the cases compile in a minute or less
MOE = ["model.moe.experts=8", "model.moe.top_k=2", "model.moe.d_ff=1024",
       "model.moe.shared_experts=1"]
SPARSE = ["stages.0.seq_len=8192", "stages.0.batch=8", "stages.0.sparse.topk=1024",
          "stages.0.sparse.block=128"]
CASES = {
    "shipped/full": [],
    "full/short": SHORT,
    "none/short": [*SHORT, "model.remat=none"],
    "dots/short": [*SHORT, "model.remat=dots"],
    "fsdp4-tensor2": [*SHORT, *MESH(1, 4, tensor=2)],
    "data2-fsdp4": [*SHORT, *MESH(2, 4)],
    "context2": [*SHORT, *MESH(1, 4, context=2), "stages.0.attention=blockwise"],
    "loss_chunk2048": [*SHORT, "model.loss_chunk=2048"],
    "grad_accum4": ["train.grad_accum=4"],
    "dpo": [*SHORT, "stages.0.objective=dpo", "init.from=runs/sft"],
    "moe": [*SHORT, *MOE],
    "moe-expert2": [*SHORT, *MOE, *MESH(1, 4, expert=2)],
    "indexer_warmup": [*SPARSE, "stages.0.sparse.mode=indexer_warmup"],
    "sparse": [*SPARSE, "stages.0.sparse.mode=sparse"],
    "window1024": [*SHORT, "stages.0.seq_len=8192", "stages.0.batch=16",
                   "model.attention.window=1024", "model.attention.global_every=2"],
}


def measure(name, overrides, devices, target):
  cfg = config_lib.load(CONFIG, overrides)
  vocab = cfg.model.vocab_size
  t0 = time.perf_counter()
  out = compile_stage.compile_stage(cfg, 0, vocab, devices, target.platform)
  est = memory.estimate(cfg, 0, len(devices), vocab, target.platform)
  return {"case": name, "compiled_gib": out["compiled"]["total"] / 2**30,
          "estimate_gib": est["total"] / 2**30,
          "ratio": est["total"] / out["compiled"]["total"],
          "temporaries_gib": out["compiled"]["temporaries"] / 2**30,
          "arguments_gib": out["compiled"]["arguments"] / 2**30,
          "estimate_parts_gib": {k: round(v / 2**30, 3) for k, v in est.items()},
          "attention": out["attention"], "seconds": round(time.perf_counter() - t0, 1)}


def fit(results):
  """(memory.Fit, {case: ratio}) that puts the most of `results`' cases within 25%."""
  platform = target_lib.parse(results["target"]).platform
  configs = {r["case"]: config_lib.load(CONFIG, CASES[r["case"]]) for r in results["cases"]}
  compiled = {r["case"]: r["compiled_gib"] * 2**30 for r in results["cases"]}
  best, shipped = None, memory.FIT[platform]
  try:
    for working_bytes in [b / 4 for b in range(4, 21)]:
      for copies in (1, 1.5, 2, 2.5, 3):
        memory.FIT[platform] = memory.Fit(working_bytes, copies)
        ratios = {name: memory.estimate(cfg, 0, results["devices"], cfg.model.vocab_size,
                                        platform)["total"] / compiled[name]
                  for name, cfg in configs.items()}
        score = (-sum(0.75 <= r <= 1.25 for r in ratios.values()),
                 max(abs(math.log(r)) for r in ratios.values()))
        if best is None or score < best[0]:
          best = (score, memory.FIT[platform], ratios)
  finally:
    memory.FIT[platform] = shipped  # the search leaves the module as it found it
  return best[1], best[2]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--cases", help="comma-separated case names (default: all)")
  ap.add_argument("--target", default="tpu:v5e:2x4")
  ap.add_argument("--json", action="store_true")
  ap.add_argument("--fit", metavar="RESULTS", help="refit memory.FIT from a --json run")
  args = ap.parse_args(argv)
  if args.fit:
    with open(args.fit) as f:
      found, ratios = fit(json.load(f))
    print(f"{found}: {sum(0.75 <= r <= 1.25 for r in ratios.values())} of {len(ratios)} "
          "within 25%")
    for name, r in ratios.items():
      print(f"  {name:<16} {r:.2f}")
    return 0
  names = args.cases.split(",") if args.cases else list(CASES)
  target = target_lib.parse(args.target)
  devices = target_lib.devices(target)
  rows = []
  for name in names:
    try:
      row = measure(name, CASES[name], devices, target)
    except Exception as e:  # noqa: BLE001 (one case's failure is its row, not the run's end)
      row = {"case": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
      print(f"{name:<16} failed: {row['error']}", file=sys.stderr, flush=True)
      continue
    rows.append(row)
    print(f"{name:<16} compiler {row['compiled_gib']:7.3f} GiB  estimate "
          f"{row['estimate_gib']:7.3f} GiB  ratio {row['ratio']:.2f}  ({row['attention']}, "
          f"{row['seconds']:.0f} s)", file=sys.stderr if args.json else sys.stdout, flush=True)
  worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
  summary = {"target": target.name, "devices": len(devices), "cases": rows,
             "worst_ratio": worst["ratio"],
             "within_25": sum(0.75 <= r["ratio"] <= 1.25 for r in rows)}
  print(json.dumps(summary) if args.json else
        f"{summary['within_25']} of {len(rows)} within 25%; worst {worst['case']} "
        f"{worst['ratio']:.2f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

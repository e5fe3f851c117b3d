"""Local vs global attention on CPU: forward+backward of one attention layer, `blockwise` impl.

  local (model.attention.window = W, 1024 by default) and global (window 0) side by side at
  L = 16K, 32K, 64K, each case in its own process (its peak RSS is its own), plus the tiles
  (query block x key block) each computes, counted from the plan the loops run.

One row holding one document (a local layer's worst case: no document boundary to skip at), 4
query heads, 2 KV heads, head_dim 64, f32, tiles of 512. Times exclude compilation (compiled
ahead of time); the global 64K case runs once (minutes), the others take the best of two.

  python tools/bench_local_attention.py [--json] [--lengths 16384 32768 65536] [--window 1024]
"""

import argparse
import json
import resource
import subprocess
import sys
import time

HEADS, KV_HEADS, DIM = 4, 2, 64


def run_case(length, window, block, repeats):
  import jax
  import jax.numpy as jnp
  import numpy as np
  from maxlm.model.attention import attention, blockwise

  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(1, length, HEADS, DIM)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(1, length, KV_HEADS, DIM)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(1, length, KV_HEADS, DIM)), jnp.float32)
  seg = jnp.ones((1, length), jnp.int32)
  step = jax.jit(jax.grad(lambda q, k, v: attention(
      q, k, v, seg, impl="blockwise", block_q=block, block_k=block, window=window).sum(),
      argnums=(0, 1, 2))).lower(q, k, v).compile()  # compiled ahead: no untimed warm-up run
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(step(q, k, v))
    times.append(time.perf_counter() - t)
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB
  tiles = blockwise.tile_count(seg, seg, block_q=block, block_k=block, window=window)
  return {"seconds": round(min(times), 3), "tiles": tiles, "peak_rss_gib": round(peak, 3)}


def case(length, window, block, repeats):
  proc = subprocess.run([sys.executable, __file__, "--case", str(length), str(window),
                         str(block), str(repeats)], capture_output=True, text=True)
  if proc.returncode:
    return {"error": (proc.stderr.strip().splitlines() or ["killed"])[-1][:200]}
  return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--json", action="store_true", help="print one JSON object")
  ap.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768, 65536])
  ap.add_argument("--window", type=int, default=1024)
  ap.add_argument("--block", type=int, default=512)
  ap.add_argument("--case", nargs=4, type=int, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.case:
    print(json.dumps(run_case(*args.case)))
    return 0
  cases, ratios = {}, {}
  longest = max(args.lengths)
  for length in args.lengths:
    local = case(length, args.window, args.block, 2)
    glob = case(length, 0, args.block, 1 if length == longest and length >= 65536 else 2)
    cases[f"local_{length}"], cases[f"global_{length}"] = local, glob
    if "seconds" in local and "seconds" in glob:
      ratios[str(length)] = {"seconds": round(local["seconds"] / glob["seconds"], 4),
                             "tiles": round(local["tiles"] / glob["tiles"], 4)}
  out = {"window": args.window, "block": args.block, "heads": HEADS, "kv_heads": KV_HEADS,
         "head_dim": DIM, "cases": cases, "local_over_global": ratios}
  if args.json:
    print(json.dumps(out, indent=1))
  else:
    for name, r in cases.items():
      print(f"{name:>14}: {r}")
    for length, r in ratios.items():
      print(f"local / global at L={length}: {r['seconds']} of the time, {r['tiles']} of the tiles")
  return 0


if __name__ == "__main__":
  sys.exit(main())

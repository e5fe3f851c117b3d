"""Attention benchmark on CPU: forward+backward time and peak memory, each case in its own process.

  blockwise vs reference at L = 2048, 8192 (and 32768 where reference fits in memory);
  blockwise alone at L = 65536;
  the skip gain: a 32768-token row of 32 documents of 1024 vs one 32768-token document.

One batch row, 4 query heads, 2 KV heads, head_dim 64, f32. Times exclude compilation.

  python tools/bench_attention.py [--json] [--quick]
"""

import argparse
import json
import resource
import subprocess
import sys
import time

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 64, 512


def run_case(impl, length, docs, repeats):
  import jax
  import jax.numpy as jnp
  import numpy as np
  from maxlm.model.attention import attention

  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(1, length, HEADS, DIM)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(1, length, KV_HEADS, DIM)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(1, length, KV_HEADS, DIM)), jnp.float32)
  seg = jnp.asarray((np.arange(length) // (length // docs) + 1)[None], jnp.int32)
  step = jax.jit(jax.grad(lambda q, k, v: attention(q, k, v, seg, impl=impl, block_q=BLOCK,
                                                    block_k=BLOCK).sum(), argnums=(0, 1, 2)))
  jax.block_until_ready(step(q, k, v))
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(step(q, k, v))
    times.append(time.perf_counter() - t)
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB
  return {"seconds": min(times), "peak_rss_gib": round(peak, 3)}


def case(impl, length, docs=1, repeats=2):
  proc = subprocess.run([sys.executable, __file__, "--case", impl, str(length), str(docs),
                         str(repeats)], capture_output=True, text=True)
  if proc.returncode:
    return {"error": (proc.stderr.strip().splitlines() or ["killed"])[-1][:200]}
  return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--json", action="store_true")
  ap.add_argument("--quick", action="store_true", help="skip the 32768/65536 cases")
  ap.add_argument("--case", nargs=4, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.case:
    impl, length, docs, repeats = args.case
    print(json.dumps(run_case(impl, int(length), int(docs), int(repeats))))
    return 0
  results = {}
  lengths = (2048, 8192) if args.quick else (2048, 8192, 32768)
  for length in lengths:
    results[f"blockwise_{length}"] = case("blockwise", length, repeats=2 if length < 32768 else 1)
    if length <= 8192:  # dense [H, L, L] logits and their gradient: ~20 GiB at 32768
      results[f"reference_{length}"] = case("reference", length)
  if not args.quick:
    results["blockwise_65536"] = case("blockwise", 65536, repeats=1)
    results["blockwise_32768_32docs"] = case("blockwise", 32768, docs=32, repeats=2)
  out = {"cases": results}
  ref, blk = results["reference_8192"], results["blockwise_8192"]
  if "seconds" in ref and "seconds" in blk:
    out["blockwise_over_reference_8192"] = round(blk["seconds"] / ref["seconds"], 4)
  if not args.quick:
    one, many = results["blockwise_32768"], results["blockwise_32768_32docs"]
    out["skip_speedup_32docs"] = round(one["seconds"] / many["seconds"], 2)
  for name, r in results.items():
    out[f"peak_rss_gib_{name}"] = r.get("peak_rss_gib")
  if args.json:
    print(json.dumps(out))
  else:
    for name, r in results.items():
      print(f"{name:>26}: {r}")
    for k, v in out.items():
      if k != "cases" and not k.startswith("peak_rss"):
        print(f"{k:>26}: {v}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

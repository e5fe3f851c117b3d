"""The CPU side of `attention=auto` (maxlm/model/auto_rule.py): forward+backward time
of `reference` vs `blockwise` by length and documents per row, side by side in one run, and the
longest length at which reference still wins (CPU_REFERENCE_MAX_LEN).

8 rows, 4 query heads, 2 KV heads, head_dim 64, f32, blockwise tiles of 128 (the CPU configs').

  python tools/bench_auto_rule.py [--json] [--lengths 128,256,512,1024] [--repeats 5]
"""

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from maxlm.model.attention import attention

BATCH, HEADS, KV_HEADS, DIM, BLOCK = 8, 4, 2, 64, 128


def timed(impl, length, docs, repeats):
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(BATCH, length, HEADS, DIM)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(BATCH, length, KV_HEADS, DIM)), jnp.float32)
          for _ in range(2))
  seg = jnp.asarray(np.broadcast_to(np.arange(length) * docs // length + 1, (BATCH, length)),
                    jnp.int32)
  f = jax.jit(jax.grad(lambda q, k, v: attention(q, k, v, seg, impl=impl, block_q=BLOCK,
                                                 block_k=BLOCK).sum(), argnums=(0, 1, 2)))
  jax.block_until_ready(f(q, k, v))
  best = float("inf")
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(f(q, k, v))
    best = min(best, time.perf_counter() - t)
  return best


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--json", action="store_true")
  ap.add_argument("--lengths", default="128,256,512,1024")
  ap.add_argument("--repeats", type=int, default=5)
  args = ap.parse_args(argv)
  cases, wins = {}, []
  for length in map(int, args.lengths.split(",")):
    for docs in (1, max(1, length // 64)):
      r, b = (timed(i, length, docs, args.repeats) for i in ("reference", "blockwise"))
      cases[f"{length}_{docs}docs"] = {"reference_s": round(r, 5), "blockwise_s": round(b, 5),
                                       "blockwise_over_reference": round(b / r, 3)}
      if r < b:
        wins.append(length)
  lengths = sorted({int(name.split("_")[0]) for name in cases})
  won_all = [n for n in lengths if all(cases[c]["blockwise_over_reference"] > 1
                                       for c in cases if c.startswith(f"{n}_"))]
  out = {"cases": cases, "reference_wins_at": sorted(set(wins)),
         "cpu_reference_max_len": max([n for n in won_all if n <= min(
             [m for m in lengths if m not in won_all] or [1 << 30])] or [0])}
  print(json.dumps(out) if args.json else json.dumps(out, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""The prepared device check for mixture-of-experts (issue 26), for when a GPU or TPU is lent:

  1. the routed experts, forward + backward: `experts_grouped` (grouped matmul over tokens sorted
     by expert: the backend's impl from maxlm/model/grouped.py - megablox on TPU, ragged_dot on
     GPU - and ragged_dot) against `experts_loop` (every expert run densely on every token, then
     masked: the reference), with their max difference;
  2. expert-parallel dispatch: `experts_sharded` (maxlm/model/expert_parallel.py) with the
     experts split over all devices against `experts_grouped` on the same devices, and the padded
     all_to_all alone (its bytes and time). With one device the expert axis is 1 and part 2 times the
     dispatch's sort / scatter / gather overhead only (the all_to_all is local).

Times are the fastest of `--repeats` runs after one warm-up (compile excluded), in ms. Prints one
JSON object (also written to --json) with jax versions and the device.

  PYTHONPATH=. python tools/gpu_moe_check.py [--json OUT.json] [--dry-run]
  (bash tools/gpu_moe_check.sh [OUT_DIR] [--dry-run] runs it; --dry-run: tiny sizes, f32, on 8
  fake CPU devices, what tests/test_model_expert_parallel.py runs)
"""

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from maxlm import config as config_lib
from maxlm.model import expert_parallel, experts, grouped
from maxlm.parallel import mesh as mesh_lib

# Qwen3-30B-A3B-like expert shapes (d_model 2048, expert width 768, top-8), 64 experts to keep
# the unrolled reference loop's compile short; 8192 tokens per device
FULL = dict(tokens=8192, d=2048, f=768, experts=64, k=8, dtype="bfloat16", repeats=5)
DRY = dict(tokens=64, d=32, f=16, experts=8, k=2, dtype="float32", repeats=1)


def versions():
  import jaxlib  # pylint: disable=import-outside-toplevel
  return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "backend": jax.default_backend(),
          "device": jax.devices()[0].device_kind, "devices": jax.device_count()}


def inputs(tokens, d, f, experts, k, dtype, seed=0):
  """Real-shaped random routing: top-k of random logits (no expert repeated per token)."""
  rng = np.random.default_rng(seed)
  dt = jnp.dtype(dtype)
  x_TxD = jnp.asarray(rng.normal(size=(tokens, d)), dt)
  logits_TxE = rng.normal(size=(tokens, experts))
  expert_TxK = jnp.asarray(np.argsort(-logits_TxE, axis=1)[:, :k], jnp.int32)
  weight_TxK = jnp.asarray(rng.uniform(size=(tokens, k)), jnp.float32)
  gate_up = jnp.asarray(rng.normal(size=(experts, d, 2, f)) * d ** -0.5, jnp.float32)
  down = jnp.asarray(rng.normal(size=(experts, f, d)) * f ** -0.5, jnp.float32)
  return x_TxD, expert_TxK, weight_TxK, gate_up, down


def fwd_bwd(experts_fn, expert_TxK):
  """jit of (y, d sum(y) / d (x, gate_up, down))."""
  def loss(x, w, gu, dn):
    y = experts_fn(x, expert_TxK, w, gu, dn, 0)
    return jnp.sum(y.astype(jnp.float32)), y
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 2, 3), has_aux=True))


def best_ms(fn, args, repeats):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return round(1e3 * min(times), 3)


def max_diff(a, b):
  return float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))


def part_grouped(sizes, repeats):
  x, e, w, gu, dn = inputs(**sizes)
  impls = list(dict.fromkeys([grouped.default_impl(), "ragged_dot"]))  # the backend's, ragged_dot
  out, results = {}, {}
  for impl in impls:
    fn = fwd_bwd(functools.partial(experts.experts_grouped, impl=impl), e)
    out[f"grouped_{impl}_ms"] = best_ms(fn, (x, w, gu, dn), repeats)
    results[impl] = fn(x, w, gu, dn)[0][1]
  loop = fwd_bwd(experts.experts_loop, e)
  out["loop_ms"] = best_ms(loop, (x, w, gu, dn), repeats)
  y_loop = loop(x, w, gu, dn)[0][1]
  for impl, y in results.items():
    out[f"loop_over_grouped_{impl}"] = round(out["loop_ms"] / out[f"grouped_{impl}_ms"], 2)
    out[f"grouped_{impl}_vs_loop_max_abs_diff"] = max_diff(y, y_loop)
  return out


def part_dispatch(sizes, repeats):
  n = jax.device_count()
  mesh = mesh_lib.make_mesh(config_lib.MeshConfig(data=1, expert=n))
  per_device = dict(sizes, tokens=sizes["tokens"] * n)  # the same tokens per device as part 1
  x, e, w, gu, dn = inputs(**per_device)
  sharded = fwd_bwd(functools.partial(expert_parallel.experts_sharded, mesh=mesh), e)
  grouped = fwd_bwd(experts.experts_grouped, e)
  out = {"expert_axis": n, "sharded_ms": best_ms(sharded, (x, w, gu, dn), repeats),
         "grouped_one_program_ms": best_ms(grouped, (x, w, gu, dn), repeats)}
  out["sharded_vs_grouped_max_abs_diff"] = max_diff(sharded(x, w, gu, dn)[0][1],
                                                   grouped(x, w, gu, dn)[0][1])
  slots = sizes["tokens"] * sizes["k"]  # one device's buffer: [n, slots, d] (the worst case)
  buffer = jnp.zeros((n * n, slots, sizes["d"]), jnp.dtype(sizes["dtype"]))
  exchange = jax.jit(jax.shard_map(
      lambda b: jax.lax.all_to_all(b, "expert", 0, 0, tiled=True), mesh=mesh,
      in_specs=P("expert"), out_specs=P("expert")))
  out["all_to_all_ms"] = best_ms(exchange, (buffer,), repeats)
  out["all_to_all_bytes_per_device"] = int(buffer.nbytes // n)
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--json", default="")
  parser.add_argument("--dry-run", action="store_true", help="tiny sizes, f32 (CPU)")
  args = parser.parse_args(argv)
  sizes = dict(DRY if args.dry_run else FULL)
  repeats = sizes.pop("repeats")
  report = {**versions(), "sizes": sizes, "dry_run": args.dry_run}
  report["grouped"] = part_grouped(sizes, repeats)
  report["dispatch"] = part_dispatch(sizes, repeats)
  text = json.dumps(report, indent=1)
  print(text)
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  main()

"""The prepared GPU check for the segment-skipping kernels (issue 17), one H200, ~8 minutes:

  1. correctness of `gpu` (the new Triton kernel) against `reference` on the GPU (f32, bf16);
  2. attention forward+backward at L = 4K, 16K, 64K with 1 and 32 documents per row: `gpu` (new)
     vs `gpu_mha` (jax's Triton mha, the old path) vs `blockwise`; the fastest per case and the
     value of auto_rule.GPU_BLOCKWISE_FROM it implies;
  3. the `1b` model at L = 4096: step time, tokens/s, MFU (against the device's bf16 peak in
     maxlm/parallel/peaks.py: 989.4 TFLOP/s dense on an H200);
  4. the 1M-token stage of a small model (128 documents of 8192 per row): s/step with `gpu`;
  5. the train loop with and without its one-step lookahead (tools/bench_step_overlap.py).

Prints one JSON object after each part (a timeout still leaves the parts done) with jax, jaxlib
and CUDA versions. `--dry-run` runs the same code on CPU at tiny shapes (Pallas interpret mode).

  PYTHONPATH=. python tools/gpu_kernels_check.py [--json OUT.json] [--dry-run] [--parts 1,2,3,4,5]
      [--tiles-only]
  (bash tools/gpu_kernels_check.sh runs it on the GPU)
"""

import argparse
import contextlib
import io
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_train  # noqa: E402

from maxlm.model.attention import attention, reference, triton_segments  # noqa: E402

HEADS, KV_HEADS, DIM = 16, 4, 128


def versions():
  import jax.extend as je
  import jaxlib
  backend = je.backend.get_backend()
  return {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
          "platform_version": backend.platform_version, "device": jax.devices()[0].device_kind,
          "backend": jax.default_backend()}


def inputs(length, dtype, docs, batch=1, seed=0, heads=HEADS, kv_heads=KV_HEADS, dim=DIM):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(batch, length, heads, dim)), dtype)
  k = jnp.asarray(rng.normal(size=(batch, length, kv_heads, dim)), dtype)
  v = jnp.asarray(rng.normal(size=(batch, length, kv_heads, dim)), dtype)
  seg = (np.arange(length) * docs // length + 1)[None].repeat(batch, 0).astype(np.int32)
  seg[:, -(length // 7):] = 0  # some padding at the end
  return q, k, v, jnp.asarray(seg)


def grad_fn(impl, seg, **kw):
  fn = (lambda q, k, v: reference.attention(q, k, v, seg, seg)[0]) if impl == "reference" else (
      lambda q, k, v: attention(q, k, v, seg, impl=impl, **kw))

  def loss(q, k, v):
    out = fn(q, k, v).astype(jnp.float32)
    return (out * jnp.cos(jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape))).sum()
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def correctness(length, dims):
  out = {}
  for dtype in (jnp.float32, jnp.bfloat16):
    q, k, v, seg = inputs(length, dtype, docs=5, batch=2, **dims)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    _, want = grad_fn("reference", seg)(*f32)
    for impl in ("gpu", "gpu_mha", "blockwise"):
      _, got = grad_fn(impl, seg, block_q=64 if "gpu" in impl else 256, block_k=256)(q, k, v)
      out[f"{impl}_{jnp.dtype(dtype).name}"] = max(
          float(jnp.abs(g.astype(jnp.float32) - w).max() / jnp.abs(w).max())
          for g, w in zip(got, want))
  return out


def timed(impl, length, docs, dims, repeats=3, **kw):
  q, k, v, seg = inputs(length, jnp.bfloat16, docs, **dims)
  f = grad_fn(impl, seg, **kw)
  jax.block_until_ready(f(q, k, v))
  best = float("inf")
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(f(q, k, v))
    best = min(best, time.perf_counter() - t)
  return best


def tiles(length, docs, block):
  """Tiles the new kernel's forward computes per head, and jax's mha (every causal tile)."""
  _, _, _, seg = inputs(length, jnp.float32, docs, heads=1, kv_heads=1, dim=1)
  n = length // block
  return {"tiles_gpu": triton_segments.block_count(seg, block, block),
          "tiles_gpu_mha": n * (n + 1) // 2}


def kernels(lengths, dims, gpu_block, blockwise_block, tiles_only=False):
  cases, slower = {}, []
  for length in lengths:
    for docs in (1, 32):
      row = tiles(length, docs, gpu_block)
      cases[f"{length}_{docs}docs"] = row
      if tiles_only:
        continue
      for impl, kw in (("gpu", {"block_q": gpu_block}), ("gpu_mha", {"block_q": gpu_block}),
                       ("blockwise", {"block_q": blockwise_block, "block_k": blockwise_block})):
        try:
          row[impl] = round(timed(impl, length, docs, dims, **kw), 5)
        except Exception as e:  # noqa: BLE001 (a kernel that fails to lower is a result too)
          row[impl] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
      ok = {k: v for k, v in row.items() if isinstance(v, float)}
      if ok:
        row["fastest"] = min(ok, key=ok.get)
      if "gpu" in ok and "gpu_mha" in ok:
        row["gpu_mha_over_gpu"] = round(ok["gpu_mha"] / ok["gpu"], 2)
      if "gpu" in ok and "blockwise" in ok:
        row["blockwise_over_gpu"] = round(ok["blockwise"] / ok["gpu"], 2)
        if ok["blockwise"] < ok["gpu"]:
          slower.append((length, docs))
  rule = min(slower) if slower else None
  return cases, {"GPU_BLOCKWISE_FROM": rule,
                 "note": "the smallest (length, documents) where blockwise beat gpu; None: never"}


def train(args, overrides):
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    bench_train.main(["--json", *args, *overrides])
  return json.loads(out.getvalue().strip().splitlines()[-1])


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--json")
  ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (interpret mode)")
  ap.add_argument("--parts", default="1,2,3,4,5")
  ap.add_argument("--tiles-only", action="store_true",
                  help="part 2's tile counts at the real shapes, no timing (runs on a CPU)")
  args = ap.parse_args(argv)
  parts = {int(p) for p in args.parts.split(",")}
  dry = args.dry_run
  result = {"versions": versions(), "dry_run": dry}

  def emit():
    print(json.dumps(result), flush=True)
    if args.json:
      with open(args.json, "w") as f:
        json.dump(result, f, indent=1)

  dims = {"heads": 2, "kv_heads": 1, "dim": 32} if dry else {}
  if 1 in parts:
    result["max_rel_grad_err"] = {str(n): correctness(n, dims) for n in
                                  ((256,) if dry else (1024, 1000))}
    emit()
  if 2 in parts:
    lengths = (256, 512) if dry else (4096, 16384, 65536)
    cases, rule = kernels(lengths, dims, 64 if dry else 128, 128 if dry else 512,
                          args.tiles_only)
    result["fwd_bwd_s"] = cases
    if not args.tiles_only:
      result["auto_rule"] = rule
    emit()
  if 3 in parts:
    if dry:
      a = ["--config", "configs/demo.yaml", "--seq-len", "256", "--batch", "2", "--steps", "2",
           "--vocab", "1024"]
      o = ["stages.0.attention=gpu", "stages.0.block_q=64", "model.dtype=float32"]
    else:
      a = ["--config", "configs/demo.yaml", "--seq-len", "4096", "--batch", "8", "--steps",
           "12", "--vocab", "128256"]
      o = ["model.size=1b", "model.dtype=bfloat16", "model.remat=dots_no_batch",
           "model.loss_chunk=4096", "stages.0.attention=gpu", "stages.0.block_q=128"]
    r = train(a, o)
    result["train_1b_4k"] = r
    emit()
  if 4 in parts:
    length = 2048 if dry else 1048576
    a = ["--config", "configs/demo.yaml", "--seq-len", str(length), "--batch", "1", "--steps",
         "2" if dry else "3", "--docs", "8" if dry else "128", "--vocab", "1024" if dry else
         "32000"]
    o = ["model.size=tiny", "model.d_model=512", "model.n_heads=8", "model.n_kv_heads=4",
         "model.head_dim=64", "model.d_ff=1536", "model.n_layers=4",
         f"model.dtype={'float32' if dry else 'bfloat16'}", "model.remat=full",
         f"model.loss_chunk={256 if dry else 8192}", "stages.0.attention=gpu",
         f"stages.0.block_q={64 if dry else 128}"]
    r = train(a, o)
    r["before_s_per_step"] = 11.51  # docs/performance.md: blockwise, measured before issue 17
    result["train_small_1m"] = r
    emit()
  if 5 in parts:
    import bench_step_overlap
    a = (["--seq-len", "128", "--batch", "2", "--steps", "4", "--repeats", "1"] if dry else
         ["--seq-len", "1024", "--batch", "8", "--steps", "30", "--repeats", "3"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      bench_step_overlap.main(["--json", *a])
    result["step_overlap"] = json.loads(out.getvalue().strip().splitlines()[-1])
    emit()
  return 0


if __name__ == "__main__":
  sys.exit(main())

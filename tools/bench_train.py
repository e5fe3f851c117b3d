"""Train-step MFU on this machine: achieved FLOP/s of the demo model at L = 1024 over
(per-device peak x device count). The peak is maxlm/parallel/peaks.py's datasheet entry for the
device and model.dtype; on a CPU (no entry) the machine's own f32 matmul FLOP/s, measured in this
run on both sides of the timed steps.

  python tools/bench_train.py [--json] [--config configs/demo.yaml] [--seq-len 1024]
      [--batch 8] [--steps 5] [key=value ...]
"""

import argparse
import json
import sys
import time

import jax
import numpy as np

from maxlm import config as config_lib
from maxlm.model import build
from maxlm.parallel import mesh as mesh_lib, peaks
from maxlm.train import optimizer, step as step_lib


def gemm_flops(n=2048, repeats=10):
  x = jax.numpy.ones((n, n), jax.numpy.float32)
  f = jax.jit(lambda a: a @ a)
  jax.block_until_ready(f(x))
  best = min(_time(lambda: jax.block_until_ready(f(x))) for _ in range(repeats))
  return 2 * n ** 3 / best


def _time(fn):
  t = time.perf_counter()
  fn()
  return time.perf_counter() - t


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--config", default="configs/demo.yaml")
  ap.add_argument("--seq-len", type=int, default=1024)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--steps", type=int, default=8)
  ap.add_argument("--vocab", type=int, default=4096)
  ap.add_argument("--docs", type=int, default=4, help="documents packed in each row")
  ap.add_argument("--peak", type=float, default=0,
                  help="one device's peak FLOP/s for MFU (default: maxlm/parallel/peaks.py's "
                       "table, or f32 matmul measured here where it has no entry)")
  ap.add_argument("--json", action="store_true")
  ap.add_argument("overrides", nargs="*")
  args = ap.parse_args(argv)
  cfg = config_lib.load(args.config, [*args.overrides, f"stages.0.seq_len={args.seq_len}",
                                      f"stages.0.batch={args.batch}"])
  mesh = mesh_lib.make_mesh(cfg.stages[0].mesh)
  model = build.model_for(cfg, 0, mesh, args.vocab)
  opt, schedule = optimizer.make(cfg.train, 100)
  state = step_lib.init_state(model, opt, mesh, cfg.rules, 0, args.seq_len)
  step = jax.jit(step_lib.make_train_step(model, opt, schedule, cfg.rules, model.cfg, 1),
                 donate_argnums=0)
  rng = np.random.default_rng(0)
  L, B = args.seq_len, args.batch
  D = args.docs
  seg = np.repeat(np.arange(1, D + 1), L // D)[None].repeat(B, 0).astype(np.int32)
  batch = {"inputs": rng.integers(11, args.vocab, (B, L)).astype(np.int32),
           "targets": rng.integers(11, args.vocab, (B, L)).astype(np.int32),
           "segment_ids": seg, "positions": (np.arange(L) % (L // D))[None].repeat(B, 0)
           .astype(np.int32), "loss_mask": np.ones((B, L), np.int32)}
  placed = mesh_lib.place_batch(batch, mesh, cfg.rules)
  with mesh:
    state, m = step(state, placed)
    jax.block_until_ready(m)
    sheet = peaks.datasheet(jax.devices()[0].device_kind, cfg.model.dtype)
    peak = args.peak or sheet or gemm_flops()
    times = []
    for _ in range(args.steps):
      t = time.perf_counter()
      state, m = step(state, placed)
      jax.block_until_ready(m)
      times.append(time.perf_counter() - t)
    peak = args.peak or sheet or max(peak, gemm_flops())  # measured on both sides of the steps
  per_token = build.batch_flops_per_token(model.cfg, L, seg)
  achieved = per_token * B * L / min(times)
  out = {"device": jax.devices()[0].device_kind, "seq_len": L, "batch": B, "docs_per_row": D,
         "attention": cfg.stages[0].attention, "model": cfg.model.size,
         "params": build.count_params(state["params"]), "step_s": round(min(times), 4),
         "tokens_per_s": round(B * L / min(times)), "model_flops_per_s": round(achieved),
         "devices": jax.device_count(), "peak_flops_per_s_per_device": round(peak),
         "peak_from": "--peak" if args.peak else "datasheet" if sheet else "measured",
         "mfu": round(achieved / (peak * jax.device_count()), 4)}
  print(json.dumps(out) if args.json else "\n".join(f"{k:>22}: {v}" for k, v in out.items()))
  return 0


if __name__ == "__main__":
  sys.exit(main())

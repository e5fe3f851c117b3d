"""MoE against dense at equal ACTIVE parameters on the demo data, side by side in one run.

Both models are configs/moe_demo.yaml (demo schedule, corpus, attention pattern and optimizer):
`moe` as written (8 experts of width F = 256, top-2, one shared), `dense` the same with
model.moe.experts=0, whose d_ff 768 = (top_k + shared) x F: a token goes through the same MLP
width in both (the router's D x E weights aside). Same seed, same batches, same tokens. The two
runs alternate in chunks of --chunk steps (an in-process stop and resume, which is bitwise), so
both see the same load on a shared machine; tokens/s is the median over the steps of each run
that did not compile or follow a resume. Held-out loss (`val_loss`) is compared at the same
steps, i.e. at equal tokens.

Before the runs, `grouped_matmul_cpu` times what decides MoE's tokens/s on a CPU: the gradient
of one grouped matmul (jax.lax.ragged_dot, whose forward maxlm/model/grouped.py uses on GPU)
against a dense matmul of the same FLOPs, and against `blocked`, a pure-JAX alternative measured
here only (each expert's rows padded to 128-row blocks, one batched matmul with per-block
weights).

  python tools/bench_moe_train.py --json [--data runs/demo/data] [--steps-scale 1.0]
      [--chunk 15] [--eval-every 65] [key=value ...]

--data defaults to the demo's data dir; it is built as `maxlm demo` builds it when missing.
"""

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import tempfile

import numpy as np

from maxlm import config as config_lib
from maxlm.model import build
from maxlm.train import memory
from maxlm.train import loop, metrics

ROOT = pathlib.Path(__file__).resolve().parents[1]


def ensure_data(data_dir):
  if os.path.exists(os.path.join(data_dir, "manifest.json")):
    return
  from maxlm import demo
  from maxlm.data import corpus, prepare
  raw = os.path.join(os.path.dirname(data_dir), "raw")
  corpus.build(raw)
  prepare.prepare([os.path.join(raw, "prose.jsonl"), os.path.join(raw, "code.jsonl")], data_dir,
                  prepare.Options(vocab_size=4096, overwrite=True, quality=demo.DEMO_QUALITY))


def _timed(fn, *args, repeats=5):
  import time
  import jax
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return best


def blocked_matmul(x_SxD, w_ExDxF, sizes_E, block=128):
  """ragged_dot's result by padded blocks: one batched matmul, (S + E x block) rows of work."""
  import jax.numpy as jnp
  s, d = x_SxD.shape
  e = w_ExDxF.shape[0]
  nb = s // block + e
  padded_E = (sizes_E + block - 1) // block * block
  end_E, pend_E = jnp.cumsum(sizes_E), jnp.cumsum(padded_E)
  group_S = jnp.searchsorted(end_E, jnp.arange(s), side="right")
  g = jnp.minimum(group_S, e - 1)
  dest_S = jnp.where(group_S < e, pend_E[g] - padded_E[g] + jnp.arange(s) - end_E[g] + sizes_E[g],
                     nb * block)
  x_NxBxD = jnp.zeros((nb * block, d), x_SxD.dtype).at[dest_S].set(x_SxD, mode="drop").reshape(
      nb, block, d)
  expert_N = jnp.minimum(jnp.searchsorted(pend_E, jnp.arange(nb) * block, side="right"), e - 1)
  y = jnp.einsum("nbd,ndf->nbf", x_NxBxD, w_ExDxF[expert_N]).reshape(nb * block, -1)
  return y.at[dest_S].get(mode="fill", fill_value=0)


def grouped_matmul_cpu(slots=4096, d=256, f=512, experts=8):
  """Seconds of one gradient (w.r.t. both operands) of each way of multiplying `slots` rows
  sorted into `experts` groups by their group's [d, f] matrix."""
  import jax
  import jax.numpy as jnp
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(slots, d)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(experts, d, f)), jnp.float32)
  sizes = jnp.asarray(rng.multinomial(slots, [1 / experts] * experts), jnp.int32)
  grad = lambda fn: jax.jit(jax.grad(lambda a, b: fn(a, b).sum(), argnums=(0, 1)))  # noqa: E731
  out = {"ragged_dot": _timed(grad(lambda a, b: jax.lax.ragged_dot(a, b, sizes)), x, w),
         "blocked": _timed(grad(lambda a, b: blocked_matmul(a, b, sizes)), x, w),
         "dense_same_flops": _timed(grad(lambda a, b: a @ b), x, w[0])}
  diff = jnp.abs(blocked_matmul(x, w, sizes) - jax.lax.ragged_dot(x, w, sizes)).max()
  return {"shape": {"slots": slots, "d": d, "f": f, "experts": experts},
          "seconds": out, "ragged_over_dense": out["ragged_dot"] / out["dense_same_flops"],
          "blocked_over_dense": out["blocked"] / out["dense_same_flops"],
          "blocked_max_abs_diff": float(diff)}


def configs(args, work):
  common = [f"data.dir={args.data}", f"train.eval_every={args.eval_every}",
            "train.checkpoint_every=1000", *args.overrides]
  if args.steps_scale != 1.0:
    base = config_lib.load(str(ROOT / "configs/moe_demo.yaml"))
    common += [f"stages.{i}.steps={max(1, round(st.num_steps * args.steps_scale))}"
               for i, st in enumerate(base.stages)]
  out = {}
  for name, extra in (("dense", ["model.moe.experts=0"]), ("moe", [])):
    out[name] = config_lib.load(str(ROOT / "configs/moe_demo.yaml"),
                                [*common, *extra, f"run_dir={os.path.join(work, name)}"])
  return out


def summary(cfg, rows, first_steps, vocab):
  steady = [r["tokens_per_s"] for r in rows if r["step"] not in first_steps]
  counts = memory.param_counts(cfg, vocab)
  return {"params_total": counts["total"], "params_active": counts["active"],
          "flops_per_token_L128": build.flops_per_token(
              _resolved(cfg, vocab), cfg.stages[0].seq_len),
          "tokens_per_s_median": float(np.median(steady)), "steps_timed": len(steady),
          "tokens": int(sum(r["loss_tokens"] for r in rows)),
          "final_train_loss_mean10": float(np.mean([r["loss"] for r in rows[-10:]])),
          "val_loss": {r["step"]: r["val_loss"] for r in rows if "val_loss" in r},
          "moe_max_load_over_mean_last": {k.split("/")[-1]: v for k, v in rows[-1].items()
                                          if k.startswith("moe/max_load_over_mean/")}}


def _resolved(cfg, vocab):
  return dataclasses.replace(cfg.model, vocab_size=vocab)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--data", default=str(ROOT / "runs/demo/data"))
  ap.add_argument("--steps-scale", type=float, default=1.0,
                  help="scale every stage's steps (1.0: the demo schedule)")
  ap.add_argument("--chunk", type=int, default=15, help="steps each run takes before the other")
  ap.add_argument("--eval-every", type=int, default=65)
  ap.add_argument("--json", action="store_true")
  ap.add_argument("overrides", nargs="*")
  args = ap.parse_args(argv)
  ensure_data(args.data)
  grouped = grouped_matmul_cpu()
  work = tempfile.mkdtemp(prefix="bench-moe-")
  cfgs = configs(args, work)
  total = sum(st.num_steps for st in cfgs["moe"].stages)
  done, first = {"dense": 0, "moe": 0}, {"dense": set(), "moe": set()}
  quiet = lambda *_: None  # noqa: E731
  while min(done.values()) < total:
    for name, cfg in cfgs.items():
      if done[name] < total:
        first[name].add(done[name])  # compiles, or follows an in-process resume
        out = loop.train(cfg, stop_after=args.chunk, log=quiet)
        done[name] = out["step"]
  vocab = int(json.loads(open(os.path.join(args.data, "manifest.json")).read())["vocab_size"])
  result = {name: summary(cfg, metrics.read_jsonl(cfg.run_dir), first[name], vocab)
            for name, cfg in cfgs.items()}
  d, m = result["dense"], result["moe"]
  result["tokens_per_s_ratio_moe_over_dense"] = m["tokens_per_s_median"] / d[
      "tokens_per_s_median"]
  result["val_loss_moe_minus_dense"] = {s: m["val_loss"][s] - d["val_loss"][s]
                                        for s in d["val_loss"] if s in m["val_loss"]}
  result["equal_tokens"] = d["tokens"] == m["tokens"]
  result["grouped_matmul_cpu"] = grouped
  result["command"] = "python tools/bench_moe_train.py " + " ".join(argv or sys.argv[1:])
  if args.json:
    print(json.dumps(result, indent=1))
    return
  for name in ("dense", "moe"):
    r = result[name]
    print(f"{name:>6}: {r['params_active']:,} active / {r['params_total']:,} params, "
          f"{r['tokens_per_s_median']:,.0f} tok/s, val_loss {r['val_loss']}")
  print(f"tokens/s moe / dense {result['tokens_per_s_ratio_moe_over_dense']:.2f}; val_loss "
        f"moe - dense {result['val_loss_moe_minus_dense']}")


if __name__ == "__main__":
  main()

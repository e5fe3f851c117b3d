"""The MoE layer's grouped-matmul experts vs the per-expert loop reference, side by side.

One MoE layer's routing + routed experts (maxlm/model/moe.py: route, then experts_grouped or
experts_loop) on the same inputs, float32, in one process, for each E in --experts:

  max_abs_diff_fwd / max_abs_diff_grad   grouped vs loop: outputs, and gradients wrt x, the
                                         router, gate_up and down (dropless); max_abs_grad:
                                         the largest gradient entry, for scale, and
                                         max_rel_diff_grad = max_abs_diff_grad / max_abs_grad
  max_abs_diff_fwd_capacity / _grad_capacity   the same in capacity mode (--capacity-factor),
                                         with dropped_fraction, the share of slots dropped
  grouped_over_loop_fwd / _fwd_bwd       time ratio (median of --repeats, interleaved)
  grouped_ms_* / loop_ms_*               the medians themselves
  *_ragged_dot                           the same for grouped with jax.lax.ragged_dot forced
                                         (on CPU the default is grouped.py's tiled scan)
  load_max_over_mean                     the busiest expert's slots over the mean

Inputs are real text: the bytes of a Python stdlib source file, embedded with a fixed random
table [256, D], so routing sees the skew of repeated tokens. grouped uses grouped.default_impl()
for this backend (maxlm/model/grouped.py: tiled on CPU, ragged_dot_tiles on GPU, megablox on
TPU).

  python tools/bench_moe_layer.py [--json] [--tokens 4096] [--d-model 256] [--d-ff 512]
      [--experts 8 32] [--top-k 2] [--capacity-factor 1.0] [--repeats 3]
"""

import argparse
import functools
import inspect
import json
import statistics
import time


def real_inputs(n_tokens, d_model):
  import argparse as source_module  # any stdlib file; this one is long enough
  import jax
  import jax.numpy as jnp
  import numpy as np
  path = inspect.getsourcefile(source_module)
  data = np.frombuffer(open(path, "rb").read(), np.uint8)
  if len(data) < n_tokens:
    data = np.resize(data, n_tokens)
  table_VxD = jax.random.normal(jax.random.key(0), (256, d_model), jnp.float32)
  return table_VxD[jnp.asarray(data[:n_tokens], jnp.int32)], path


def layer_fns(cfg, capacity):
  import jax
  import jax.numpy as jnp
  from maxlm.model import experts, moe

  def make(experts_fn):
    def forward(x, router, gate_up, down):
      expert, weight, _ = moe.route(x, router, jnp.zeros(router.shape[1]), cfg)
      return experts_fn(x, expert, weight, gate_up, down, capacity)

    def grads(x, router, gate_up, down, cotangent):
      loss = lambda *a: jnp.sum(forward(*a) * cotangent)
      return jax.grad(loss, argnums=(0, 1, 2, 3))(x, router, gate_up, down)

    return jax.jit(forward), jax.jit(grads)

  return {"grouped": make(experts.experts_grouped),
          "grouped_ragged_dot": make(functools.partial(experts.experts_grouped,
                                                       impl="ragged_dot")),
          "loop": make(experts.experts_loop)}


def _max_diff(a, b):
  import jax
  import jax.numpy as jnp
  return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree_util.tree_leaves(a),
                                                             jax.tree_util.tree_leaves(b)))


def _median_ms(fn, args, repeats):
  import jax
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - start) * 1e3)
  return statistics.median(times)


def one_size(args, n_experts, x_TxD):
  import jax
  import jax.numpy as jnp
  from maxlm.config_model import MoeConfig
  from maxlm.model import experts, moe
  d, f = args.d_model, args.d_ff
  keys = jax.random.split(jax.random.key(n_experts), 4)
  params = (jax.random.normal(keys[0], (d, n_experts)) / d ** 0.5,
            jax.random.normal(keys[1], (n_experts, d, 2, f)) / d ** 0.5,
            jax.random.normal(keys[2], (n_experts, f, d)) / f ** 0.5)
  cotangent = jax.random.normal(keys[3], x_TxD.shape)
  cfg = MoeConfig(experts=n_experts, top_k=args.top_k)
  out = {}
  expert, _, stats = jax.jit(moe.route, static_argnums=3)(x_TxD, params[0],
                                                          jnp.zeros(n_experts), cfg)
  out["load_max_over_mean"] = float(jnp.max(stats["load"]) / jnp.mean(stats["load"]))
  fns = layer_fns(cfg, 0)
  inputs = (x_TxD, *params)
  results = {name: (fwd(*inputs), grad(*inputs, cotangent)) for name, (fwd, grad) in fns.items()}
  for name in ("grouped", "grouped_ragged_dot"):
    suffix = name[len("grouped"):]
    out[f"max_abs_diff_fwd{suffix}"] = _max_diff(results[name][0], results["loop"][0])
    out[f"max_abs_diff_grad{suffix}"] = _max_diff(results[name][1], results["loop"][1])
  out["max_abs_grad"] = max(float(jnp.max(jnp.abs(g))) for g in results["loop"][1])
  out["max_rel_diff_grad"] = out["max_abs_diff_grad"] / out["max_abs_grad"]
  times = {f"{name}_{kind}": [] for name in fns for kind in ("fwd", "fwd_bwd")}
  for _ in range(args.repeats):  # interleaved, so load on the machine hits both alike
    for name, (fwd, grad) in fns.items():
      times[f"{name}_fwd"].append(_median_ms(fwd, inputs, 1))
      times[f"{name}_fwd_bwd"].append(_median_ms(grad, (*inputs, cotangent), 1))
  for name in fns:
    for kind in ("fwd", "fwd_bwd"):
      out[f"{name}_ms_{kind}"] = round(statistics.median(times[f"{name}_{kind}"]), 2)
  for name in ("grouped", "grouped_ragged_dot"):
    for kind in ("fwd", "fwd_bwd"):
      out[f"{name}_over_loop_{kind}"] = round(out[f"{name}_ms_{kind}"] / out[f"loop_ms_{kind}"],
                                              3)
  if args.capacity_factor > 0:
    cap_cfg = MoeConfig(experts=n_experts, top_k=args.top_k,
                        capacity_factor=args.capacity_factor)
    capacity = experts.capacity_for(cap_cfg, x_TxD.shape[0])
    fns = layer_fns(cap_cfg, capacity)
    res = {name: (fwd(*inputs), grad(*inputs, cotangent)) for name, (fwd, grad) in fns.items()
           if name != "grouped_ragged_dot"}
    out["max_abs_diff_fwd_capacity"] = _max_diff(res["grouped"][0], res["loop"][0])
    out["max_abs_diff_grad_capacity"] = _max_diff(res["grouped"][1], res["loop"][1])
    dropped = float(experts.dropped_slots(stats["load"], capacity))
    out["dropped_fraction"] = round(dropped / expert.size, 4)
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", action="store_true")
  parser.add_argument("--tokens", type=int, default=4096)
  parser.add_argument("--d-model", type=int, default=256)
  parser.add_argument("--d-ff", type=int, default=512)
  parser.add_argument("--experts", type=int, nargs="+", default=[8, 32])
  parser.add_argument("--top-k", type=int, default=2)
  parser.add_argument("--capacity-factor", type=float, default=1.0)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args(argv)
  import jax
  from maxlm.model import grouped
  x_TxD, source = real_inputs(args.tokens, args.d_model)
  report = {"backend": jax.default_backend(), "grouped_impl": grouped.default_impl(),
            "tokens": args.tokens, "d_model": args.d_model, "d_ff": args.d_ff,
            "top_k": args.top_k, "capacity_factor": args.capacity_factor,
            "dtype": "float32", "input_text": source, "repeats": args.repeats}
  for n_experts in args.experts:
    report[f"E{n_experts}"] = one_size(args, n_experts, x_TxD)
    if not args.json:
      print(f"E={n_experts}: {report[f'E{n_experts}']}", flush=True)
  print(json.dumps(report, indent=1) if args.json else "done")


if __name__ == "__main__":
  main()

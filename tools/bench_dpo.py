"""DPO step throughput against a pretraining step of the same model and row length, side by side
in one run, plus the reference model's forward pass alone (what a second forward pass in the
step costs, the choice maxlm/train/dpo.py makes instead of storing reference log-probs).

  python tools/bench_dpo.py [--json] [--config configs/demo.yaml] [--seq-len 512] [--batch 8]
      [--pairs 4] [--steps 6] [key=value ...]

Rows are packed with `--pairs` preference pairs each (prompt a third of a segment), the
pretraining rows with as many segments of the same lengths; steps of each kind alternate, and
each time is the median over `--steps` after compiling. Ratios < 1 mean DPO is slower.
"""

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import flax.linen as nn
import numpy as np

from maxlm import config as config_lib
from maxlm.data import pairs
from maxlm.model import build, sharding
from maxlm.parallel import mesh as mesh_lib
from maxlm.train import dpo, optimizer, step as step_lib


def pair_rows(B, L, n_pairs, vocab, rng):
  """[B, L] arrays of rows holding n_pairs packed pairs each (and a little padding)."""
  seg_len = L // (2 * n_pairs)
  p = seg_len // 3
  out = {f: np.zeros((B, L), np.int32) for f in ("inputs", "targets", "segment_ids",
                                                   "positions", "loss_mask", "roles")}
  for b in range(B):
    at = 0
    for k in range(n_pairs):
      prompt = rng.integers(11, vocab, p)
      for j, role in enumerate((pairs.CHOSEN, pairs.REJECTED)):
        answer = rng.integers(11, vocab, seg_len - p - 1)
        seg = np.concatenate([[1], prompt, answer, [2]])
        n = len(seg) - 1
        sl = slice(at, at + n)
        out["inputs"][b, sl], out["targets"][b, sl] = seg[:-1], seg[1:]
        out["segment_ids"][b, sl], out["positions"][b, sl] = 2 * k + j + 1, np.arange(n)
        out["loss_mask"][b, sl], out["roles"][b, sl] = (np.arange(n) >= p), role
        at += n
  return out


def _median_time(fn, steps):
  times = []
  for _ in range(steps):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--config", default="configs/demo.yaml")
  ap.add_argument("--seq-len", type=int, default=512)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--pairs", type=int, default=4, help="preference pairs packed in each row")
  ap.add_argument("--steps", type=int, default=6)
  ap.add_argument("--vocab", type=int, default=4096)
  ap.add_argument("--json", action="store_true")
  ap.add_argument("overrides", nargs="*")
  args = ap.parse_args(argv)
  cfg = config_lib.load(args.config, [*args.overrides, f"stages.0.seq_len={args.seq_len}",
                                      f"stages.0.batch={args.batch}"])
  mesh = mesh_lib.make_mesh(cfg.stages[0].mesh)
  model = build.model_for(cfg, 0, mesh, args.vocab)
  opt, schedule = optimizer.make(cfg.train, 100)
  L, B = args.seq_len, args.batch
  batch = pair_rows(B, L, args.pairs, args.vocab, np.random.default_rng(0))
  with mesh:
    placed = mesh_lib.place_batch(batch, mesh, cfg.rules)
    state = {"lm": step_lib.init_state(model, opt, mesh, cfg.rules, 0, L),
             "dpo": step_lib.init_state(model, opt, mesh, cfg.rules, 0, L)}
    ref = jax.tree_util.tree_map(jnp.copy, state["dpo"]["params"])
    lm_step = jax.jit(step_lib.make_train_step(model, opt, schedule, cfg.rules, model.cfg, 1),
                      donate_argnums=0)
    dpo_step = jax.jit(dpo.make_train_step(model, opt, schedule, cfg.rules, model.cfg, 1, 0.1,
                                           0.0), donate_argnums=0)

    def fwd(params, b):
      with nn.logical_axis_rules(sharding.rules_list(cfg.rules)):
        h, head, _ = model.apply({"params": params}, b["inputs"], b["positions"],
                                 b["segment_ids"])
      return dpo.token_logprobs(h, head, b["targets"], model.cfg.loss_chunk).sum()
    forward = jax.jit(fwd)

    def run_lm():
      state["lm"], m = lm_step(state["lm"], placed)
      jax.block_until_ready(m)

    def run_dpo():
      state["dpo"], m = dpo_step(state["dpo"], placed, ref)
      jax.block_until_ready(m)

    def run_fwd():
      jax.block_until_ready(forward(ref, placed))

    for fn in (run_lm, run_dpo, run_fwd):  # compile
      fn()
    times = {"lm": [], "dpo": [], "ref_forward": []}
    for _ in range(args.steps):  # interleaved, so drift hits all three alike
      for name, fn in (("lm", run_lm), ("dpo", run_dpo), ("ref_forward", run_fwd)):
        times[name].append(_median_time(fn, 1))
  med = {k: statistics.median(v) for k, v in times.items()}
  tokens = B * L
  result = {
      "config": args.config, "seq_len": L, "batch": B, "pairs_per_row": args.pairs,
      "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
      "lm_step_s": med["lm"], "dpo_step_s": med["dpo"], "ref_forward_s": med["ref_forward"],
      "lm_tokens_per_s": tokens / med["lm"], "dpo_tokens_per_s": tokens / med["dpo"],
      "dpo_throughput_vs_lm": med["lm"] / med["dpo"],
      "ref_forward_share_of_dpo_step": med["ref_forward"] / med["dpo"]}
  if args.json:
    print(json.dumps(result))
  else:
    for k, v in result.items():
      print(f"{k:>32}: {v:.4g}" if isinstance(v, float) else f"{k:>32}: {v}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""DeepSeek-V4's pieces measured side by side on this CPU (docs/performance.md).

--part train: four runs of the demo schedule on the demo data, same seed, same batches, same
tokens, alternating in chunks of --chunk steps (an in-process stop and resume, which is
bitwise) so that all see the same load on a shared machine:
  v4          configs/v4_tiny.yaml as written: V4 attention, mHC, V4 experts, MTP, Muon;
  v4_no_mtp   the same with model.mtp.depth=0;
  v4_adamw    the same with train.optimizer=adamw;
  llama       a Llama-shaped decoder (GQA, one residual, a dense SwiGLU, AdamW, dense attention
              in every stage) whose d_ff is chosen so its active parameters equal v4_no_mtp's
              (the model that is served: the MTP block only trains).
The V4 runs follow v4_tiny's CSA stages: in its 15 indexer warm-up steps only the indexer
learns, so they train their main weights for 15 steps fewer than llama.
Held-out loss (`val_loss`, the main head's) at the same steps, i.e. equal tokens; tokens/s the
median over the steps that did not compile or follow a resume.

--part attention: one attention layer's forward and backward over a 1-document row at
16K and 64K positions, dense causal (`blockwise`, our CPU default) against V4's three layer
kinds by query blocks (maxlm/model/compressed_blocks.py): window only (W = 128), HCA
(m' = 128, every closed entry) and CSA (m = 4, the indexer's top 512 of the L / 4 entries,
its scores and its KL loss, forward and backward, included). Heads and widths are V4-Flash's
proportions scaled down: 4 query heads of 64 (one shared K = V head in V4; 1 KV head for
dense), an indexer of 4 heads of 16, i.e. an indexer pair costs 1/8 of an attention pair, as
64 x 128 against 64 x 512 x 2 in V4-Flash.

  python tools/bench_v4.py --part train --json [--data runs/demo/data] [--chunk 15]
  python tools/bench_v4.py --part attention --json [--lengths 16384 65536]
"""

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_moe_train import ensure_data, summary  # noqa: E402

from maxlm import config as config_lib  # noqa: E402
from maxlm.train import loop, memory, metrics  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
LLAMA = ["model.mqa.q_lora=0", "model.mhc.streams=0", "model.moe.experts=0", "model.mtp.depth=0",
         "train.optimizer=adamw", *(f"stages.{s}.sparse.mode=dense" for s in (1, 2, 3))]
RUNS = {"v4": [], "v4_no_mtp": ["model.mtp.depth=0"], "v4_adamw": ["train.optimizer=adamw"],
        "llama": LLAMA}


def _load(common, extra, run_dir):
  return config_lib.load(str(ROOT / "configs/v4_tiny.yaml"),
                         [*common, *extra, f"run_dir={run_dir}"])


def llama_d_ff(common, vocab, target, work):
  """The d_ff (a multiple of 16) whose Llama-shaped model's active parameters are closest to
  `target`."""
  def active(d_ff):
    cfg = _load(common, [*LLAMA, f"model.d_ff={d_ff}"], os.path.join(work, "probe"))
    return memory.param_counts(cfg, vocab)["active"]
  return min(range(16, 8192, 16), key=lambda f: abs(active(f) - target))


def train_part(args):
  ensure_data(args.data)
  vocab = int(json.loads(open(os.path.join(args.data, "manifest.json")).read())["vocab_size"])
  work = tempfile.mkdtemp(prefix="bench-v4-")
  common = [f"data.dir={args.data}", f"train.eval_every={args.eval_every}",
            "train.checkpoint_every=1000", *args.overrides]
  served = memory.param_counts(_load(common, RUNS["v4_no_mtp"], work), vocab)["active"]
  d_ff = llama_d_ff(common, vocab, served, work)
  cfgs = {name: _load(common, extra + ([f"model.d_ff={d_ff}"] if name == "llama" else []),
                      os.path.join(work, name)) for name, extra in RUNS.items()}
  total = sum(st.num_steps for st in cfgs["v4"].stages)
  done = {name: 0 for name in cfgs}
  first = {name: set() for name in cfgs}
  while min(done.values()) < total:
    for name, cfg in cfgs.items():
      if done[name] < total:
        first[name].add(done[name])
        done[name] = loop.train(cfg, stop_after=args.chunk, log=lambda *_: None)["step"]
  result = {name: summary(cfg, metrics.read_jsonl(cfg.run_dir), first[name], vocab)
            for name, cfg in cfgs.items()}
  for r in result.values():
    r.pop("moe_max_load_over_mean_last", None)
  base = result["llama"]
  result["llama_d_ff"] = d_ff
  result["v4_no_mtp_active_params"] = served
  for name in ("v4", "v4_no_mtp", "v4_adamw"):
    r = result[name]
    r["tokens_per_s_over_llama"] = r["tokens_per_s_median"] / base["tokens_per_s_median"]
    r["val_loss_minus_llama"] = {s: r["val_loss"][s] - base["val_loss"][s]
                                 for s in base["val_loss"] if s in r["val_loss"]}
  result["val_loss_mtp_minus_no_mtp"] = _minus(result["v4"], result["v4_no_mtp"])
  result["val_loss_muon_minus_adamw"] = _minus(result["v4"], result["v4_adamw"])
  result["equal_tokens"] = len({r["tokens"] for r in map(result.get, cfgs)}) == 1
  return result


def _minus(a, b):
  return {s: a["val_loss"][s] - b["val_loss"][s] for s in b["val_loss"] if s in a["val_loss"]}


def _seconds(fn, *args, repeats):
  import jax
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  compile_and_first = time.perf_counter() - start
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return best, compile_and_first


def _objective(out, indexer_sums):
  """What the backward runs from: the output's sum, plus CSA's indexer KL (as in training)."""
  import jax.numpy as jnp
  total = out.astype(jnp.float32).sum()
  return total if indexer_sums is None else total + indexer_sums["kl"]


def attention_part(args):
  """Seconds of one forward + backward of each layer kind at each length."""
  import jax
  import jax.numpy as jnp
  from maxlm.model import compressed, compressed_blocks
  from maxlm.model.attention import attention
  h, k, j, c, window, block, top_k = 4, 64, 4, 16, 128, 512, 512
  out = {"shape": {"heads": h, "head_dim": k, "index_heads": j, "index_dim": c,
                   "window": window, "block": block, "csa_rate": 4, "hca_rate": 128,
                   "top_k": top_k, "dense_impl": "blockwise"}, "lengths": {}}
  for length in args.lengths:
    keys = jax.random.split(jax.random.key(length), 8)
    q = jax.random.normal(keys[0], (1, length, h, k))
    kv = jax.random.normal(keys[1], (1, length, k))
    pos = jnp.arange(length)[None]
    seg = jnp.ones((1, length), jnp.int32)
    sink = jnp.zeros((h,))

    def dense(q, kv, _):
      return attention(q, kv[:, :, None], kv[:, :, None], seg, impl="blockwise",
                       block_q=block, block_k=block, max_logit=False), None

    def kind(rate, top):
      """(the layer kind's attention(q, kv, indexer arrays), its indexer arrays: ())."""
      if not rate:
        e, end, valid = jnp.zeros((1, 0, k)), jnp.zeros((1, 0), jnp.int32), \
            jnp.zeros((1, 0), bool)
      else:
        end, valid = compressed.window_ends(pos, seg, rate)
        e = jax.random.normal(keys[2], (1, end.shape[1], k))
      arrays = () if not top else (jax.random.normal(keys[3], (1, length, j, c)),
                                   jax.random.normal(keys[4], (1, length, j)),
                                   jax.random.normal(keys[5], (1, end.shape[1], c)))
      return (lambda q, kv, idx: compressed_blocks.attend(
          q, kv, e, end, valid, seg, window, sink, block, (*idx, top) if idx else None)), arrays
    fns = {"dense": (dense, ()), "window": kind(0, 0), "hca": kind(128, 0),
           "csa": kind(4, top_k)}
    row = {}
    for name, (fn, idx) in fns.items():  # the indexer's arrays learn too, as in training
      grad = jax.jit(jax.grad(lambda q, kv, idx, fn=fn: _objective(*fn(q, kv, idx)),
                              argnums=(0, 1, 2)))
      row[name], first = _seconds(grad, q, kv, idx, repeats=args.repeats)
      row[f"{name}_first_call"] = first
    for name in ("window", "hca", "csa"):
      row[f"{name}_over_dense"] = row[name] / row["dense"]
    row["csa_hca_mean_over_dense"] = (row["csa"] + row["hca"]) / 2 / row["dense"]
    out["lengths"][length] = row
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--part", choices=("train", "attention"), required=True)
  ap.add_argument("--data", default=str(ROOT / "runs/demo/data"))
  ap.add_argument("--chunk", type=int, default=15, help="steps each run takes before the next")
  ap.add_argument("--eval-every", type=int, default=40)
  ap.add_argument("--lengths", type=int, nargs="*", default=[16384, 65536])
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument("--json", action="store_true")
  ap.add_argument("overrides", nargs="*")
  args = ap.parse_args(argv)
  result = train_part(args) if args.part == "train" else attention_part(args)
  result["command"] = "python tools/bench_v4.py " + " ".join(argv or sys.argv[1:])
  print(json.dumps(result, indent=1) if args.json else result)


if __name__ == "__main__":
  main()

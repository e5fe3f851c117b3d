"""Sparse (DeepSeek sparse attention, top-k KV blocks) vs dense attention, one layer.

One layer's attention, one row (one document), 16 query heads / 4 KV heads x 128, indexer
4 heads x 64, k = 2048, f32 (--dtype), forward + backward (gradients of q, k, v and the
indexer's inputs through its KL), each case in its own process, side by side in one run:

  sparse_over_dense_{L}       sparse time / dense time (--dense-impl, blockwise by default)
  topk_full_max_abs_diff      k >= L: sparse vs dense, outputs and gradients (L = 1024)
  sparse_peak_rss_gib_{L}     peak resident memory of the sparse case's process (on a GPU
                              also sparse_peak_device_gib_{L}, the device's peak bytes in use)
  recall_demo                 dense attention mass on the top-k keys of an indexer warmed up
                              on the demo corpus, on held-out rows; recall_demo_sparse: the
                              same measured by the sparse stage's training metric over its
                              steps after the warm-up (--recall; trains a run)

  python tools/bench_sparse.py [--json] [--lengths 16384 65536 131072] [--recall]
      [--dense-max L] [--token-max L] [--dense-impl IMPL] [--dtype D] [--repeats N]

sparse_* is block selection (`sparse.select: block`, the default, with the training default of
4 recall blocks), token_* the token-level variant (`select: token`), each over the same dense
run. tools/gpu_sparse_check.sh is the same comparison prepared for one GPU.
"""

import argparse
import os
import json
import resource
import subprocess
import sys
import tempfile
import time

HEADS, KV_HEADS, DIM, I_HEADS, I_DIM, TOPK, BLOCK = 16, 4, 128, 4, 64, 2048, 512


def _inputs(length, seed=0):
  import jax.numpy as jnp
  import numpy as np
  rng = np.random.default_rng(seed)
  dtype = os.environ.get("MAXLM_BENCH_DTYPE", "float32")  # set by --dtype for every case
  f = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32), dtype)  # no f64 copy in RSS
  return (f(1, length, HEADS, DIM), f(1, length, KV_HEADS, DIM), f(1, length, KV_HEADS, DIM),
          f(1, length, I_HEADS, I_DIM) / I_DIM ** 0.5, f(1, length, I_HEADS),
          f(1, length, I_DIM), jnp.ones((1, length), jnp.int32))


def _grad_fns(topk, dense_impl="blockwise"):
  """sparse_block: the implementation training uses (`sparse.select: block`); sparse: the
  token-level variant (`select: token`); dense: `attention(impl=dense_impl)`."""
  import jax
  from maxlm.model.attention import attention, sparse, sparse_blocks

  def dense(q, k, v, iq, iw, ik, seg):
    return attention(q, k, v, seg, impl=dense_impl, block_q=BLOCK, block_k=BLOCK).sum(), {}

  def sparse_loss(q, k, v, iq, iw, ik, seg):
    out, _, stats = sparse.sparse(q, k, v, iq, iw, ik, seg, seg, topk=topk)
    return out.sum() + stats["kl"], stats

  def block_loss(q, k, v, iq, iw, ik, seg):
    out, _, stats = sparse_blocks.sparse_blocks(q, k, v, iq, iw, ik, seg, seg, topk=topk,
                                                block=64, recall_blocks=4)
    return out.sum() + stats["kl"], stats

  # the stats are outputs, as in training's metrics, so XLA cannot drop the recall
  grad = lambda f: jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4, 5), has_aux=True))
  return {"dense": grad(dense), "sparse": grad(sparse_loss), "sparse_block": grad(block_loss)}


def run_case(kind, length, repeats, dense_impl):
  import jax
  args = _inputs(length)
  step = _grad_fns(TOPK, dense_impl)[kind]
  jax.block_until_ready(step(*args))
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(step(*args))
    times.append(time.perf_counter() - t)
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB
  out = {"seconds": min(times), "peak_rss_gib": round(peak, 3),
         "backend": jax.default_backend()}
  stats = jax.devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
  if stats and "peak_bytes_in_use" in stats:
    out["peak_device_gib"] = round(stats["peak_bytes_in_use"] / 2**30, 3)
  return out


def topk_full_diff(length=1024):
  """k >= L: sparse and dense (reference) outputs and q/k/v gradients, max abs difference for
  token selection (topk_full_max_abs_diff, as before) and block selection, the block one
  relative to the largest value, and our dense blockwise kernel's own difference from the
  reference (f32 summation order: the floor any chunked implementation meets)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from maxlm.model.attention import blockwise, reference, sparse, sparse_blocks
  q, k, v, iq, iw, ik, seg = _inputs(length)
  w = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)

  def run(fn):
    return jax.value_and_grad(lambda q, k, v: (fn(q, k, v) * w).sum(), argnums=(0, 1, 2))(
        q, k, v)

  a = run(lambda q, k, v: reference.attention(q, k, v, seg, seg)[0])
  fa = reference.attention(q, k, v, seg, seg)[0]

  def diff(fn):
    b = run(fn)
    pairs = list(zip(a[1], b[1])) + [(fa, fn(q, k, v))]
    return (max(float(jnp.abs(x - y).max()) for x, y in pairs),
            max(float(jnp.abs(x - y).max() / jnp.abs(x).max()) for x, y in pairs))

  token = diff(lambda q, k, v: sparse.sparse(q, k, v, iq, iw, ik, seg, seg, topk=length,
                                             chunk=128)[0])
  block = diff(lambda q, k, v: sparse_blocks.sparse_blocks(q, k, v, iq, iw, ik, seg, seg,
                                                           topk=length, block=64)[0])
  floor = diff(lambda q, k, v: blockwise.attention(q, k, v, seg, seg, block_q=128,
                                                   block_k=128)[0])
  return {"topk_full_max_abs_diff": token[0], "topk_full_block_max_abs_diff": block[0],
          "topk_full_block_max_rel_diff": block[1],
          "dense_blockwise_vs_reference_max_abs_diff": floor[0]}


def recall_demo(workdir):
  """Trains the demo ladder briefly (dense, then indexer warm-up), measures the warmed-up
  indexer's recall on held-out rows of the demo corpus, then trains the sparse stage (L = 1024,
  top 256 keys as 8 blocks of 32) and averages its own recall metric over its steps."""
  import jax
  import numpy as np
  from maxlm import config as config_lib
  from maxlm.data import assemble, corpus, loader, prepare
  from maxlm.eval import windows
  from maxlm.model import build
  from maxlm.ckpt import checkpoint
  from maxlm.train import loop, resume, stage as stage_lib
  raw = corpus.build(f"{workdir}/raw", bytes_per_source=600_000)
  prepare.prepare(raw, f"{workdir}/data", prepare.Options(vocab_size=1024, progress=False))
  ladder = ["model.size=tiny", f"data.dir={workdir}/data", f"run_dir={workdir}/run",
            "stages.0.steps=60", "stages.1.steps=40", "stages.1.sparse.mode=indexer_warmup",
            "stages.1.sparse.topk=64", "stages.2.steps=20", "stages.2.sparse.mode=sparse",
            "stages.2.sparse.topk=256", "stages.2.sparse.block=32",
            "stages.2.sparse.recall_blocks=8", "train.eval_every=0",
            "train.checkpoint_every=100"]
  cfg = config_lib.load("configs/demo.yaml", ladder)
  loop.train(cfg, stop_after=100, log=lambda *_: None)  # the end of the warm-up stage
  data = loader.Data(cfg)
  vocab = cfg.model.vocab_size or int(data.manifest["vocab_size"])
  ckpts = checkpoint.Checkpoints(cfg.run_dir, 3, False, lambda *_: None, read_only=True)
  state = resume.resume(ckpts, cfg, data, vocab, lambda *_: None,
                        reader=True)[0]
  parts = stage_lib.parts(cfg, 1, vocab)
  seq_len = cfg.stages[1].seq_len
  rows = windows.heldout_rows(data.index, windows.heldout_docs(data.index, 16 * seq_len),
                              seq_len, cfg.data.overlap, cfg.data.min_cut)[:16]
  fn = jax.jit(lambda p, b: build.loss_fn(parts.model, p, b, cfg.rules, chunk=256)[1])
  recall, queries = 0.0, 0.0
  for r in rows:
    a = assemble.row_arrays(data.store, data.special, cfg.seed, r, seq_len)
    batch = {f: np.asarray(a[f])[None] for f in assemble.FIELDS}
    with parts.mesh:
      sums = fn(state["params"], batch)
    recall += float(sums["indexer_recall_sum"])
    queries += float(sums["indexer_queries_sum"])
  loop.train(cfg, log=lambda *_: None)  # the sparse stage, to the end
  from maxlm.train import metrics
  sparse_rows = [r for r in metrics.read_jsonl(cfg.run_dir) if r.get("stage") == 2]
  return {"recall_demo": recall / max(queries, 1.0), "recall_demo_rows": len(rows),
          "recall_demo_topk": 64, "recall_demo_seq_len": seq_len,
          "recall_demo_sparse": float(np.mean([r["indexer_recall"] for r in sparse_rows])),
          "recall_demo_sparse_first_last": [sparse_rows[0]["indexer_recall"],
                                            sparse_rows[-1]["indexer_recall"]],
          "recall_demo_sparse_steps": len(sparse_rows), "recall_demo_sparse_topk": 256,
          "recall_demo_sparse_seq_len": cfg.stages[2].seq_len}


def case(kind, length, repeats=1, dense_impl="blockwise"):
  proc = subprocess.run([sys.executable, __file__, "--case", kind, str(length), str(repeats),
                         dense_impl], capture_output=True, text=True)
  if proc.returncode:
    return {"error": (proc.stderr.strip().splitlines() or ["killed"])[-1][:200]}
  return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--json", action="store_true")
  ap.add_argument("--lengths", type=int, nargs="*", default=[16384, 65536, 131072])
  ap.add_argument("--recall", action="store_true", help="train the demo ladder for recall_demo")
  ap.add_argument("--dense-max", type=int, default=1 << 30,
                  help="run dense blockwise only up to this length (L^2: an hour at 131072 "
                       "on a 2-core CPU)")
  ap.add_argument("--token-max", type=int, default=16384,
                  help="run the token-level variant only up to this length (it is slow)")
  ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                  help="of q, k, v and the indexer inputs (training computes in model.dtype)")
  ap.add_argument("--dense-impl", default="blockwise",
                  help="attention impl of the dense side (gpu on a GPU, splash on a TPU)")
  ap.add_argument("--repeats", type=int, default=1, help="timed runs per case (the fastest)")
  ap.add_argument("--case", nargs=4, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  os.environ["MAXLM_BENCH_DTYPE"] = args.dtype
  if args.case:
    kind, length, repeats, dense_impl = args.case
    print(json.dumps(run_case(kind, int(length), int(repeats), dense_impl)))
    return
  out = {**topk_full_diff(), "topk": TOPK}
  for length in args.lengths:
    run = lambda kind: case(kind, length, args.repeats, args.dense_impl)  # noqa: E731
    dense = run("dense") if length <= args.dense_max else {"skipped": "--dense-max"}
    sp = run("sparse_block")
    token = run("sparse") if length <= args.token_max else {"skipped": "--token-max"}
    out[f"dense_{length}"], out[f"sparse_{length}"], out[f"token_{length}"] = dense, sp, token
    if "seconds" in dense and "seconds" in sp:
      out[f"sparse_over_dense_{length}"] = sp["seconds"] / dense["seconds"]
    if "seconds" in dense and "seconds" in token:
      out[f"token_over_dense_{length}"] = token["seconds"] / dense["seconds"]
    if "peak_rss_gib" in sp:
      out[f"sparse_peak_rss_gib_{length}"] = sp["peak_rss_gib"]
    if "peak_device_gib" in sp:
      out[f"sparse_peak_device_gib_{length}"] = sp["peak_device_gib"]
    if not args.json:
      print(length, dense, sp, token, flush=True)
  if args.recall:
    with tempfile.TemporaryDirectory() as work:
      out.update(recall_demo(work))
  print(json.dumps(out, indent=2) if args.json else out)


if __name__ == "__main__":
  main()

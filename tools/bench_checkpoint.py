"""What checkpoint integrity costs: save and restore time with checksums against plain Orbax,
side by side in one run, for the demo model and the 150m model on this machine.

  python tools/bench_checkpoint.py [--sizes demo,150m] [--repeats 5] [--json]

The demo model gets the demo's 8192-piece vocabulary, 150m a 32000-piece one (--vocab N sets
both).

"plain" is what maxlm did before checksums: an Orbax CheckpointManager saving the train
state and a JSON metadata item, and restoring the state. "checked" is `maxlm.ckpt.checkpoint`:
the same items plus the arrays' CRC-32 digests computed at save, and every restored array
re-digested and compared. Both save asynchronously; a save is timed until it is committed
(`wait_until_finished`), a restore until the state is on the device and (for "checked")
verified. The two are interleaved, alternating which goes first, for at least --repeats rounds
and enough rounds for ~10 s of plain work (small states are noisy), and the ratio of the
medians is reported.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import jax
import numpy as np
import orbax.checkpoint as ocp

from maxlm import config as config_lib
from maxlm.ckpt import checkpoint, integrity
from maxlm.train import stage as stage_lib, step as step_lib


def make_state(size, vocab):
  cfg = config_lib.from_dict({"stages": [{"seq_len": 256, "batch": 8, "steps": 1}],
                              "model": {"size": size, "dtype": "float32"}})
  parts = stage_lib.parts(cfg, 0, vocab)
  shapes = jax.eval_shape(lambda: step_lib.init_state_abstract(parts.model, parts.opt, 0,
                                                                    256))
  rng = np.random.default_rng(0)

  def fill(x, sharding):
    if np.issubdtype(x.dtype, np.floating):
      value = rng.standard_normal(x.shape, np.float32).astype(x.dtype)
    else:
      value = np.zeros(x.shape, x.dtype)
    return jax.device_put(value, sharding)
  return jax.tree_util.tree_map(fill, shapes, parts.shardings)


def plain_round(folder, state, step):
  manager = ocp.CheckpointManager(folder, options=ocp.CheckpointManagerOptions(
      max_to_keep=None, enable_async_checkpointing=True, create=True))
  t = time.perf_counter()
  manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                             meta=ocp.args.JsonSave({"step": step})))
  manager.wait_until_finished()
  saved = time.perf_counter() - t
  abstract = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  t = time.perf_counter()
  manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
  restored = manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract)))["state"]
  jax.block_until_ready(restored)
  restored_s = time.perf_counter() - t
  manager.close()
  return saved, restored_s


def checked_round(folder, state, step):
  ckpts = checkpoint.Checkpoints(folder, keep=10, use_async=True, log=lambda *_: None)
  t = time.perf_counter()
  ckpts.save(step, state, {"step": step})
  ckpts.wait()
  saved = time.perf_counter() - t
  abstract = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  t = time.perf_counter()
  meta = ckpts.meta(step)
  restored = ckpts.restore(step, abstract, meta)
  jax.block_until_ready(restored)
  restored_s = time.perf_counter() - t
  ckpts.close()
  return saved, restored_s


def bench(size, vocab, repeats, root):
  state = make_state(size, vocab)
  nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(state))
  t = time.perf_counter()
  integrity.array_digests(state)
  digest_s = time.perf_counter() - t
  times = {"plain": [], "checked": []}
  order = (("plain", plain_round), ("checked", checked_round))
  r, rounds = 0, repeats + 1
  while r < rounds:  # the first round warms both paths and is dropped
    for name, fn in order if r % 2 else order[::-1]:  # alternate which goes first
      folder = os.path.join(root, f"{size}-{name}-{r}")
      result = fn(folder, state, 1)
      shutil.rmtree(folder, ignore_errors=True)
      if r:
        times[name].append(result)
      elif name == "plain":  # small states: enough rounds for ~10 s of plain saves and restores
        rounds = max(rounds, min(60, int(10 / max(sum(result), 1e-3)) + 1))
    r += 1
  med = {name: [statistics.median(t[i] for t in rounds) for i in (0, 1)]
         for name, rounds in times.items()}
  return {"size": size, "state_bytes": nbytes, "digest_s": digest_s, "rounds": rounds - 1,
          "save_s": {k: v[0] for k, v in med.items()},
          "restore_s": {k: v[1] for k, v in med.items()},
          "save_ratio": med["checked"][0] / med["plain"][0],
          "restore_ratio": med["checked"][1] / med["plain"][1]}


def hash_speeds(nbytes=256 * 2**20):
  """GB/s of the candidate digests on one buffer, on one thread (why integrity uses XXH3)."""
  import hashlib
  import zlib
  import xxhash
  data = np.random.default_rng(0).integers(0, 256, nbytes, np.uint8)
  out = {}
  for name, fn in (("xxh3_64", xxhash.xxh3_64_hexdigest), ("crc32", zlib.crc32),
                   ("sha256", lambda b: hashlib.sha256(b).digest())):
    best = min(_timed(fn, data) for _ in range(3))
    out[name] = nbytes / best / 1e9
  return out


def _timed(fn, data):
  t = time.perf_counter()
  fn(data)
  return time.perf_counter() - t


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--sizes", default="demo,150m")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--vocab", type=int, default=None)
  ap.add_argument("--dir", help="where to write (default: a temporary folder)")
  ap.add_argument("--json", action="store_true")
  args = ap.parse_args(argv)
  root = args.dir or tempfile.mkdtemp(prefix="maxlm-bench-ckpt-")
  vocab = {"demo": 8192, "tiny": 8192}
  results = [bench(size, args.vocab or vocab.get(size, 32000), args.repeats, root)
             for size in args.sizes.split(",")]
  shutil.rmtree(root, ignore_errors=True)
  speeds = hash_speeds()
  if args.json:
    print(json.dumps({"models": results, "hash_gb_per_s": speeds}))
    return 0
  print("digest speed, GB/s on one thread: " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                        speeds.items()))
  print(f"{'model':<8}{'rounds':>7}{'state':>10}{'digest':>9}{'save plain':>12}{'checked':>9}"
        f"{'ratio':>7}{'restore plain':>15}{'checked':>9}{'ratio':>7}")
  for r in results:
    print(f"{r['size']:<8}{r['rounds']:>7}{r['state_bytes'] / 2**20:>7.0f} MiB"
          f"{r['digest_s']:>8.2f}s"
          f"{r['save_s']['plain']:>11.2f}s{r['save_s']['checked']:>8.2f}s"
          f"{r['save_ratio']:>7.3f}{r['restore_s']['plain']:>14.2f}s"
          f"{r['restore_s']['checked']:>8.2f}s{r['restore_ratio']:>7.3f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

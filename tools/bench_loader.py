"""Loader benchmark: maxlm's plan+assemble vs Grain's FirstFit packing vs numpy concat-and-split.

All three get the same tokenized documents (log-normal lengths, median ~600 tokens, some
longer than L) at L = 4096, side by side in one run. maxlm and numpy read the token store (and
maxlm plans from scratch inside the timing); Grain is fed its chunks from memory, untimed. Reports real
(non-padding) tokens/s and padding fraction for each, and planner-only tokens/s.

  python tools/bench_loader.py [--docs N] [--json]
"""

import argparse
import json
import sys
import tempfile
import time

import grain
import numpy as np

from maxlm import config
from maxlm.data import loader, plan, prepare, store, tokenizer

L, BATCH = 4096, 16


def make_data(out_dir, n_docs, seed=0):
  rng = np.random.default_rng(seed)
  lengths = np.maximum(1, rng.lognormal(np.log(600), 1.0, n_docs)).astype(np.int64)
  writer = prepare.DataDirWriter(out_dir)
  for i, n in enumerate(lengths):
    writer.add("web", f"doc{i}", rng.integers(11, 32000, n, dtype=np.int32))
  writer.finish(prepare.Report(), tokenizer.DEFAULT_SPECIAL, 32000, val_fraction=0.0)
  return int(lengths.sum())


def bench_maxlm(cfg, steps):
  t0 = time.perf_counter()
  data = loader.Data(cfg)
  it = loader.iterator(data, 0)
  real = 0
  for _ in range(steps):
    real += int((next(it)["segment_ids"] > 0).sum())
  dt = time.perf_counter() - t0
  return real / dt, 1 - real / (steps * BATCH * L)


def bench_planner(cfg):
  index = store.load_index(cfg.data.dir)
  t0 = time.perf_counter()
  planner = plan.Planner(index, cfg)
  body = sum(int((blk.end - blk.start).sum())
             for blk in (planner.block(0, b) for b in range(planner.num_blocks(0))))
  return body / (time.perf_counter() - t0)


def _chunks(data_dir):
  """The documents cut into chunks of at most L tokens (what FirstFit accepts), in memory."""
  st = store.TokenStore(data_dir)
  return [{"inputs": np.array(st.read(d, a, min(a + L, int(n))))}
          for d, n in enumerate(st.index.length) for a in range(0, int(n), L)]


def bench_grain(data_dir, steps):
  chunks = _chunks(data_dir)  # Grain gets its input in memory, untimed: its best case
  t0 = time.perf_counter()
  ds = grain.MapDataset.source(chunks).shuffle(seed=0).to_iter_dataset(
      grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  ds = grain.experimental.FirstFitPackIterDataset(ds, length_struct={"inputs": L},
                                                  num_packing_bins=64, seed=0).batch(BATCH)
  it = iter(ds)
  real = 0
  for _ in range(steps):
    real += int((next(it)["inputs_segment_ids"] > 0).sum())
  dt = time.perf_counter() - t0
  return real / dt, 1 - real / (steps * BATCH * L)


def bench_numpy(data_dir, steps):
  t0 = time.perf_counter()
  st = store.TokenStore(data_dir)
  order = np.random.default_rng(0).permutation(len(st.index))
  eos = np.array([tokenizer.EOS], np.int32)
  need, parts, have = steps * BATCH * L, [], 0
  for d in order:
    parts += [st.document(d), eos]
    have += len(parts[-2]) + 1
    if have >= need:
      break
  rows = np.concatenate(parts)[:need].reshape(steps * BATCH, L)
  real = rows.size
  return real / (time.perf_counter() - t0), 0.0


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--docs", type=int, default=60_000)
  ap.add_argument("--steps", type=int, default=200)
  ap.add_argument("--json", action="store_true")
  args = ap.parse_args(argv)
  with tempfile.TemporaryDirectory() as tmp:
    tokens = make_data(tmp, args.docs)
    steps = min(args.steps, int(tokens * 0.9) // (BATCH * L))
    cfg = config.from_dict({"data": {"dir": tmp, "overlap": 0},
                            "stages": [{"seq_len": L, "batch": BATCH, "steps": steps}]})
    ours, ours_pad = bench_maxlm(cfg, steps)
    theirs, theirs_pad = bench_grain(tmp, steps)
    flat, _ = bench_numpy(tmp, steps)
    planner = bench_planner(cfg)
  result = {"maxlm_tokens_per_s": round(ours), "grain_tokens_per_s": round(theirs),
            "numpy_tokens_per_s": round(flat), "maxlm_padding": round(ours_pad, 5),
            "grain_padding": round(theirs_pad, 5), "planner_tokens_per_s": round(planner),
            "maxlm_over_grain": round(ours / theirs, 3), "steps": steps, "seq_len": L,
            "batch": BATCH}
  if args.json:
    print(json.dumps(result))
  else:
    for k, v in result.items():
      print(f"{k:>22}: {v:,}" if isinstance(v, int) else f"{k:>22}: {v}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

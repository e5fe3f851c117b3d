"""Cost of the token shards' block digests (maxlm/data/store.py): the loader reading a whole
stage's batches, with every shard block checked the first time it is read vs not checked,
side by side in one run (alternating, best of --repeats), on a demo-size data dir prepared
here from real text (the standard library's .py files and installed packages' docs, as the
demo's corpus), plus the raw speed of XXH3-64 and SHA-256 over the shard bytes.

  python tools/bench_shard_digest.py [--mb-per-source 4] [--repeats 3] [--data-dir DIR]
"""

import argparse
import hashlib
import json
import os
import tempfile
import time

import numpy as np
import xxhash
import yaml

from maxlm import config as config_lib
from maxlm.data import corpus, loader, prepare, store


def prepared(root, mb):
  raw = corpus.build(os.path.join(root, "raw"), bytes_per_source=int(mb * 1e6))
  out = os.path.join(root, "data")
  prepare.prepare(raw, out, prepare.Options(vocab_size=4096, progress=False), log=lambda *_: None)
  return out


def one_pass(cfg, checked):
  """Seconds and tokens for reading every batch of stage 0 from a fresh store (fresh checks)."""
  data = loader.Data(cfg)
  if not checked:
    data.store._check = lambda shard, a, b: data.store._checked.add(shard)
  ds = loader.stage_dataset(data, 0)
  t0 = time.perf_counter()
  tokens = 0
  for k in range(len(ds)):
    tokens += int(ds[k]["segment_ids"].astype(bool).sum())
  return time.perf_counter() - t0, tokens


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--mb-per-source", type=float, default=4.0)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--data-dir", help="an existing data dir instead of preparing one")
  args = ap.parse_args()
  root = tempfile.mkdtemp(prefix="bench-digest-")
  data_dir = args.data_dir or prepared(root, args.mb_per_source)
  manifest = store.load_manifest(data_dir)
  shards = sorted(n for n in manifest["files"] if n.startswith("tokens-"))
  total = sum(manifest["files"][n]["bytes"] for n in shards)
  sources = sorted(manifest["sources"])
  tokens = sum(manifest["sources"][s]["tokens"] for s in sources)
  seq_len, batch = 1024, 8
  steps = max(1, tokens // (seq_len * batch))  # about one pass over the training tokens
  cfg = config_lib.from_dict({"seed": 0, "data": {"dir": data_dir,
                                                  "mix": {s: 1 for s in sources}},
                              "stages": [{"seq_len": seq_len, "batch": batch, "steps": steps}]})
  blob = b"".join(open(os.path.join(data_dir, n), "rb").read() for n in shards)
  hashes = {}
  for name, fn in (("xxh3_64", xxhash.xxh3_64_hexdigest),
                   ("sha256", lambda b: hashlib.sha256(b).hexdigest())):
    t0 = time.perf_counter()
    fn(blob)
    hashes[name] = len(blob) / (time.perf_counter() - t0) / 1e9
  times = {True: [], False: []}
  for _ in range(args.repeats):
    for checked in (False, True):
      seconds, real = one_pass(cfg, checked)
      times[checked].append(seconds)
  off, on = min(times[False]), min(times[True])
  print(json.dumps({
      "data_dir": data_dir, "shards": len(shards), "shard_bytes": total,
      "blocks": sum(len(manifest["files"][n].get("xxh3_64_blocks", [1])) for n in shards),
      "stage": {"seq_len": seq_len, "batch": batch, "steps": steps, "real_tokens": real},
      "hash_GB_per_s": {k: round(v, 2) for k, v in hashes.items()},
      "loader_seconds": {"unchecked": [round(t, 3) for t in times[False]],
                         "checked": [round(t, 3) for t in times[True]]},
      "loader_tokens_per_s": {"unchecked": round(real / off), "checked": round(real / on)},
      "overhead_percent": round(100 * (on - off) / off, 2),
      "one_hash_pass_percent_of_unchecked_pass": round(
          100 * total / (hashes["xxh3_64"] * 1e9) / off, 2),
  }, indent=1))


if __name__ == "__main__":
  main()

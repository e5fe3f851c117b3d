"""Planner at scale: today's plan (v2: keyed permutations over a memory-mapped index) against the
plan before it (v1, read from git), side by side in one run, on synthetic indexes on disk.

  python tools/bench_planner_scale.py [--sizes 1e6,1e7,1e8] [--old-max 1e7] [--json]

- first batch: RSS (total, anonymous = not file-backed, peak) and seconds from opening the
  index to the pieces of batch 0 (L 4096, batch 64), each size and plan in a fresh process,
  with the index in the page cache and (cold_seconds) after evicting it; 10^9 on paper from
  the slope of the two largest sizes;
- position: a fresh process given the planner snapshot a checkpoint would hold, seconds to the
  pieces of a step, near the stage start and at row 10^6 (batch 1, L 2048 so that the snapshot
  can be made in the run); and without a snapshot (planning from the stage start);
- throughput: body tokens/s planning a stage (L 4096, batch 64), the two plans alternating;
- mix: padding and quota error of a two-source mix (0.7/0.3) for both plans;
- permutation: ns per index of permute.permute (a window at a time) and Grain's index_shuffle.

The synthetic index (log-normal lengths, median ~600 tokens) is written with numpy in chunks
straight into the index files maxlm prepare writes (index_files.py), without token shards, so
only planning is measured. v1 beyond --old-max is not run: it holds ~110 bytes per document.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import types

import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

OLD_PLAN = "6905835"  # the last commit planning v1
CHUNK = 1 << 22


def rss():
  """{total, anon, peak} MiB of this process (anon: not file-backed, so no mapped index)."""
  fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
  kib = lambda k: int(fields[k].split()[0]) / 1024
  return {"total": kib("VmRSS"), "anon": kib("RssAnon"), "peak": kib("VmHWM")}


def make_index(path, n, n_sources=1, seed=0):
  """The index files of n synthetic documents (one or two sources), written in chunks."""
  from maxlm.data import index_files
  path = pathlib.Path(path)
  meta_path = path / index_files.META
  if meta_path.exists() and json.loads(meta_path.read_text())["documents"] == n:
    return str(path)
  path.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(seed)
  out = {}

  def create(field, dtype, shape):
    out[field] = np.lib.format.open_memmap(path / index_files.file_name(field), "w+", dtype,
                                           (shape,))
    return out[field]

  length = create("length", np.int32, n)
  for a in range(0, n, CHUNK):
    b = min(a + CHUNK, n)
    length[a:b] = np.maximum(1, rng.lognormal(np.log(600), 1.0, b - a)).astype(np.int32)
  source, offset = create("source", np.int32, n), create("offset", np.int64, n)
  total, tokens = 0, np.zeros(n_sources, np.int64)
  for a in range(0, n, CHUNK):
    b = min(a + CHUNK, n)
    lens = length[a:b].astype(np.int64)
    offset[a:b] = total + np.cumsum(lens) - lens
    total += int(lens.sum())
    source[a:b] = (np.arange(a, b) % 3 == 0) if n_sources == 2 else 0
    tokens += np.bincount(source[a:b], weights=lens, minlength=n_sources).astype(np.int64)
  create("shard", np.int32, n)[:] = 0
  create("split", np.uint8, n)[:] = 0
  nbytes = create("nbytes", np.int64, n)
  for a in range(0, n, CHUNK):
    nbytes[a:a + CHUNK] = 4 * length[a:a + CHUNK]
  for field in ("bound_ptr", "nolos_ptr"):
    create(field, np.int64, n + 1)[:] = 0
  for field, dtype in (("bound_pos", np.int32), ("bound_level", np.int8),
                       ("nolos_start", np.int32), ("nolos_end", np.int32)):
    create(field, dtype, 0)
  create("lang_score", np.float16, n)[:] = np.nan
  create("chat", np.bool_, n)[:] = False
  pool_docs = create("pool_docs", np.uint32, n)
  at = 0
  for s in range(n_sources):
    for a in range(0, n, CHUNK):
      ids = np.arange(a, min(a + CHUNK, n), dtype=np.uint32)
      ids = ids[source[a:a + CHUNK] == s]
      pool_docs[at:at + len(ids)] = ids
      at += len(ids)
  counts = np.array([(source_count(source, s)) for s in range(n_sources)], np.int64)
  create("pool_ptr", np.int64, n_sources + 1)[:] = np.concatenate([[0], np.cumsum(counts)])
  create("pool_tokens", np.int64, n_sources)[:] = tokens
  ptr = create(index_files.ID_PTR, np.int64, n + 1)
  ptr[:] = 10 * np.arange(n + 1, dtype=np.int64)  # ids: 10 decimal digits each
  with open(path / index_files.IDS, "wb") as f:
    for a in range(0, n, CHUNK):
      i = np.arange(a, min(a + CHUNK, n), dtype=np.int64)
      digits = (i[:, None] // 10 ** np.arange(9, -1, -1)) % 10 + ord("0")
      f.write(digits.astype(np.uint8).tobytes())
  for array in out.values():
    array.flush()
  del out
  names = ["web", "code"][:n_sources]
  meta_path.write_text(json.dumps({"format": index_files.FORMAT, "documents": n,
                                   "sources": names}))
  return str(path)


def source_count(source, s):
  return sum(int((source[a:a + CHUNK] == s).sum()) for a in range(0, len(source), CHUNK))


def old_plan_module():
  """The v1 planner, from git, as a module (None when git or the commit is not there)."""
  try:
    src = subprocess.run(["git", "show", f"{OLD_PLAN}:maxlm/data/plan.py"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
  except (OSError, subprocess.CalledProcessError):
    return None
  module = types.ModuleType("maxlm_plan_v1")
  sys.modules[module.__name__] = module
  exec(compile(src, "plan_v1.py", "exec"), module.__dict__)
  return module


def plan_module(which):
  if which == "old":
    return old_plan_module()
  from maxlm.data import plan
  return plan


def make_config(index_dir, L, batch, steps, mix=None):
  from maxlm import config
  return config.from_dict({"data": {"dir": index_dir, **({"mix": mix} if mix else {})},
                           "stages": [{"seq_len": L, "batch": batch, "steps": steps}]})


def child(args):
  """One measurement in this fresh process; prints its JSON."""
  from maxlm.data import store
  mod = plan_module(args.plan)
  base = rss()
  t0 = time.perf_counter()
  index = store.load_index(args.index)
  if args.child == "first_batch":
    cfg = make_config(args.index, 4096, 64, 100_000)
    planner = mod.Planner(index, cfg)
    pieces = planner.rows(0, 0, 64)
    out = {"seconds": time.perf_counter() - t0, "pieces": sum(map(len, pieces))}
  else:
    cfg = make_config(args.index, 2048, 1, args.step + 1)
    planner = mod.Planner(index, cfg)
    if args.snapshot:
      snap = json.loads(pathlib.Path(args.snapshot).read_text())
      planner.seed_snapshot(mod.Snapshot(**snap))
    pieces = planner.rows(0, args.step, 1)
    out = {"seconds": time.perf_counter() - t0, "pieces": sum(map(len, pieces))}
  now = rss()
  out.update({f"rss_{k}_mib": round(now[k], 1) for k in now},
             **{f"rss_{k}_growth_mib": round(now[k] - base[k], 1) for k in ("total", "anon")})
  out["seconds"] = round(out["seconds"], 3)
  print(json.dumps(out))


def run_child(*argv):
  proc = subprocess.run([sys.executable, __file__, *map(str, argv)], capture_output=True,
                        text=True, cwd=REPO)
  if proc.returncode:
    raise RuntimeError(proc.stderr[-2000:])
  return json.loads(proc.stdout.strip().splitlines()[-1])


def evict(path):
  """Drops a folder's files from the page cache (this machine's only: a cold start)."""
  for f in pathlib.Path(path).iterdir():
    fd = os.open(f, os.O_RDONLY)
    try:
      os.fsync(fd)
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
      os.close(fd)


def first_batches(indexes, old_max):
  rows = []
  for n, path in indexes.items():
    for which in ("new", "old"):
      if which == "old" and n > old_max:
        continue
      warm = run_child("--child", "first_batch", "--index", path, "--plan", which)
      evict(path)
      cold = run_child("--child", "first_batch", "--index", path, "--plan", which)
      rows.append({"docs": n, "plan": which, **warm, "cold_seconds": cold["seconds"]})
  return rows


def projection(rows, which, target=10**9):
  """Anonymous RSS and seconds at `target` documents from the two largest measured sizes."""
  got = sorted((r for r in rows if r["plan"] == which), key=lambda r: r["docs"])[-2:]
  if len(got) < 2:
    return None
  (a, b), out = got, {"from_docs": [got[0]["docs"], got[1]["docs"]], "docs": target}
  for key in ("rss_anon_growth_mib", "seconds", "rss_total_mib"):
    slope = (b[key] - a[key]) / (b["docs"] - a["docs"])
    out[key] = round(b[key] + slope * (target - b["docs"]), 1)
    out[key.replace("_mib", "") + "_per_1e8_docs"] = round(slope * 1e8, 2)
  return out


def throughput(index_dir, blocks, rounds=4):
  """Body tokens/s planning `blocks` blocks of a stage, v2 and v1 alternating; best round."""
  from maxlm.data import store
  index = store.load_index(index_dir)
  cfg = make_config(index_dir, 4096, 64, blocks * 64)
  best = {}
  for _ in range(rounds):
    for which in ("new", "old"):
      mod = plan_module(which)
      if mod is None:
        continue
      t0 = time.perf_counter()
      planner = mod.Planner(index, cfg)
      body = sum(int((planner.block(0, b).end - planner.block(0, b).start).sum())
                 for b in range(planner.num_blocks(0)))
      best[which] = max(best.get(which, 0), body / (time.perf_counter() - t0))
  return {f"{k}_tokens_per_s": round(v) for k, v in best.items()}


def position(index_dir, far, near):
  """Seconds for a fresh process to reach row `near` and row `far` from the snapshot a
  checkpoint would hold, and to reach `near` without one; per plan."""
  from dataclasses import asdict
  from maxlm.data import store
  index = store.load_index(index_dir)
  out = {}
  with tempfile.TemporaryDirectory() as tmp:
    for which in ("new", "old"):
      mod = plan_module(which)
      if mod is None:
        continue
      cfg = make_config(index_dir, 2048, 1, far + 1)
      planner = mod.Planner(index, cfg)
      res = {}
      for step in (near, far):
        t0 = time.perf_counter()
        snap = planner.snapshot(0, step // cfg.data.block_rows)
        made = time.perf_counter() - t0
        path = pathlib.Path(tmp) / f"{which}-{step}.json"
        path.write_text(json.dumps(asdict(snap)))
        got = run_child("--child", "position", "--index", index_dir, "--plan", which,
                        "--step", step, "--snapshot", path)
        res[f"row_{step}_from_snapshot_s"] = got["seconds"]
        res[f"row_{step}_snapshot_rss_anon_growth_mib"] = got["rss_anon_growth_mib"]
        res[f"planning_to_row_{step}_s"] = round(made, 2)
      got = run_child("--child", "position", "--index", index_dir, "--plan", which,
                      "--step", near)
      res[f"row_{near}_without_snapshot_s"] = got["seconds"]
      res[f"row_{far}_without_snapshot_s_projected"] = round(
          got["seconds"] * far / max(near, 1), 1)
      out[which] = res
  return out


def mix_accuracy(index_dir, blocks):
  """Padding fraction and quota error (worst drift in pieces, final share error) per plan."""
  from maxlm.data import chunk, store
  index = store.load_index(index_dir)
  quotas = {"web": 0.7, "code": 0.3}
  cfg = make_config(index_dir, 4096, 64, blocks * 64, quotas)
  out = {}
  for which in ("new", "old"):
    mod = plan_module(which)
    if mod is None:
      continue
    planner = mod.Planner(index, cfg)
    q = np.array([quotas[n] for n in index.sources])
    taken, used, rows, largest, drift = np.zeros(2), 0, 0, 1, 0.0
    for b in range(planner.num_blocks(0)):
      blk = planner.block(0, b)
      body = (blk.end - blk.start).astype(np.int64)
      n = index.length[blk.doc]
      used += sum(chunk.positions(int(blk.start[k] == 0), int(blk.ctx[k]), int(body[k]),
                                  int(blk.end[k] == n[k]), int(blk.fim[k]))
                  for k in range(len(body)))
      rows += len(blk.row_ptr) - 1
      row_of = np.repeat(np.argsort(np.argsort(blk.order)), np.diff(blk.row_ptr))
      per_row = np.zeros((len(blk.row_ptr) - 1, 2))
      np.add.at(per_row, (row_of, blk.pool.astype(np.int64)), body)
      cum = taken + np.cumsum(per_row, axis=0)
      largest = max(largest, int(body.max()))
      drift = max(drift, float(np.abs(cum - np.outer(cum.sum(1), q)).max()) / largest)
      taken = cum[-1]
    out[which] = {"padding": round(1 - used / (rows * 4096), 5),
                  "worst_quota_drift_pieces": round(drift, 3),
                  "final_share_error": round(float(np.abs(taken / taken.sum() - q).max()), 6)}
  return out


def permutation_speed(n=10**8, count=1 << 16):
  from maxlm.data import permute
  keys = permute.round_keys("bench", 0)
  t0 = time.perf_counter()
  for a in range(0, count, 4096):
    permute.permute(n, keys, np.arange(a, a + 4096))
  ours = (time.perf_counter() - t0) / count * 1e9
  out = {"permute_ns_per_index": round(ours, 1)}
  try:
    from grain.experimental import index_shuffle
  except ImportError:
    return out
  t0 = time.perf_counter()
  for i in range(count // 8):
    index_shuffle(i, max_index=n - 1, seed=0, rounds=4)
  out["grain_index_shuffle_ns_per_index"] = round((time.perf_counter() - t0) / (count // 8) * 1e9,
                                                  1)
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--sizes", default="1e6,1e7,1e8")
  ap.add_argument("--old-max", type=float, default=1e7)
  ap.add_argument("--far", type=int, default=10**6, help="row to position at")
  ap.add_argument("--blocks", type=int, default=12, help="blocks of 64x4096 tokens to plan")
  ap.add_argument("--dir", help="where the synthetic indexes go (kept; default: a temp dir)")
  ap.add_argument("--json", action="store_true")
  ap.add_argument("--child", choices=["first_batch", "position"])
  ap.add_argument("--index")
  ap.add_argument("--plan", default="new")
  ap.add_argument("--step", type=int, default=0)
  ap.add_argument("--snapshot")
  args = ap.parse_args(argv)
  if args.child:
    return child(args) or 0
  sizes = [int(float(x)) for x in args.sizes.split(",")]
  with tempfile.TemporaryDirectory() as tmp:
    root = pathlib.Path(args.dir or tmp)
    indexes = {n: make_index(root / f"docs-{n}", n) for n in sizes}
    two = make_index(root / "two-sources", 10**6, n_sources=2, seed=1)
    small = indexes[min(sizes, key=lambda n: abs(n - 10**7))]
    first = first_batches(indexes, args.old_max)
    result = {
        "first_batch": first,
        "projected_1e9": {w: projection(first, w) for w in ("new", "old")},
        "position": position(small, args.far, 10**4),
        "throughput": throughput(indexes[min(sizes)], args.blocks),
        "mix": mix_accuracy(two, args.blocks),
        "permutation": permutation_speed(),
    }
  if args.json:
    print(json.dumps(result))
  else:
    print(json.dumps(result, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())

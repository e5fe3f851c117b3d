"""Packing on real text: maxlm's planner against Grain's BestFit and FirstFit, side by side.

Documents are this machine's text (the standard library's .py files, site-packages .md/.rst/.txt
and METADATA, man pages, /usr/share/doc), one source each, through `maxlm prepare` (its
tokenizer, section-aware boundaries, no quality steps). Per row length L (1024, 4096, 16384),
with the demo's data settings (overlap 16, lookahead 64, FIM 0.1 on code) and batch 64:

- maxlm: the planner (and, for reference, the previous plan version read from git) plans one
  stage; padding and loss-masked context as fractions of row positions, body tokens/s (best
  of 3, the two plans alternating);
- grain_docs_*: Grain's BestFitPackIterDataset / FirstFitPackIterDataset (64 bins, the batch)
  on the same documents ([BOS] doc [EOS]) cut at L, with no overlap;
- grain_pieces_*: the same packers on exactly our planner's pieces (shuffled), and on the
  section-aware pieces our cutter makes before any row filling (`chunk.cut` at L).

Grain packs the same number of rows as our stage, from elements made in memory beforehand,
untimed (its best case); its padding is over those rows only (not the flush at the end of its
input), its tokens/s are non-padding positions per second of packing. Ours are body tokens per
second of planning (lengths only; tools/bench_loader.py times reading and assembly too).
`cuts` counts the pieces that end before their document by the boundary they end at
(in_word: none). With --sections, also the seconds per MB finding boundaries (sections.py,
today's and the previous plan's) and the index entries per token they make. With
--synthetic N, also planner throughput, this plan and the previous one alternating, on
tools/bench_planner_scale.py's synthetic index of N documents (L 4096, batch 64, no
boundaries). Prints one JSON object.

  python tools/bench_packing.py [--mb 3] [--data DIR] [--lengths 1024,4096,16384] [--show 2]
                                [--overlap 32] [--fim-rate 0] [--sections] [--synthetic 1000000]
"""

import argparse
import gzip
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import sysconfig
import tempfile
import time
import types

import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from maxlm import config  # noqa: E402
from maxlm.data import chunk, plan, prepare, store  # noqa: E402

OLD_PLAN = "55aff9d"  # the last commit planning v2
BATCH, BINS = 64, 64
ROUNDS = 3  # planning is timed best of 3, the two plans alternating
MAX_FILE_BYTES = 100_000  # compressed man pages and changelogs count compressed
DATA_SETTINGS = {"overlap": 16, "lookahead": 64, "shuffle_rows": 64, "block_rows": 1024,
                 "fim": {"rate": 0.1, "spm": 0.5, "sources": ["code"]}}


def _files(kind):
  """(sort key, id, path) of this machine's files of one kind."""
  paths = sysconfig.get_paths()
  if kind == "code":
    roots, keep = [paths["stdlib"]], lambda p: p.suffix == ".py" and "site-packages" not in p.parts
  elif kind == "docs":
    roots = [paths["purelib"]]
    keep = lambda p: p.suffix in (".md", ".rst", ".txt") or p.name == "METADATA"
  elif kind == "man":
    roots = [f"/usr/share/man/man{i}" for i in range(1, 9)]
    keep = lambda p: p.suffix == ".gz"
  else:
    roots = ["/usr/share/doc"]
    keep = lambda p: (p.name.startswith(("README", "changelog", "NEWS", "copyright"))
                      or p.suffix in (".txt", ".md"))
  for root in roots:
    for p in sorted(pathlib.Path(root).rglob("*")) if os.path.isdir(root) else ():
      if p.is_file() and keep(p) and p.stat().st_size < MAX_FILE_BYTES:
        rel = str(p.relative_to(root))
        yield hashlib.sha1(rel.encode()).hexdigest(), f"{kind}/{rel}", p


def build_corpus(raw_dir, bytes_per_source):
  """One JSON Lines file per source under raw_dir (`code` ids keep their .py suffix)."""
  out = []
  for kind in ("code", "docs", "man", "doc"):
    lines, total = [], 0
    for _, doc_id, path in sorted(_files(kind)):
      try:
        raw = path.read_bytes()
        text = (gzip.decompress(raw) if path.suffix == ".gz" else raw).decode("utf-8")
      except (UnicodeDecodeError, OSError, EOFError, gzip.BadGzipFile):
        continue
      if not text.strip():
        continue
      doc_id = doc_id[:-3] if doc_id.endswith(".gz") else doc_id
      lines.append(json.dumps({"id": doc_id, "source": kind, "text": text}))
      total += len(text)
      if total >= bytes_per_source:
        break
    if lines:  # a machine without man pages or /usr/share/doc has fewer sources
      path = pathlib.Path(raw_dir) / f"{kind}.jsonl"
      path.write_text("\n".join(lines) + "\n")
      out.append(str(path))
  return out


def prepared(data_dir, bytes_per_source, vocab_size=4096):
  """A data dir of this machine's text (reused when data_dir already holds one)."""
  if (pathlib.Path(data_dir) / "manifest.json").exists():
    return data_dir
  os.makedirs(data_dir, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(data_dir))) as raw:
    inputs = build_corpus(raw, bytes_per_source)
    prepare.prepare(inputs, data_dir,
                    prepare.Options(vocab_size=vocab_size, val_fraction=0.0, progress=False,
                                    overwrite=True), log=lambda *a, **k: None)
  return data_dir


def stage_config(data_dir, L, rows):
  return config.from_dict({"seed": 0, "data": {"dir": data_dir, **DATA_SETTINGS},
                           "stages": [{"seq_len": L, "batch": BATCH, "steps": rows // BATCH}]})


def old_plan_module():
  """The previous plan (plan.py and chunk.py from git at OLD_PLAN), or None without git."""
  def source(name):
    return subprocess.run(["git", "show", f"{OLD_PLAN}:maxlm/data/{name}.py"], cwd=REPO,
                          capture_output=True, text=True, check=True).stdout
  try:
    chunk_src, plan_src = source("chunk"), source("plan")
  except (OSError, subprocess.CalledProcessError):
    return None
  old_chunk, module = types.ModuleType("chunk_old"), types.ModuleType("plan_old")
  exec(compile(chunk_src, "chunk_old.py", "exec"), old_chunk.__dict__)
  exec(compile(plan_src, "plan_old.py", "exec"), module.__dict__)
  module.chunk = old_chunk  # its own cutter, not today's
  return module


def plan_stage(plan_module, index, cfg):
  """Pieces [(positions, body, ctx, doc, start, end)] of every row, and planning seconds."""
  t0 = time.perf_counter()
  planner = plan_module.Planner(index, cfg)
  blocks = [planner.block(0, b) for b in range(planner.num_blocks(0))]
  seconds = time.perf_counter() - t0
  rows = []
  for blk in blocks:
    bos = (blk.start == 0).astype(np.int64)
    eos = (blk.end == index.length[blk.doc]).astype(np.int64)
    body = (blk.end - blk.start).astype(np.int64)
    size = bos + blk.ctx + body + eos + np.where(blk.fim > 0, chunk.FIM_MARKERS, 0) - 1
    for r in range(len(blk.row_ptr) - 1):
      a, b = blk.row_ptr[r], blk.row_ptr[r + 1]
      rows.append([(int(size[k]), int(body[k]), int(blk.ctx[k]), int(blk.doc[k]),
                    int(blk.start[k]), int(blk.end[k])) for k in range(a, b)])
  return rows, seconds


def cut_levels(index, rows):
  """How many pieces end before their document does, and how many of those at each boundary
  level (sections.py), or inside a word (at no recorded boundary)."""
  counts = {}
  for row in rows:
    for _, _, _, doc, _, end in row:
      if end < index.length[doc]:
        pos, lvl = index.bounds(doc)
        k = int(np.searchsorted(pos, end))
        name = LEVELS[int(lvl[k])] if k < len(pos) and pos[k] == end else "in_word"
        counts[name] = counts.get(name, 0) + 1
  return counts


LEVELS = {2: "section", 1: "paragraph", -1: "line", -2: "sentence", -3: "word"}


def our_result(rows, seconds, L):
  positions = len(rows) * L
  used = sum(p[0] for row in rows for p in row)
  body = sum(p[1] for row in rows for p in row)
  return {"padding": round(1 - used / positions, 5),
          "context": round(sum(p[2] for row in rows for p in row) / positions, 5),
          "pieces_per_row": round(sum(map(len, rows)) / len(rows), 2),
          "tokens_per_s": round(body / seconds)}


def grain_pack(sizes, L, rows, packer):
  """Padding and tokens/s of a Grain packer on elements of `sizes` positions, over `rows` rows."""
  import grain
  from grain import experimental
  elements = [{"inputs": np.ones(n, np.int32)} for n in sizes]
  ds = grain.MapDataset.source(elements).shuffle(seed=0).to_iter_dataset(
      grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  cls = {"best_fit": experimental.BestFitPackIterDataset,
         "first_fit": experimental.FirstFitPackIterDataset}[packer]
  it = iter(cls(ds, length_struct={"inputs": L}, num_packing_bins=BINS, seed=0))
  t0 = time.perf_counter()
  used = 0
  for _ in range(rows):
    used += int((next(it)["inputs_segment_ids"] > 0).sum())
  seconds = time.perf_counter() - t0
  return {"padding": round(1 - used / (rows * L), 5), "tokens_per_s": round(used / seconds)}


def doc_sizes(index, L):
  """Positions of each document ([BOS] doc [EOS] fills n + 1) cut at L, no overlap."""
  out = []
  for n in (index.length[index.pool_docs] + 1).tolist():
    out += [L] * (n // L) + ([n % L] if n % L else [])
  return out


def section_sizes(index, L, overlap):
  """Positions of each document's pieces as `chunk.cut` makes them before any row filling."""
  out = []
  for d in index.pool_docs.tolist():
    n = int(index.length[d])
    pos, lvl = index.bounds(d)
    for a, b, ctx in chunk.cut(n, 0, n, pos, lvl, L + 1, overlap, 0.5):
      out.append(chunk.positions(int(a == 0), ctx, b - a, int(b == n), 0))
  return out


def compare(data_dir, L, old=None, fraction=0.9):
  """Everything side by side at one row length: {name: {padding, tokens_per_s, ...}}."""
  index = store.load_index(data_dir)
  rows = max(BATCH, int(fraction * int(index.pool_tokens.sum()) / L) // BATCH * BATCH)
  cfg = stage_config(data_dir, L, rows)
  plans = {"maxlm": plan, **({f"maxlm_v{old.VERSION}": old} if old is not None else {})}
  planned, seconds = {}, {}
  for _ in range(ROUNDS):  # the plans alternate; the best round counts
    for name, module in plans.items():
      planned[name], took = plan_stage(module, index, cfg)
      seconds[name] = min(seconds.get(name, took), took)
  out = {"rows": rows}
  for name, got in planned.items():
    out[name] = {**our_result(got, seconds[name], L), "cuts": cut_levels(index, got)}
  ours = planned["maxlm"]
  pieces = [p[0] for row in ours for p in row]
  inputs = {"docs": doc_sizes(index, L), "pieces": pieces,
            "section_pieces": section_sizes(index, L, cfg.data.overlap)}
  for name, sizes in inputs.items():
    for packer in ("best_fit", "first_fit"):
      out[f"grain_{name}_{packer}"] = grain_pack(sizes, L, min(rows, _fillable(sizes, L)),
                                                 packer)
  return out, ours


def _fillable(sizes, L):
  """Rows Grain can fill from `sizes` before its input runs low (the tail flush is not counted)."""
  return max(1, int(0.9 * sum(sizes) / L))


def show_rows(data_dir, L, rows, count):
  """The first `count` rows' pieces, decoded: where each piece starts and ends."""
  from maxlm.data import tokenizer
  st = store.TokenStore(data_dir)
  sp = tokenizer.load((pathlib.Path(data_dir) / "tokenizer.model").read_bytes())
  ids = store.load_doc_ids(data_dir)
  for r, row in enumerate(rows[:count]):
    print(f"--- row {r}: {sum(p[0] for p in row)} of {L} positions", file=sys.stderr)
    for size, body, ctx, doc, start, end in row:
      text = sp.decode(st.read(doc, start, end).tolist())
      print(f"  [{ids[doc]} {start}:{end} of {int(st.index.length[doc])}, ctx {ctx}] "
            f"{text[:60]!r} ... {text[-60:]!r}", file=sys.stderr)


def synthetic_throughput(n_docs, old, blocks=12, rounds=3):
  """Body tokens/s planning `blocks` blocks of 4096 rows of L 4096, best of `rounds`, the two
  plans alternating in this process."""
  sys.path.insert(0, str(REPO / "tools"))
  import bench_planner_scale
  with tempfile.TemporaryDirectory() as tmp:
    index = store.load_index(bench_planner_scale.make_index(f"{tmp}/index", n_docs))
    cfg = bench_planner_scale.make_config(f"{tmp}/index", 4096, 64, blocks * 64)
    best = {}
    for _ in range(rounds):
      for name, module in ((f"v{plan.VERSION}", plan), (f"v{old.VERSION}", old)):
        t0 = time.perf_counter()
        planner = module.Planner(index, cfg)
        body = sum(int((blk.end - blk.start).sum()) for blk in (
            planner.block(0, b) for b in range(planner.num_blocks(0))))
        best[name] = max(best.get(name, 0), round(body / (time.perf_counter() - t0)))
  return {"documents": n_docs, "tokens_per_s": best}


def boundary_cost(bytes_per_source, data_dir):
  """Seconds per MB finding the boundaries (sections.py, today's and the previous plan's) of the
  same corpus, and the index entries they add per token of data_dir."""
  from maxlm.data import sections
  old = types.ModuleType("sections_old")
  exec(compile(subprocess.run(["git", "show", f"{OLD_PLAN}:maxlm/data/sections.py"], cwd=REPO,
                              capture_output=True, text=True, check=True).stdout,
               "sections_old.py", "exec"), old.__dict__)
  with tempfile.TemporaryDirectory() as raw:
    docs = [json.loads(line) for path in build_corpus(raw, bytes_per_source)
            for line in open(path)]
  mb = sum(len(d["text"].encode()) for d in docs) / 1e6
  out = {"mb": round(mb, 2)}
  for name, module in (("today", sections), ("previous", old)) * 2:
    t0 = time.perf_counter()
    count = sum(len(module.boundaries(d["text"], "code" if d["source"] == "code" else "prose"))
                for d in docs)
    out[f"{name}_s_per_mb"] = round(min(out.get(f"{name}_s_per_mb", 1e9),
                                        (time.perf_counter() - t0) / mb), 4)
    out[f"{name}_boundaries"] = count
  index = store.load_index(data_dir)
  out["index_entries_per_token"] = round(len(index.bound_pos) / int(index.length.sum()), 4)
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--mb", type=float, default=3.0, help="MB of text per source")
  ap.add_argument("--data", help="a data dir to make (or reuse) instead of a temporary one")
  ap.add_argument("--lengths", default="1024,4096,16384")
  ap.add_argument("--show", type=int, default=0, help="decode this many rows per L to stderr")
  ap.add_argument("--no-old", action="store_true", help="skip the previous plan version")
  ap.add_argument("--overlap", type=int, help="data.overlap instead of the demo's 16")
  ap.add_argument("--fim-rate", type=float, help="data.fim.rate instead of the demo's 0.1")
  ap.add_argument("--sections", action="store_true",
                  help="also the cost of finding boundaries, today's and the previous")
  ap.add_argument("--synthetic", type=int, default=0,
                  help="also planner throughput on a synthetic index of this many documents")
  args = ap.parse_args(argv)
  if args.overlap is not None:
    DATA_SETTINGS["overlap"] = args.overlap
  if args.fim_rate is not None:
    DATA_SETTINGS["fim"] = {**DATA_SETTINGS["fim"], "rate": args.fim_rate}
  with tempfile.TemporaryDirectory() as tmp:
    data_dir = prepared(args.data or f"{tmp}/data", int(args.mb * 1e6))
    index = store.load_index(data_dir)
    result = {"documents": int(len(index.pool_docs)), "tokens": int(index.pool_tokens.sum()),
              "sources": list(index.sources), "batch": BATCH, "bins": BINS,
              "plan_version": plan.VERSION, "data": DATA_SETTINGS}
    old = None if args.no_old else old_plan_module()
    for L in map(int, args.lengths.split(",")):
      result[str(L)], rows = compare(data_dir, L, old)
      if args.show:
        show_rows(data_dir, L, rows, args.show)
    if args.sections:
      result["sections"] = boundary_cost(int(args.mb * 1e6), data_dir)
  if args.synthetic and old is not None:
    result["synthetic"] = synthetic_throughput(args.synthetic, old)
  print(json.dumps(result, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())

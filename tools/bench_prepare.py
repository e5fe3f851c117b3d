"""`maxlm prepare` with the quality steps: throughput, peak memory, and near-dup quality.

  python tools/bench_prepare.py [--json] [--mb 32] [--workers 2] [--big-mb 100,300]

1. Builds a web-like corpus of about --mb MB from text on this machine (Python's own docs
   for English, translation catalogs for other languages, plus navigation/spam/lorem pages,
   exact copies and near-copies with true 5-gram Jaccard computed for each).
2. Runs, side by side: prepare with every quality step, prepare with them off (tokenizing
   only), and the quality steps alone; reports MB/s per core of each.
3. Near-dup recall at true J >= 0.8 and the false-positive rate (distinct documents removed as
   duplicates) on the planted set.
4. With --big-mb N,M: the peak RSS of a prepare over N and over M MB of input (a child process
   each, by the kernel's ru_maxrss: the main process, and the largest worker), to show that
   memory does not grow with the input.
Where datatrove is installed, its Gopher quality + repetition + C4 filters run on the same
documents for comparison (docs/s).
"""

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from maxlm.data import prepare, quality  # noqa: E402
from maxlm.data.quality import select  # noqa: E402

import test_data_quality as planted  # noqa: E402  (the tests' corpus builders)


def build_corpus(path, mb, seed=0):
  """Writes the corpus; returns the near-copies' (id, original id, true J) and distinct ids."""
  rng = random.Random(seed)
  base = planted.english_docs(90, words=250)
  foreign = planted.foreign_docs(5)
  near, distinct, size, n = [], [], 0, 0
  with open(path, "w") as f:
    while size < mb * 1e6:
      for i, text in enumerate(base):
        kind = rng.random()
        if n < len(base):
          doc, distinct_id = text, f"d{n}"
          distinct.append(distinct_id)
        elif kind < 0.5:  # a copy of a base page with a few words changed and a footer
          doc = planted.perturb(text, rng, fraction=rng.choice((0.004, 0.008, 0.015, 0.03)))
          near.append((f"d{n}", f"d{i}", planted.jaccard(text, doc)))
        elif kind < 0.7:
          doc = text
        elif kind < 0.85:
          doc = rng.choice(list(planted.JUNK.values()))
        else:
          doc = rng.choice(foreign)
        row = json.dumps({"id": f"d{n}", "text": doc, "source": "web"})
        f.write(row + "\n")
        size += len(row)
        n += 1
  return near, distinct


def timed_prepare(inp, out, config, workers):
  t = time.perf_counter()
  manifest = prepare.prepare([inp], out,
                             prepare.Options(vocab_size=2000, workers=workers, progress=False,
                                             quality=config, rejected=out + ".rejected.jsonl"))
  return time.perf_counter() - t, manifest


def filters_only(inp, workers):
  from maxlm.data.documents import Report, iter_documents
  t = time.perf_counter()
  spill, funnel = select.run(iter_documents([inp], Report()),
                             quality_lib_inspector(), workers)
  os.unlink(spill)
  return time.perf_counter() - t


def quality_lib_inspector():
  return quality.Inspector(quality.QualityConfig())


def datatrove_docs_per_s(inp, limit=400):
  try:
    from datatrove.data import Document
    from datatrove.pipeline.filters import (C4QualityFilter, GopherQualityFilter,
                                            GopherRepetitionFilter)
  except ImportError:
    return None
  filters = [GopherRepetitionFilter(), GopherQualityFilter(), C4QualityFilter()]
  docs = [json.loads(line)["text"] for _, line in zip(range(limit), open(inp))]
  t = time.perf_counter()
  for i, text in enumerate(docs):
    for f in filters:
      if f.filter(Document(text=text, id=str(i))) is not True:
        break
  return len(docs) / (time.perf_counter() - t)


def peak_rss_mb(mb, workers):
  code = ("import resource, sys, tempfile, os; sys.path.insert(0, 'tools'); "
          "import bench_prepare as b; d = tempfile.mkdtemp(); p = os.path.join(d, 'in.jsonl'); "
          f"b.build_corpus(p, {mb}); "
          "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; "
          f"b.timed_prepare(p, os.path.join(d, 'out'), b.quality.QualityConfig(), {workers}); "
          "print(base, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "
          "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
  root = os.path.join(os.path.dirname(__file__), "..")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                       env={**os.environ, "TQDM_DISABLE": "1"}, check=True).stdout.split()
  return {"input_mb": mb, "main_peak_mb": int(out[1]) / 1024,
          "worker_peak_mb": int(out[2]) / 1024}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--mb", type=float, default=32)
  ap.add_argument("--workers", type=int, default=os.cpu_count())
  ap.add_argument("--big-mb", default="", help="comma-separated input sizes for peak RSS")
  ap.add_argument("--json", action="store_true")
  args = ap.parse_args(argv)
  work = tempfile.mkdtemp(prefix="maxlm-bench-prepare-")
  inp = os.path.join(work, "in.jsonl")
  near, distinct = build_corpus(inp, args.mb)
  mb = os.path.getsize(inp) / 1e6
  full_s, manifest = timed_prepare(inp, os.path.join(work, "full"), quality.QualityConfig(),
                                   args.workers)
  plain_s, _ = timed_prepare(inp, os.path.join(work, "plain"), quality.OFF, args.workers)
  filter_s = filters_only(inp, args.workers)
  removed = {r["id"]: r for r in map(json.loads, open(os.path.join(work, "full.rejected.jsonl")))}
  alive = [(c, o, j) for c, o, j in near if j >= 0.8 and o not in removed]
  recall = (sum(removed.get(c, {}).get("step") == "near_dup" for c, _, _ in alive)
            / max(len(alive), 1))
  false = sum(removed.get(d, {}).get("step") in ("near_dup", "exact_dup") for d in distinct)
  result = {
      "input_mb": mb, "workers": args.workers,
      "mb_per_s_per_core": {"prepare_with_quality": mb / full_s / args.workers,
                            "prepare_without_quality": mb / plain_s / args.workers,
                            "quality_steps_only": mb / filter_s / args.workers},
      "ratio_with_to_without": full_s / plain_s,
      "near_dup_recall_at_J_0.8": recall, "near_dup_pairs": len(alive),
      "false_positive_rate": false / len(distinct),
      "kept_documents": manifest["funnel"]["kept"]["documents"],
      "input_documents": manifest["funnel"]["input"]["documents"],
      "datatrove_filters_docs_per_s": datatrove_docs_per_s(inp),
      "ours_filters_docs_per_s": manifest["funnel"]["input"]["documents"] / filter_s / args.workers,
  }
  if args.big_mb:
    result["memory"] = [peak_rss_mb(float(mb), args.workers) for mb in args.big_mb.split(",")]
  shutil.rmtree(work, ignore_errors=True)
  print(json.dumps(result, indent=None if args.json else 1))
  return 0


if __name__ == "__main__":
  sys.exit(main())

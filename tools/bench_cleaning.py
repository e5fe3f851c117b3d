"""Cleaning on real text from this machine: what each kind of document keeps, and the CPU it
costs, against an older maxlm (--before) and datatrove's filters, side by side in one run.

  python tools/bench_cleaning.py [--n 40] [--before /path/to/old/checkout] [--show 2] [--json]

1. Builds the corpora of tests/realtext.py under a temporary folder: hard-wrapped man pages
   (as .txt files, and again as JSON Lines text, which is `web`), markdown/reST docs, Python
   source as JSON Lines with ids carrying no suffix, web-like pages with navigation and
   footers, other-language pages, junk pages, near-copies.
2. Runs `maxlm prepare` with default options (vocab 2000, 2 workers) and reads every kept
   document back from the data dir (the tokenizer is lossless): per group, the median share
   of characters kept over all its documents (a removed one keeps 0%), the share of documents
   removed, and the tokens of the code source kept against its input's tokens (the same
   tokenizer). With --before, the same in a child process on another checkout.
3. CPU seconds per MB (process time, the best of 3 passes) of the per-document quality
   steps (kind, language ID, line/quality/repetition/code rules, MinHash signatures), per
   source and in all, ours and --before's, and datatrove's Gopher repetition + quality + C4
   filters with its default word tokenizer on the same documents.
--show N prints the kept text of N documents of each group, to read before trusting a number.
"""

import argparse
import collections
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def measure(n, show, work):
  """The numbers of step 2 and 3 for the maxlm on sys.path."""
  sys.path.insert(0, os.path.join(HERE, "..", "tests"))
  import realtext
  from maxlm.data import documents, prepare, quality, store, tokenizer
  from maxlm import io
  truth, inputs = realtext.write(work, n)
  report = documents.Report()
  docs = list(documents.iter_documents(inputs, report))
  t = time.process_time()
  manifest = prepare.prepare(inputs, f"{work}/out",
                             prepare.Options(vocab_size=2000, workers=2, progress=False,
                                             quality=quality.QualityConfig(),
                                             rejected=f"{work}/rejected.jsonl"),
                             log=lambda *a: None)
  wall_cpu = time.process_time() - t
  ids = store.load_doc_ids(f"{work}/out")
  sp = tokenizer.load(io.read_bytes(f"{work}/out/tokenizer.model"))
  tokens = store.TokenStore(f"{work}/out")
  kept = {ids[i]: sp.decode(tokens.document(i).tolist()) for i in range(len(ids))}
  by_id = {d["id"]: d["text"] for d in docs if "text" in d}
  out = {"groups": {}, "prepare_main_cpu_s": round(wall_cpu, 1)}
  rejected = {}
  for line in open(f"{work}/rejected.jsonl"):
    row = json.loads(line)
    rejected[row["id"]] = f"{row['step']}/{row['rule']}"
  for group, members in truth.items():
    members = [m[0] if isinstance(m, (list, tuple)) else m for m in members]
    shares = [len(kept.get(m, "")) / max(len(by_id[m]), 1) for m in members if m in by_id]
    if not shares:
      continue
    out["groups"][group] = {"documents": len(shares),
                            "median_kept_chars": round(statistics.median(shares), 3),
                            "removed": round(sum(m not in kept for m in members) / len(members), 3),
                            "line_cleaned": sum(0 < s < 1 for s in shares),
                            "removed_by": dict(collections.Counter(
                                rejected[m] for m in members if m in rejected))}
    for m in [m for m in members if m in kept][:show]:
      print(f"===== {group}: {m} keeps {len(kept[m]) / len(by_id[m]):.0%}\n{kept[m][:1200]}\n",
            file=sys.stderr)
  code_in = sum(len(sp.encode(by_id[m])) for m in truth["code"])
  code_kept = sum(len(sp.encode(kept[m])) for m in truth["code"] if m in kept)
  out["code_tokens"] = {"input": code_in, "kept": code_kept}
  near = [m for m, original, j in truth["near"] if j >= 0.8 and original in kept]
  out["near_dup_recall"] = round(sum(m not in kept for m in near) / max(len(near), 1), 3)
  texts = [d["text"] for d in docs if "text" in d]
  out["quality_cpu_s_per_mb"] = _ours_cpu_per_mb(docs)
  return out, docs


def _by_source(docs):
  groups = {"all": [d for d in docs if "text" in d]}
  for d in groups["all"]:
    groups.setdefault(d["source"], []).append(d)
  # the web pages without hard wrapping: the same fate before and after kinds and paragraphs
  groups["web_pages_unwrapped"] = [d for d in groups["all"] if re.match(r"web-\d+$", d["id"])]
  return groups


def _ours_cpu_per_mb(docs, repeats=3):
  """CPU seconds per MB of the per-document quality steps, per source and in all (the best
  of `repeats` passes: the machine is shared)."""
  from maxlm.data import quality
  inspect = quality.Inspector(quality.QualityConfig())
  inspect(dict(docs[0]))  # loads the language model
  out = {}
  for name, members in _by_source(docs).items():
    best = min(_cpu(lambda: [inspect(dict(d)) for d in members]) for _ in range(repeats))
    out[name] = round(best / (sum(len(d["text"].encode()) for d in members) / 1e6), 3)
  return out


def _cpu(fn):
  t = time.process_time()
  fn()
  return time.process_time() - t


def datatrove_cpu_per_mb(docs, repeats=3):
  """The same, for datatrove's Gopher repetition, Gopher quality and C4 filters in turn."""
  try:
    from datatrove.data import Document
    from datatrove.pipeline.filters import (C4QualityFilter, GopherQualityFilter,
                                            GopherRepetitionFilter)
  except ImportError:
    return None
  filters = [GopherRepetitionFilter(), GopherQualityFilter(), C4QualityFilter()]
  filters[0].filter(Document(text=docs[0]["text"], id="0"))  # loads the word tokenizer

  def run(members):
    for i, d in enumerate(members):
      for f in filters:
        if f.filter(Document(text=d["text"], id=str(i))) is not True:
          break
  out = {}
  for name, members in _by_source(docs).items():
    best = min(_cpu(lambda: run(members)) for _ in range(repeats))
    out[name] = round(best / (sum(len(d["text"].encode()) for d in members) / 1e6), 3)
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--n", type=int, default=40, help="documents per group")
  ap.add_argument("--before", help="another maxlm checkout to measure side by side")
  ap.add_argument("--show", type=int, default=0, help="kept texts shown per group (stderr)")
  ap.add_argument("--json", action="store_true")
  ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = ap.parse_args()
  work = tempfile.mkdtemp(prefix="maxlm-bench-cleaning-")
  try:
    ours, docs = measure(args.n, args.show, work)
    if args.child:
      print(json.dumps(ours))
      return 0
    result = {"ours": ours}
    if args.before:
      env = {**os.environ, "PYTHONPATH": os.path.abspath(args.before)}
      proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--n",
                             str(args.n)], env=env, capture_output=True, text=True,
                            cwd=os.path.abspath(args.before))
      if proc.returncode:
        raise SystemExit(proc.stderr[-2000:])
      result["before"] = json.loads(proc.stdout.strip().splitlines()[-1])
    dt = datatrove_cpu_per_mb(docs)
    result["datatrove_filters_cpu_s_per_mb"] = dt
    if dt:
      result["datatrove_over_ours_cpu"] = {k: round(v / ours["quality_cpu_s_per_mb"][k], 2)
                                           for k, v in dt.items()}
    result["corpus_mb"] = round(sum(len(d["text"].encode()) for d in docs
                                    if "text" in d) / 1e6, 2)
  finally:
    shutil.rmtree(work, ignore_errors=True)
  print(json.dumps(result, indent=None if args.json else 1))
  return 0


if __name__ == "__main__":
  sys.exit(main())

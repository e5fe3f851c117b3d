"""A user's own documentation under the default quality rules: how much of it is kept.

  python tools/bench_own_docs.py [--n 300] [--json]

Builds, from text already on this machine (tests/realtext.py picks the files, in an order
fixed by their names): `docs/`, up to N markdown and reST files from site-packages of every
size (realtext.site_docs: on this machine mostly awscli's reST pages, prose around JSON
examples); `manpages/`, up to N man pages rendered to text by groff; and `web.jsonl`, the web pages and junk pages of tests/realtext.py, to show the
web rules still remove junk. Runs `maxlm prepare` on the three with its defaults and prints,
per source, the documents and bytes in and kept and the rules that removed the rest. The
goal (issue: your own data in one step): docs and man pages keep >= 90% of their bytes, and
every junk page is removed.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
import realtext  # noqa: E402

def build(root, n):
  """Writes docs/, manpages/ and web.jsonl under root; returns {source: [doc ids]} of junk."""
  for name, texts in (("docs", realtext.site_docs(n)), ("manpages", realtext.man_pages(n))):
    os.makedirs(f"{root}/{name}", exist_ok=True)
    for file_name, text in texts:
      suffix = "" if name == "docs" else ".txt"
      with open(f"{root}/{name}/{file_name}{suffix}", "w", encoding="utf-8") as f:
        f.write(text)
  rng = random.Random(0)
  rows = [{"id": f"web-{i}", "text": t} for i, t in enumerate(realtext.web_pages(40, rng))]
  junk = [{"id": f"junk-{i}", "text": t} for i, t in enumerate(realtext.junk_pages(rng))]
  with open(f"{root}/web.jsonl", "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows + junk)
  return [r["id"] for r in junk]


def measure(n, work):
  junk = build(work, n)
  out = os.path.join(work, "data")
  rejected = os.path.join(work, "rejected.jsonl")
  proc = subprocess.run(
      [sys.executable, "-m", "maxlm.cli", "prepare", f"{work}/docs", f"{work}/manpages",
       f"{work}/web.jsonl", "--out", out, "--vocab-size", "2000", "--rejected", rejected],
      capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
  if proc.returncode:
    sys.exit(f"prepare failed: {proc.stderr[-2000:]}")
  funnel = json.load(open(os.path.join(out, "manifest.json")))["funnel"]
  removed_ids = {json.loads(line)["id"] for line in open(rejected, encoding="utf-8")}
  result = {}
  for name, src in funnel["sources"].items():
    rules = {k: v["documents"] for k, v in src["rules"].items() if v["documents"]}
    result[name] = {"documents": src["input"]["documents"], "kept": src["kept"]["documents"],
                    "bytes": src["input"]["bytes"], "kept_bytes": src["kept"]["bytes"],
                    "kept_share": round(src["kept"]["bytes"] / max(src["input"]["bytes"], 1), 4),
                    "kinds": src["kinds"], "removed_by": rules}
  result["junk_removed"] = f"{sum(j in removed_ids for j in junk)}/{len(junk)}"
  return result


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--n", type=int, default=300, help="docs files and man pages, each")
  ap.add_argument("--json", action="store_true", help="print one JSON object")
  args = ap.parse_args()
  with tempfile.TemporaryDirectory(prefix="maxlm-own-docs-") as work:
    result = measure(args.n, work)
  if args.json:
    print(json.dumps(result))
    return
  print(f"{'source':<10}{'documents':>10}{'kept':>7}{'bytes':>12}{'kept bytes':>12}{'share':>8}"
        "  removed by")
  for name, r in result.items():
    if isinstance(r, dict):
      print(f"{name:<10}{r['documents']:>10,}{r['kept']:>7,}{r['bytes']:>12,}"
            f"{r['kept_bytes']:>12,}{r['kept_share']:>8.1%}  {r['removed_by']}")
  print(f"junk pages removed: {result['junk_removed']}")


if __name__ == "__main__":
  main()

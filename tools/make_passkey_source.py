"""A synthetic retrieval source for `maxlm prepare`: documents that hide a pass key in filler
text and ask for it at the end, so a small run can learn the task that `maxlm eval --passkey`
scores (maxlm/eval/passkey.py uses the same needle and question).

  python tools/make_passkey_source.py --docs 400 --from runs/demo/raw/prose.jsonl \
      --out runs/passkey/raw/passkey.jsonl [--min-chars 500 --max-chars 12000 --seed 0]
  maxlm prepare runs/demo/raw/prose.jsonl runs/demo/raw/code.jsonl \
      runs/passkey/raw/passkey.jsonl --out runs/passkey/data --filters off --dedup off

Each line is {"id": "passkey-<i>", "source": "passkey", "text": ...}: a stretch of the --from
texts (JSON Lines with a `text` field: the filler is real text) of a seeded length, the needle
at a seeded depth inside it (on a line boundary), and at the end the question and the key.
The same arguments write the same file. `maxlm eval --passkey` builds its haystacks from the
other sources' held-out text only (sources named passkey* are left out).
"""

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maxlm.eval import passkey  # noqa: E402


def needle(key):
  head, middle, tail = passkey.NEEDLE
  return f"{head} {key}{middle} {key}{tail}"


def documents(filler, n, min_chars, max_chars, seed):
  """[text] of n documents hiding a key each in a stretch of `filler`."""
  rng = np.random.default_rng([seed, 0x9A55])
  out = []
  for _ in range(n):
    key = int(rng.integers(10_000, 100_000))
    size = int(rng.integers(min_chars, max_chars + 1))
    start = int(rng.integers(0, max(1, len(filler) - size)))
    hay = filler[start:start + size]
    cut = int(rng.random() * len(hay))
    line = hay.rfind("\n", 0, cut) + 1  # the start of the line holding the cut
    out.append(f"{hay[:line]}{needle(key)}\n{hay[line:]}{passkey.QUESTION} {key}.")
  return out


def read_filler(paths):
  texts = []
  for path in paths:
    with open(path, encoding="utf-8") as f:
      texts += [json.loads(line)["text"] for line in f if line.strip()]
  return "\n\n".join(texts)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--docs", type=int, required=True, help="documents to write")
  p.add_argument("--from", dest="sources", nargs="+", required=True,
                 help="JSON Lines files whose `text` fields are the filler")
  p.add_argument("--out", required=True, help="the JSON Lines file to write")
  p.add_argument("--min-chars", type=int, default=500)
  p.add_argument("--max-chars", type=int, default=12000)
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  if args.docs < 1 or not 0 < args.min_chars <= args.max_chars:
    p.error("need --docs >= 1 and 0 < --min-chars <= --max-chars")
  filler = read_filler(args.sources)
  if len(filler) < args.max_chars:
    p.error(f"the --from texts hold {len(filler):,} characters, fewer than --max-chars")
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w", encoding="utf-8") as f:
    for i, text in enumerate(documents(filler, args.docs, args.min_chars, args.max_chars,
                                       args.seed)):
      f.write(json.dumps({"id": f"passkey-{i}", "source": "passkey", "text": text}) + "\n")
  print(f"wrote {args.docs} documents to {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""Preference pairs from the demo corpus: the DPO check the issue asks for (docs/pairs.md).

For each demo document of at least 48 words: prompt = its first 24 words, chosen = the next 16
(its true continuation), rejected = the same 16 words shuffled; the answers start with the space
that separates them from the prompt (prompt and answer are joined verbatim). A model that learned the
corpus prefers the true order; DPO should make that preference sharp.

  python tools/demo_pairs.py --out pairs.jsonl [--n 160] [--seed 0] [--raw DIR]
"""

import argparse
import json
import random
import sys
import tempfile


def demo_pairs(raw_files, n=160, seed=0):
  rng, out = random.Random(seed), []
  for f in raw_files:
    for line in open(f):
      words = json.loads(line)["text"].split()
      if len(words) < 48:
        continue
      prompt, cont = words[:24], words[24:40]
      shuffled = cont[:]
      while shuffled == cont:
        rng.shuffle(shuffled)
      out.append({"id": f"pair-{len(out)}", "source": "pairs", "prompt": " ".join(prompt),
                  "chosen": " " + " ".join(cont), "rejected": " " + " ".join(shuffled)})
  rng.shuffle(out)
  return out[:n]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--n", type=int, default=160)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--raw", help="where to build the demo corpus (default: a temporary folder)")
  ap.add_argument("--bytes-per-source", type=int, default=200_000)
  args = ap.parse_args(argv)
  from maxlm.data import corpus
  raw = corpus.build(args.raw or tempfile.mkdtemp(prefix="maxlm-pairs-"), args.bytes_per_source)
  rows = demo_pairs(raw, args.n, args.seed)
  with open(args.out, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  print(f"wrote {len(rows)} pairs to {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

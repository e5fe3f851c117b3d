"""A synthetic retrieval source for `maxlm prepare`: documents of real filler text that hide
keys and ask for them at the end, in the formats `maxlm eval --passkey-tasks` scores
(maxlm/eval/passkey.py and maxlm/eval/retrieval.py use the same needles and questions), so a
small run can learn the tasks.

  python tools/make_passkey_source.py --docs 400 --from runs/demo/raw/prose.jsonl \
      --out runs/passkey/raw/passkey.jsonl [--tasks passkey,multikey,vartrack] \
      [--min-chars 500 --max-chars 12000 --seed 0 --source passkey]
  maxlm prepare runs/demo/raw/prose.jsonl runs/demo/raw/code.jsonl \
      runs/passkey/raw/passkey.jsonl --out runs/passkey/data --filters off --dedup off

Each line is {"id": "<source>-<i>", "source": <source>, "text": ...}: a stretch of the --from
texts (JSON Lines with a `text` field: the filler is real text) of a seeded length, with the
needles of one task (the tasks take turns) on line boundaries at seeded places, and at the end
the questions with their answers:

  passkey   one needle "The pass key is KEY. Remember it. The pass key is KEY."; one question.
  multikey  2-6 needles "The pass key for NAME is KEY."; every name asked, in a seeded order.
  vartrack  a chain "VAR A = KEY.", "VAR B = A.", ... (2-4 links, in order) and a distractor
            chain of two; both chains' last variables asked.

A document with many questions gives many retrieval targets for its tokens, which is what
makes a small model learn to look back (docs/schedule.md). The same arguments write the same
file. `maxlm eval --passkey` builds its haystacks from the other sources' held-out text only
(sources named passkey* are left out), so name the source passkey-something.
"""

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maxlm.eval import passkey, retrieval  # noqa: E402

TASKS = ("passkey", "multikey", "vartrack")


def passkey_doc(rng):
  """(needles in order, the text after the filler) of a passkey document."""
  key = int(rng.integers(10_000, 100_000))
  head, middle, tail = passkey.NEEDLE
  return [f"{head} {key}{middle} {key}{tail}"], f"{passkey.QUESTION} {key}."


def multikey_doc(rng):
  n = int(rng.integers(2, 7))
  names = rng.choice(retrieval.NAMES, n, replace=False).tolist()
  keys = rng.choice(np.arange(10_000, 100_000), n, replace=False).tolist()
  needles = [f"The pass key for {name} is {key}." for name, key in zip(names, keys)]
  order = rng.permutation(n)
  questions = "".join(f"\nWhat is the pass key for {names[i]}? The pass key for {names[i]} "
                      f"is {keys[i]}." for i in order)
  return needles, questions


def vartrack_doc(rng):
  hops = int(rng.integers(2, retrieval.HOPS + 1))
  names = rng.choice(retrieval.VARS, hops + 2, replace=False).tolist()
  key, other = rng.choice(np.arange(10_000, 100_000), 2, replace=False).tolist()
  chain = [f"VAR {names[0]} = {key}."] + [f"VAR {names[i]} = {names[i - 1]}."
                                           for i in range(1, hops)]
  distractor = [f"VAR {names[hops]} = {other}.", f"VAR {names[hops + 1]} = {names[hops]}."]
  asked = [(names[hops - 1], key), (names[hops + 1], other)]
  questions = "".join(f"\nWhich number does VAR {v} hold? VAR {v} holds {k}."
                      for v, k in (asked if rng.random() < 0.5 else asked[::-1]))
  return chain + distractor, questions


MAKERS = {"passkey": passkey_doc, "multikey": multikey_doc, "vartrack": vartrack_doc}


def documents(filler, n, min_chars, max_chars, seed, tasks=("passkey",)):
  """[text] of n documents, task after task, each hiding its needles in a stretch of
  `filler`: a chain's links in order, the rest at independent places, each on a line
  boundary."""
  rng = np.random.default_rng([seed, 0x9A55])
  out = []
  for i in range(n):
    task = tasks[i % len(tasks)]
    needles, questions = MAKERS[task](rng)
    size = int(rng.integers(min_chars, max_chars + 1))
    start = int(rng.integers(0, max(1, len(filler) - size)))
    hay = filler[start:start + size]
    cuts = rng.random(len(needles)) * len(hay)
    if task == "vartrack":  # the asked chain in order; the distractor's two in order
      chain = len(needles) - 2
      cuts[:chain] = np.sort(cuts[:chain])
      cuts[chain:] = np.sort(cuts[chain:])
    lines = [hay.rfind("\n", 0, int(c)) + 1 for c in cuts]  # the line holding each cut
    text, done = [], 0
    for j in sorted(range(len(needles)), key=lambda j: (lines[j], j)):
      text += [hay[done:lines[j]], needles[j], "\n"]
      done = lines[j]
    out.append("".join(text) + hay[done:] + questions)
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
  p.add_argument("--tasks", default="passkey",
                 help=f"comma-separated, of {', '.join(TASKS)}; documents take them in turn")
  p.add_argument("--source", default="passkey", help="the documents' source name")
  p.add_argument("--min-chars", type=int, default=500)
  p.add_argument("--max-chars", type=int, default=12000)
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
  if not tasks or any(t not in TASKS for t in tasks):
    p.error(f"--tasks: expected some of {', '.join(TASKS)}, got {args.tasks!r}")
  if args.docs < 1 or not 0 <= args.min_chars <= args.max_chars:
    p.error("need --docs >= 1 and 0 <= --min-chars <= --max-chars")
  filler = read_filler(args.sources)
  if len(filler) < args.max_chars:
    p.error(f"the --from texts hold {len(filler):,} characters, fewer than --max-chars")
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w", encoding="utf-8") as f:
    for i, text in enumerate(documents(filler, args.docs, args.min_chars, args.max_chars,
                                       args.seed, tasks)):
      f.write(json.dumps({"id": f"{args.source}-{i}", "source": args.source, "text": text})
              + "\n")
  print(f"wrote {args.docs} documents to {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

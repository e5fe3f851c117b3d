"""The RL recipe's synthetic verifiable task (docs/rl.md): reverse three letters.

A prompt is `reverse c a t:` and its answer ` <answer> t a c </answer>`; the letters are drawn
from a small alphabet, so a tiny model can learn the task from a few hundred examples. Writes
to OUT_DIR:
  sft.jsonl      {"text": prompt + answer} documents (the supervised stage),
  prompts.jsonl  {"id", "source", "prompt", "gold"} RL prompts (GRPO draws from these),
  heldout.jsonl  {"id", "prompt", "gold"} held-out prompts: strings in neither file above.
Triples are split at random into the three sets (seeded), so held-out pass@1 measures the
task, not memory.

  python tools/rl_task.py OUT_DIR [--letters 8] [--sft 300] [--heldout 64] [--seed 0]
"""

import argparse
import itertools
import json
import os
import random
import sys


def task(letters=8, n_sft=300, n_heldout=64, seed=0):
  """(sft docs, rl prompts, held-out prompts) as lists of dicts."""
  alphabet = "abcdefghijklmnopqrstuvwxyz"[:letters]
  triples = ["".join(t) for t in itertools.product(alphabet, repeat=3)]
  random.Random(seed).shuffle(triples)
  if n_sft + n_heldout >= len(triples):
    raise SystemExit(f"--sft {n_sft} + --heldout {n_heldout} leave no RL prompts of the "
                     f"{len(triples)} triples of {letters} letters")
  prompt = lambda t: "reverse " + " ".join(t) + ":"
  gold = lambda t: " ".join(reversed(t))
  sft = [{"text": f"{prompt(t)} <answer> {gold(t)} </answer>", "source": "sft"}
         for t in triples[:n_sft]]
  held = [{"id": f"held-{t}", "prompt": prompt(t), "gold": gold(t)}
          for t in triples[n_sft:n_sft + n_heldout]]
  rl = [{"id": f"rl-{t}", "source": "rl", "prompt": prompt(t), "gold": gold(t)}
        for t in triples[n_sft + n_heldout:]]
  return sft, rl, held


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("out_dir")
  ap.add_argument("--letters", type=int, default=8)
  ap.add_argument("--sft", type=int, default=300)
  ap.add_argument("--heldout", type=int, default=64)
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)
  os.makedirs(args.out_dir, exist_ok=True)
  sft, rl, held = task(args.letters, args.sft, args.heldout, args.seed)
  for name, rows in (("sft", sft), ("prompts", rl), ("heldout", held)):
    with open(os.path.join(args.out_dir, f"{name}.jsonl"), "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
  print(f"wrote {len(sft)} SFT documents, {len(rl)} RL prompts, {len(held)} held-out prompts "
        f"to {args.out_dir}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

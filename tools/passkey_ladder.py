"""The long-context recipe of docs/schedule.md, end to end: configs/passkey_ladder.yaml
(256 -> 1K -> 4K with YaRN) on the demo corpus plus a synthetic retrieval source, and after
each stage held-out loss by position and the passkey grid (`maxlm eval --passkey --json`).

  python tools/passkey_ladder.py --json                  # the numbers in docs/schedule.md
  python tools/passkey_ladder.py --json --scale 0.05 --corpus-bytes 150000 --vocab 512 \
      --passkey-docs 40 --samples 1 --workdir runs/passkey_small     # the docs test's size

1. The demo corpus (maxlm/data/corpus.py, --corpus-bytes per source) and --passkey-docs
   retrieval documents whose filler is the corpus's prose (tools/make_passkey_source.py).
2. `maxlm prepare` of the three sources (--filters off --dedup off: the retrieval documents
   reuse prose as filler, which dedup would remove), vocabulary --vocab.
3. For each stage: `maxlm train --stop-after <its steps x --scale>`, then `maxlm eval --passkey
   --json` (--samples prompts per cell, lengths 128.. up to the stage's L).
4. `maxlm plot`: curves.png, whose last panel is loss by position, one curve per stage.
Prints per stage: step, held-out loss per source, loss by position per source and the grid.
"""

import argparse
import contextlib
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "passkey_ladder.yaml")
sys.path.insert(0, os.path.join(REPO, "tools"))


def cli(*args):
  proc = subprocess.run([sys.executable, "-m", "maxlm.cli", *map(str, args)],
                        capture_output=True, text=True)
  if proc.returncode:
    raise SystemExit(f"maxlm {args[0]} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
  return proc.stdout


def build_data(work, corpus_bytes, docs, vocab):
  import make_passkey_source
  from maxlm.data import corpus
  data = os.path.join(work, "data")
  if os.path.exists(os.path.join(data, "manifest.json")):
    return data
  raw = os.path.join(work, "raw")
  prose, code = corpus.build(raw, bytes_per_source=corpus_bytes)
  passkey = os.path.join(raw, "passkey.jsonl")
  with contextlib.redirect_stdout(sys.stderr):  # stdout is the --json result only
    make_passkey_source.main(["--docs", str(docs), "--from", prose, "--out", passkey,
                              "--min-chars", "200", "--max-chars", "3000"])
  cli("prepare", prose, code, passkey, "--out", data, "--vocab-size", vocab, "--filters", "off",
      "--dedup", "off", "--lang", "any")
  return data


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--workdir", default=os.path.join(REPO, "runs", "passkey"))
  p.add_argument("--scale", type=float, default=1.0, help="multiplies every stage's steps")
  p.add_argument("--corpus-bytes", type=int, default=4_000_000, help="per demo source")
  p.add_argument("--passkey-docs", type=int, default=2000)
  p.add_argument("--vocab", type=int, default=4096)
  p.add_argument("--samples", type=int, default=4, help="passkey prompts per cell")
  p.add_argument("--json", action="store_true")
  args = p.parse_args()
  from maxlm import config as config_lib
  data = build_data(args.workdir, args.corpus_bytes, args.passkey_docs, args.vocab)
  run = os.path.join(args.workdir, "run")
  cfg = config_lib.load(CONFIG)
  steps = [max(1, round(st.num_steps * args.scale)) for st in cfg.stages]
  every = max(1, min(steps))
  overrides = [f"data.dir={data}", f"run_dir={run}", f"train.eval_every={every}",
               *(f"stages.{i}.steps={n}" for i, n in enumerate(steps))]
  result = {"config": "configs/passkey_ladder.yaml", "scale": args.scale, "stages": []}
  for s, n in enumerate(steps):
    cli("train", CONFIG, *overrides, "--stop-after", n)
    out = json.loads(cli("eval", run, "--passkey", "--json", "--passkey-samples",
                         args.samples).strip().splitlines()[-1])
    result["stages"].append({
        "stage": cfg.stages[s].name, "seq_len": cfg.stages[s].seq_len, "step": out["step"],
        "val_loss": {k: round(v["loss"], 4) for k, v in out["sources"].items()},
        "positions": {src: {b: round(e["loss"], 4) for b, e in cells.items()}
                      for src, cells in out["positions"].items()},
        "passkey": out["passkey"]})
  cli("plot", run)
  result["curves"] = os.path.join(run, "curves.png")
  if args.json:
    print(json.dumps(result, indent=1))
  else:
    for st in result["stages"]:
      print(f"{st['stage']} (L={st['seq_len']}), step {st['step']}: {st['val_loss']}")
      for n, row in st["passkey"].items():
        print(f"  passkey {n:>5}: " + " ".join(f"{d}%={a:.2f}" for d, a in row.items()))
  return 0


if __name__ == "__main__":
  sys.exit(main())

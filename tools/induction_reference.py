"""Does a small model learn to copy in this many steps? maxlm's decoder beside transformers'
`LlamaForCausalLM` of the same shape, trained on the same batches, both probed for an
induction head (the first thing retrieval needs; tools/longctx_recipe.py, docs/schedule.md).

  python tools/induction_reference.py --json [--steps 300 --batch 16 --workdir runs/induction]

The data: documents that are a sequence of 20-60 random words (from the demo corpus's prose)
written twice, 90% of the tokens, and the demo prose, 10%: half of every repeated document
can be predicted by copying. maxlm trains it with `maxlm train` (the demo model's shape, AdamW
3e-3 with 30 warm-up steps then constant, weight decay 0.1, clip 1.0); the reference reads the
same batches from maxlm's loader (segment-masked, positions per document) and trains with
torch's AdamW under the same settings. Both are then probed: argmax accuracy on the second
copy of 8 repeated sequences of 60 random token ids (about 0 without an induction head, about
1 with one). The last line of --json: {"steps", "batch", "tokens", "maxlm": {"loss",
"induction"}, "transformers": {"loss", "induction"}}; the losses are each run's last step's.
"""

import argparse
import json
import os
import re
import subprocess
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tools"))
SHAPE = dict(d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=768)


def build_data(work, vocab):
  from maxlm.data import corpus
  data = os.path.join(work, "data")
  if os.path.exists(os.path.join(data, "manifest.json")):
    return data
  prose, _ = corpus.build(os.path.join(work, "raw"), bytes_per_source=3_000_000)
  with open(prose) as f:
    words = sorted(set(re.findall(r"[a-z]{3,10}", f.read())))[:5000]
  rng = np.random.default_rng(0)
  repeat = os.path.join(work, "raw", "repeat.jsonl")
  with open(repeat, "w") as f:
    for i in range(6000):
      seq = " ".join(rng.choice(words, int(rng.integers(20, 60))))
      f.write(json.dumps({"id": f"r{i}", "source": "repeat", "text": f"{seq}\n{seq}"}) + "\n")
  subprocess.run([sys.executable, "-m", "maxlm.cli", "prepare", repeat, prose, "--out", data,
                  "--vocab-size", str(vocab), "--filters", "off", "--dedup", "off", "--lang",
                  "any"], check=True, capture_output=True)
  return data


def config(data, run, steps, batch):
  return {"seed": 0, "run_dir": run,
          "data": {"dir": data, "mix": {"repeat": 0.9, "prose": 0.1}, "overlap": 16,
                   "lookahead": 64, "shuffle_rows": 16, "block_rows": 256},
          "stages": [{"name": "s256", "seq_len": 256, "batch": batch, "steps": steps}],
          "model": {"size": "demo", "dtype": "float32", "remat": "none", "loss_chunk": 256},
          "train": {"lr": 0.003, "schedule": "wsd", "decay_fraction": 0.0, "warmup_steps": 30,
                    "checkpoint_every": steps, "eval_every": 0}}


def train_reference(cfg_path, steps, vocab):
  """(last loss, induction probe) of transformers' Llama trained on maxlm's batches."""
  import torch
  import transformers
  from maxlm import config as config_lib
  from maxlm.data import loader
  torch.manual_seed(0)
  import longctx_recipe
  cfg = config_lib.load(cfg_path)
  data = loader.Data(cfg)
  it = loader.iterator(data, 0)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=vocab, hidden_size=SHAPE["d_model"], intermediate_size=SHAPE["d_ff"],
      num_hidden_layers=SHAPE["n_layers"], num_attention_heads=SHAPE["n_heads"],
      num_key_value_heads=SHAPE["n_kv_heads"], head_dim=SHAPE["head_dim"],
      rope_theta=10000.0, tie_word_embeddings=False, attn_implementation="eager"))
  opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
  for step in range(steps):
    b = {k: torch.tensor(v, dtype=torch.long) for k, v in next(it).items()}
    seg, L = b["segment_ids"], b["inputs"].shape[1]
    allowed = torch.tril(torch.ones(L, L, dtype=torch.bool))[None] & (
        seg[:, :, None] == seg[:, None, :]) | torch.eye(L, dtype=torch.bool)[None]
    mask = torch.where(allowed, 0.0, float("-inf"))[:, None]
    for group in opt.param_groups:
      group["lr"] = 3e-3 * min(1.0, (step + 1) / 30)
    logits = model(input_ids=b["inputs"], position_ids=b["positions"],
                   attention_mask=mask).logits
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab),
                                            b["targets"].reshape(-1), reduction="none")
    weight = b["loss_mask"].reshape(-1).float()
    loss = (nll * weight).sum() / weight.sum()
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
  ids = longctx_recipe.probe_ids(data.special.bos, vocab)
  n = ids.shape[1] // 2
  with torch.no_grad():
    got = model(torch.tensor(ids)).logits[:, n + 1:2 * n].argmax(-1).numpy()
  return round(loss.item(), 4), round(float((got == ids[:, n + 2:2 * n + 1]).mean()), 4)


def main():
  import yaml
  import longctx_recipe
  from maxlm.train import metrics
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--workdir", default=os.path.join(REPO, "runs", "induction"))
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--vocab", type=int, default=4096)
  p.add_argument("--json", action="store_true")
  args = p.parse_args()
  data = build_data(args.workdir, args.vocab)
  run = os.path.join(args.workdir, f"run_{args.steps}x{args.batch}")
  cfg_path = os.path.join(args.workdir, f"induction_{args.steps}x{args.batch}.yaml")
  with open(cfg_path, "w") as f:
    yaml.safe_dump(config(data, run, args.steps, args.batch), f)
  longctx_recipe.cli("train", cfg_path)
  ours = {"loss": round(metrics.read_jsonl(run)[-1]["loss"], 4),
          "induction": longctx_recipe.induction(run)}
  from maxlm import io
  from maxlm.data import tokenizer
  vocab = tokenizer.load(io.read_bytes(os.path.join(data, "tokenizer.model"))).vocab_size()
  loss, probe = train_reference(cfg_path, args.steps, vocab)
  result = {"steps": args.steps, "batch": args.batch, "tokens": args.steps * args.batch * 256,
            "maxlm": ours, "transformers": {"loss": loss, "induction": probe}}
  print(json.dumps(result) if args.json else
        f"{result['tokens']:,} tokens: maxlm loss {ours['loss']} induction {ours['induction']}; "
        f"transformers loss {loss} induction {probe}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""Interop numbers: maxlm's logits against transformers' on the same weights, and how long the
150m model takes to export and to read back through init.from on this machine's CPU.

  python tools/bench_interop.py [--json] [--skip-timing] [--size 150m] [--vocab 32000]

Parity (needs the `hf` extra: torch and transformers; skipped with a note without them): random
float32 weights (maxlm.interop.parity: weights ~ N(0, 0.15), norm scales ~ 1 + N(0, 0.2);
logits of magnitude ~5) for each case of tests/test_interop.py, 3 layers, GQA (4 query heads,
2 KV heads). "one" is a 64-token document; "packed" two documents (23 + 41) in one maxlm row
against two separate transformers passes. Reported: max |maxlm - transformers| over every
logit.

Trained: a tiny 3-layer GQA model trained 30 steps on the demo corpus through a plain and a
YaRN stage, exported; max logit difference on two texts (one row, two documents) and whether
24 greedy tokens from each text's first 8 agree (maxlm's KV-cache sampler against
transformers' generate).

Timing: a model of --size with a --vocab vocabulary trained for ONE step (so its checkpoint
is a real one; the weights are in effect random) on the demo corpus, then `maxlm export` of
that checkpoint (float32, one file) and init.from of the export read into host arrays (what a
run does before placing them), each timed once, plus the check that the round trip is bitwise.
"""

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maxlm import config as config_lib  # noqa: E402
from maxlm.interop import export, load, parity, run_reader  # noqa: E402

PARITY_MODEL = {"d_model": 64, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16,
                "d_ff": 96}
CASES = {
    "gqa": (PARITY_MODEL, {}),
    "gqa_tied_yarn": ({**PARITY_MODEL, "tied_embeddings": True},
                      {"scaling": "yarn", "factor": 4.0, "original_length": 16}),
    "gqa_linear": (PARITY_MODEL, {"scaling": "linear", "factor": 2.0}),
    "gqa_yarn_betas_attention_factor": (PARITY_MODEL, {
        "scaling": "yarn", "factor": 8.0, "original_length": 8, "beta_fast": 16,
        "beta_slow": 2, "attention_factor": 1.25, "theta": 500.0}),
}


def parity_numbers(work):
  try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
  except ImportError:
    return {"skipped": "torch/transformers not installed (pip install -e '.[hf]')"}
  out, rng = {}, np.random.default_rng(1)
  for name, (model_keys, rope) in CASES.items():
    config = parity.config_for(model_keys, [{"seq_len": 64, "batch": 1, "steps": 1,
                                             "attention": "blockwise", "block_q": 16,
                                             "block_k": 16, "rope": rope}])
    model, params = parity.random_params(config)
    folder = os.path.join(work, name)
    os.makedirs(folder)
    parity.random_folder(folder, config, params)
    one = [rng.integers(0, 256, 64).tolist()]
    packed = [rng.integers(0, 256, 23).tolist(), rng.integers(0, 256, 41).tolist()]
    out[name] = {"one": parity.max_difference(model, params, folder, one, 64),
                 "packed": parity.max_difference(model, params, folder, packed, 64),
                 "max_abs_logit": float(np.abs(parity.hf_logits(folder, one)[0]).max())}
  return out


def trained_parity(work, data):
  """A tiny 3-layer GQA model trained 30 steps on the demo corpus (a plain stage, then a YaRN
  one), exported: max logit difference on held-out text, and whether 24 greedy tokens agree."""
  try:
    import torch
    import transformers
  except ImportError:
    return {"skipped": "torch/transformers not installed (pip install -e '.[hf]')"}
  from maxlm.data import tokenizer as tok_lib
  from maxlm.eval import generate
  from maxlm.train import open_run
  from maxlm.train import loop
  stage = {"attention": "blockwise", "block_q": 16, "block_k": 16}
  config = config_lib.from_dict({
      "run_dir": os.path.join(work, "tiny"),
      "data": {"dir": data, "mix": {"prose": 0.5, "code": 0.5}, "overlap": 4, "shuffle_rows": 8,
               "block_rows": 64},
      "stages": [{"seq_len": 64, "batch": 8, "steps": 20, **stage},
                 {"seq_len": 128, "batch": 4, "steps": 10, **stage,
                  "rope": {"scaling": "yarn", "factor": 2.0, "original_length": 64}}],
      "model": {"size": "tiny", "dtype": "float32", "remat": "none", "n_layers": 3,
                "loss_chunk": 64},
      "train": {"eval_every": 0}})
  loop.train(config, log=lambda *_: None)
  folder = os.path.join(work, "tiny-hf")
  export.export(config.run_dir, folder, log=lambda *_: None)
  _, _, _, mesh, model, params, _, _ = open_run.open_run(config.run_dir)
  sp = tok_lib.load(open(os.path.join(data, "tokenizer.model"), "rb").read())
  texts = ["def parse(self, text):\n    return text.split()\n",
           "The documentation describes how the module is used in practice."]
  documents = [[tok_lib.BOS] + sp.encode(t) for t in texts]
  worst = parity.max_difference(model, params, folder, documents, 128)
  hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
  agree = True
  for doc in documents:
    with mesh:
      ours = generate.sample(model, params, doc[:8], max_tokens=24, temperature=0)
    with torch.no_grad():
      theirs = hf.generate(torch.tensor([doc[:8]]), max_new_tokens=24, do_sample=False,
                           attention_mask=torch.ones(1, 8, dtype=torch.long))[0, 8:].tolist()
    agree &= ours == theirs
  return {"max_abs_logit_difference": worst, "greedy_24_tokens_equal": bool(agree)}


def timing(work, size, vocab):
  from maxlm.train import loop
  data = os.path.join(work, "data")
  config = config_lib.from_dict({
      "run_dir": os.path.join(work, "run"),
      "data": {"dir": data, "mix": {"prose": 0.5, "code": 0.5}, "overlap": 4, "shuffle_rows": 8,
               "block_rows": 64},
      "stages": [{"seq_len": 32, "batch": 8, "steps": 1}],
      "model": {"size": size, "vocab_size": vocab, "dtype": "float32", "remat": "none",
                "loss_chunk": 32},
      "train": {"eval_every": 0, "async_checkpoints": False}})
  t = time.perf_counter()
  loop.train(config, log=lambda *_: None)
  trained = time.perf_counter() - t
  out = os.path.join(work, "hf")
  done = export.export(config.run_dir, out, log=lambda *_: None)
  source_cfg = config_lib.from_dict({**config_lib.to_dict(config),
                                     "init": {"from": out}})
  t = time.perf_counter()
  tokenizer = open(os.path.join(data, "tokenizer.model"), "rb").read()
  source = load.open_source(source_cfg, vocab, tokenizer, log=lambda *_: None)
  import dataclasses
  import jax
  from maxlm.model import build
  model = build.model_for(config, 0, vocab_size=vocab)
  like = jax.eval_shape(lambda: build.init_params_abstract(model))
  params = load.params(source, dataclasses.replace(config.model, vocab_size=vocab), like)
  imported = time.perf_counter() - t
  reader = run_reader.RunCheckpoint(config.run_dir, log=lambda *_: None)
  bitwise = all(np.array_equal(source.get(n), reader.get(n)) for n in reader.names())
  return {"size": size, "vocab": vocab, "params": int(sum(
              x.size for x in jax.tree_util.tree_leaves(params))),
          "bytes": done["bytes"], "train_one_step_s": trained, "export_s": done["seconds"],
          "import_s": imported, "round_trip_bitwise": bool(bitwise),
          "cpu_cores": os.cpu_count()}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--json", action="store_true")
  ap.add_argument("--skip-timing", action="store_true")
  ap.add_argument("--size", default="150m")
  ap.add_argument("--vocab", type=int, default=32000)
  args = ap.parse_args(argv)
  with tempfile.TemporaryDirectory(prefix="bench-interop-") as work:
    from maxlm.data import corpus, prepare
    raw = corpus.build(os.path.join(work, "raw"), bytes_per_source=200_000)
    prepare.prepare(raw, os.path.join(work, "data"),
                    prepare.Options(vocab_size=1024, progress=False))
    result = {"parity_max_abs_logit_difference": parity_numbers(os.path.join(work, "parity")),
              "trained_demo_model": trained_parity(work, os.path.join(work, "data"))}
    if not args.skip_timing:
      result["timing"] = timing(work, args.size, args.vocab)
  if args.json:
    print(json.dumps(result, indent=2))
    return
  for name, row in result["parity_max_abs_logit_difference"].items():
    print(f"{name:<34} {row}")
  print(f"{'trained_demo_model':<34} {result['trained_demo_model']}")
  for key, value in result.get("timing", {}).items():
    print(f"{key:<20} {value}")


if __name__ == "__main__":
  main()

"""Sampling throughput: the batched on-device sampler (maxlm/eval/sample.py) against the
one-sequence sampler (maxlm/eval/generate.py, a host round trip per token), side by side in one
run on the same model and prompts.

  python tools/bench_sample.py [--json] [--prompts 16] [--samples 8] [--new-tokens 128]
      [--old-rows 16] [--tokenizer PATH] [--config configs/demo.yaml]

The model is the demo config's size (configs/demo.yaml), randomly initialised (seed 0) with a
4096-token vocabulary; no EOS is set, so every row samples all --new-tokens tokens (temperature
1, top-k 40). Prompts are the first --prompts distinct lines of 40-160 characters of this
machine's standard library sources (files in sorted order), BOS + their tokens under a
tokenizer trained like the demo's (maxlm.data.tokenizer.train, vocab 4096) on those sources'
lines, or --tokenizer (e.g. runs/demo/data/tokenizer.model).

The new sampler does --prompts x --samples rows in one call: compile time apart, then the
median of 3 calls. The old sampler samples rows one at a time, as `maxlm generate --samples`
did; it runs --old-rows rows (one sample per prompt first) and its rate is per row, so fewer
rows only shorten the run. Two old rates: `as_called` is whole calls (each call traces and
compiles its own step function again), `decode` the marginal rate of its token loop (a call of
N tokens minus a call of 2 tokens, which compiles the step too, per row).
"""

import argparse
import glob
import json
import os
import statistics
import sys
import sysconfig
import time

import jax
import numpy as np

from maxlm import config as config_lib
from maxlm.data import tokenizer
from maxlm.eval import generate, sample
from maxlm.model import build
from maxlm.parallel import mesh as mesh_lib


def source_lines(limit=40_000):
  """Stripped lines of 40-160 characters of the standard library's .py files, in order."""
  out = []
  for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
    with open(path, encoding="utf-8", errors="replace") as f:
      out.extend(ln.strip() for ln in f if 40 <= len(ln.strip()) <= 160)
    if len(out) >= limit:
      break
  return out


def prompts_from(lines, sp, n, bos):
  chosen = list(dict.fromkeys(lines))[:n]
  return chosen, [[bos] + sp.encode(text) for text in chosen]


def _timed(fn):
  t = time.perf_counter()
  out = fn()
  return out, time.perf_counter() - t


def bench_new(model, params, prompts, args, mesh):
  kw = dict(n_samples=args.samples, max_new_tokens=args.new_tokens, temperature=1.0, top_k=40,
            seed=0, mesh=mesh)
  (tokens, lengths, _), first = _timed(lambda: sample.generate_arrays(model, params, prompts,
                                                                      **kw))
  times = [_timed(lambda: sample.generate_arrays(model, params, prompts, **kw))[1]
           for _ in range(3)]
  return tokens, int(lengths.sum()), first, statistics.median(times)


def bench_old(model, params, prompts, args, mesh):
  rows = [(i % len(prompts), i // len(prompts)) for i in range(args.old_rows)]
  whole, loop, tokens = 0.0, 0.0, 0
  for p, j in rows:
    with mesh:
      out, t_long = _timed(lambda: generate.sample(model, params, prompts[p],
                                                   max_tokens=args.new_tokens, temperature=1.0,
                                                   top_k=40, seed=j))
      _, t_short = _timed(lambda: generate.sample(model, params, prompts[p], max_tokens=2,
                                                  temperature=1.0, top_k=40, seed=j))
    whole, loop, tokens = whole + t_long, loop + t_long - t_short, tokens + len(out)
  return tokens, whole, loop


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--config", default="configs/demo.yaml")
  ap.add_argument("--prompts", type=int, default=16)
  ap.add_argument("--samples", type=int, default=8)
  ap.add_argument("--new-tokens", type=int, default=128)
  ap.add_argument("--old-rows", type=int, default=16)
  ap.add_argument("--tokenizer", help="a tokenizer.model (default: trained here, vocab 4096)")
  ap.add_argument("--json", action="store_true")
  args = ap.parse_args(argv)
  lines = source_lines()
  proto = (open(args.tokenizer, "rb").read() if args.tokenizer
           else tokenizer.train(lines, 4096))
  sp = tokenizer.load(proto)
  special = tokenizer.special_ids(sp)
  texts, prompts = prompts_from(lines, sp, args.prompts, special.bos)
  cfg = config_lib.load(args.config)
  mesh = mesh_lib.make_mesh(cfg.stages[0].mesh)
  model = build.model_for(cfg, 0, mesh, sp.get_piece_size())
  params = build.init_params(model, jax.random.key(0), mesh, cfg.rules)
  tokens, new_count, new_first, new_s = bench_new(model, params, prompts, args, mesh)
  old_count, old_whole, old_loop = bench_old(model, params, prompts, args, mesh)
  new_rate = new_count / new_s
  old_rows_tokens = args.old_rows * (args.new_tokens - 2)
  result = {
      "config": args.config, "model": "demo size, random init", "vocab": sp.get_piece_size(),
      "backend": jax.default_backend(), "devices": jax.device_count(),
      "prompts": args.prompts, "samples": args.samples, "new_tokens": args.new_tokens,
      "prompt_tokens": [len(p) for p in prompts],
      "new_tokens_sampled": new_count, "new_compile_and_first_call_s": new_first,
      "new_call_s": new_s, "new_tokens_per_s": new_rate,
      "old_rows": args.old_rows, "old_tokens_sampled": old_count,
      "old_as_called_tokens_per_s": old_count / old_whole,
      "old_decode_tokens_per_s": old_rows_tokens / old_loop,
      "speedup_vs_old_as_called": new_rate / (old_count / old_whole),
      "speedup_vs_old_decode": new_rate / (old_rows_tokens / old_loop),
      "first_prompt": texts[0], "first_completion": sp.decode(tokens[0].tolist())[:200]}
  if args.json:
    print(json.dumps(result))
  else:
    for k, v in result.items():
      print(f"{k:>32}: {v:.4g}" if isinstance(v, float) else f"{k:>32}: {v}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

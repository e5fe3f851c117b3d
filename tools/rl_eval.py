"""Held-out pass@1 of a run's latest checkpoint, sampled the way GRPO samples (docs/rl.md).

  python tools/rl_eval.py RUN_DIR --prompts heldout.jsonl [--samples 8] [--max-new-tokens 24]
      [--temperature 1.0] [--verify exact] [--seed 0]

Prints one JSON line: {"pass_at_1", "prompts", "samples", "reward_mean"}. The batched sampler
(maxlm/eval/sample.py) draws --samples completions per prompt with a fixed seed, so two runs
are compared on the same random numbers.
"""

import argparse
import json
import sys


def pass_at_1(run_dir, prompts_path, samples=8, max_new_tokens=24, temperature=1.0,
              verify="exact", seed=0):
  from maxlm import io
  from maxlm.data import tokenizer
  from maxlm.train import open_run
  from maxlm.eval import sample as sample_lib, verify as verify_lib
  from maxlm.train import rewards, rollouts
  prompts, _ = verify_lib.read_prompts(prompts_path)
  config, data, _, mesh, model, params, step, _ = open_run.open_run(run_dir)
  sp = tokenizer.load(io.read_bytes(io.join(config.data.dir, "tokenizer.model")))
  ids = [rollouts.encode_prompt(sp, p["prompt"], data.special.bos) for p in prompts]
  with mesh:
    out = sample_lib.sample_batch(model, params, ids, n_samples=samples,
                                  max_new_tokens=max_new_tokens, temperature=temperature,
                                  seed=seed, eos_id=data.special.eos, mesh=mesh,
                                  rules=config.rules)
  texts = [[rollouts.completion_text(sp, c, data.special) for c in grp] for grp in out]
  r = rollouts.score(texts, prompts, rewards.verifier(verify))
  return {"pass_at_1": rewards.pass_at_1(r), "prompts": len(prompts), "samples": samples,
          "step": step, "example": texts[0][0]}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("run_dir")
  ap.add_argument("--prompts", required=True)
  ap.add_argument("--samples", type=int, default=8)
  ap.add_argument("--max-new-tokens", type=int, default=24)
  ap.add_argument("--temperature", type=float, default=1.0)
  ap.add_argument("--verify", default="exact")
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)
  print(json.dumps(pass_at_1(args.run_dir, args.prompts, args.samples, args.max_new_tokens,
                             args.temperature, args.verify, args.seed)))
  return 0


if __name__ == "__main__":
  sys.exit(main())

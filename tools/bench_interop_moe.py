"""Interop numbers for the model families: maxlm's logits against transformers' on the same
weights for local/global (MinistralForCausalLM), MoE softmax (Qwen2MoeForCausalLM, with and
without sliding layers) and MoE sigmoid with a balancing bias (Glm4MoeForCausalLM).

  python tools/bench_interop_moe.py [--json]

Random float32 weights (maxlm.interop.parity: weights ~ N(0, 0.15), norm scales ~ 1 + N(0, 0.2),
bias ~ N(0, 0.05)), 6 layers, d_model 32, GQA (4 query heads, 2 KV heads), the cases of
tests/test_interop_moe.py, blockwise attention with 16-token tiles. "one" is a 64-token
document; "packed" two documents (23 + 41) in one maxlm row against two separate transformers
passes. Reported: max |maxlm - transformers| over every logit, and the largest logit, for
scale. Needs the `hf` extra (torch and transformers).
"""

import argparse
import json
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maxlm.interop import families, parity  # noqa: E402

MODEL = {"d_model": 32, "n_layers": 6, "n_heads": 4, "n_kv_heads": 2, "head_dim": 8, "d_ff": 48}
MOE = {"experts": 4, "top_k": 2, "shared_experts": 1, "d_ff": 16, "first_dense": 1}
CASES = {
    "window": {"attention": {"window": 6, "global_every": 3}},
    "window_all_local": {"attention": {"window": 5}},
    "moe_softmax": {"moe": {**MOE, "balance": "aux_loss"}},
    "moe_window": {"moe": {"experts": 8, "top_k": 2, "shared_experts": 1, "d_ff": 16,
                           "every": 2, "balance": "none"},
                   "attention": {"window": 6, "global_every": 3}},
    "moe_sigmoid_bias": {"moe": {**MOE, "shared_experts": 2, "score": "sigmoid",
                                 "balance": "bias", "norm_topk": False}},
}
STAGE = {"seq_len": 64, "batch": 1, "steps": 1, "attention": "blockwise", "block_q": 16,
         "block_k": 16}


def numbers(work):
  out, rng = {}, np.random.default_rng(1)
  one = [rng.integers(0, 256, 64).tolist()]
  packed = [rng.integers(0, 256, 23).tolist(), rng.integers(0, 256, 41).tolist()]
  for name, keys in CASES.items():
    config = parity.config_for({**MODEL, **keys}, [STAGE])
    model, params = parity.random_params(config)
    bias = parity.random_bias(model) if config.model.moe.balance == "bias" else None
    folder = os.path.join(work, name)
    os.makedirs(folder)
    parity.random_folder(folder, config, params, bias)
    ours = parity.maxlm_logits(model, params, np.asarray(one, np.int32),
                               np.ones((1, 64), np.int32), bias)
    out[name] = {"class": families.CLASSES[families.family(config.model)],
                 "one": parity.max_difference(model, params, folder, one, 64, bias),
                 "packed": parity.max_difference(model, params, folder, packed, 64, bias),
                 "max_logit": float(np.abs(ours).max())}
  return out


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--json", action="store_true")
  args = p.parse_args()
  with tempfile.TemporaryDirectory() as work:
    result = numbers(work)
  if args.json:
    print(json.dumps(result, indent=2))
    return
  for name, r in result.items():
    print(f"{name:18s} {r['class']:22s} one {r['one']:.1e}  packed {r['packed']:.1e}  "
          f"|logit| <= {r['max_logit']:.1f}")


if __name__ == "__main__":
  main()

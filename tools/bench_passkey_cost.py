"""Where a long passkey grid's time goes: one forward pass over a packed training row against
one over a single passkey prompt of the same length, side by side in one process.

  python tools/bench_passkey_cost.py [--lengths 16384,65536,262144] [--data runs/demo/data]

The model is configs/tiny_1m.yaml's sparse stage (random weights; the cost does not depend on
them) at each length L. A training row packs the demo corpus's documents (up to ~12K tokens
each), so sparse attention and the indexer visit O(L x document length) pairs; a passkey
prompt is one document of L tokens, for which the indexer scores O(L^2 / block) pairs. Prints
seconds per row for both and their ratio (compile excluded).
"""

import argparse
import json
import time

import jax
import numpy as np

from maxlm import config as config_lib
from maxlm.data import loader
from maxlm.eval import long_eval, passkey
from maxlm.train import stage as stage_lib, step as step_lib


def seconds_per_row(L, data_dir):
  cfg = config_lib.load("configs/tiny_1m.yaml", [f"data.dir={data_dir}",
                                                 f"stages.2.seq_len={L}"])
  data, vocab = stage_lib.validate(cfg)
  parts = stage_lib.parts(cfg, 2, vocab)
  state = step_lib.init_state(parts.model, parts.opt, parts.mesh, cfg.rules, cfg.seed, L)
  predict = long_eval.passkey_predictor(jax.jit(passkey.make_predict(parts.model, cfg.rules)),
                                        parts.mesh, cfg)
  where = np.zeros((1, 8), np.int32)
  packed = next(loader.iterator(data, 2, workers=0))
  prompt, _ = passkey.row_batch(long_eval.passkey_prompts([L], 1, 0, data, cfg)[:1], [[0]], L, 1)
  out = {}
  for name, batch in (("packed_row", packed), ("passkey_prompt", prompt)):
    batch = {k: batch[k] for k in ("inputs", "targets", "segment_ids", "positions")}
    predict(state["params"], batch, where)  # compiles
    start = time.perf_counter()
    predict(state["params"], batch, where)
    out[name] = round(time.perf_counter() - start, 3)
  out["ratio"] = round(out["passkey_prompt"] / out["packed_row"], 2)
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--lengths", default="16384,65536,262144")
  ap.add_argument("--data", default="runs/demo/data", help="a prepared demo data dir")
  args = ap.parse_args()
  for L in map(int, args.lengths.split(",")):
    print(json.dumps({"seq_len": L, **seconds_per_row(L, args.data)}), flush=True)


if __name__ == "__main__":
  main()

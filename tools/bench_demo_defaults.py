"""What configs/demo.yaml's CPU settings are worth: the demo model's train step with demo.yaml
as written, against the same step with the config defaults it overrides put back (bfloat16
compute, full remat, 512-position attention tiles, 1024-position loss chunks), side by side in
one run (docs/config.md quotes the ratio).

  python tools/bench_demo_defaults.py [--json] [--seq-len 1024] [--batch 2] [--steps 4]
"""

import argparse
import contextlib
import io
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_train  # noqa: E402

DEFAULTS_BACK = ("model.dtype=bfloat16", "model.remat=full", "stages.0.block_q=512",
                 "stages.0.block_k=512", "model.loss_chunk=1024")


def measure(args, overrides):
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    bench_train.main(["--json", "--config", "configs/demo.yaml", "--seq-len", str(args.seq_len),
                      "--batch", str(args.batch), "--steps", str(args.steps), *overrides])
  return json.loads(out.getvalue().strip().splitlines()[-1])


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--seq-len", type=int, default=1024)
  ap.add_argument("--batch", type=int, default=2)
  ap.add_argument("--steps", type=int, default=4)
  ap.add_argument("--json", action="store_true")
  args = ap.parse_args(argv)
  demo = measure(args, ())
  defaults = measure(args, DEFAULTS_BACK)
  out = {"seq_len": args.seq_len, "batch": args.batch, "device": demo["device"],
         "demo_yaml_step_s": demo["step_s"], "defaults_step_s": defaults["step_s"],
         "slowdown": round(defaults["step_s"] / demo["step_s"], 2),
         "defaults_put_back": list(DEFAULTS_BACK)}
  print(json.dumps(out) if args.json else "\n".join(f"{k:>18}: {v}" for k, v in out.items()))
  return 0


if __name__ == "__main__":
  sys.exit(main())

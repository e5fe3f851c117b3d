"""Expert parallelism equals one device: configs/moe_demo.yaml trained on the demo corpus for a
few steps on one CPU device and on 8 fake CPU devices as a 2 x 4 (fsdp x expert) mesh (and any
other --mesh), side by side in one run; per step the loss, gradient norm and routing metrics
(max load / mean, entropy, the losses) of each mesh against one device, as the largest relative
difference over steps and metrics. Each mesh runs in its own process (the device count is fixed
at jax's start); the same seed gives the same batches (their fingerprints are compared).

Tokens/s is reported too, but 8 fake devices share this machine's cores: it is the overhead of
the sharded program (dispatch, all-to-all copies), not a speed-up.

  python tools/bench_expert_parallel.py --json [--steps 5] [--data runs/demo/data]
      [--mesh data=1,fsdp=2,expert=4 ...]

--data defaults to the demo's data dir; it is built as `maxlm demo` builds it when missing.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMPARED = ("loss", "grad_norm")


def worker(args):
  """One mesh: the first stage of moe_demo for --steps steps; prints its metrics rows."""
  from maxlm import config as config_lib  # pylint: disable=import-outside-toplevel
  from maxlm.train import loop  # pylint: disable=import-outside-toplevel
  mesh = [f"stages.0.mesh.{kv}" for kv in args.mesh.split(",")] if args.mesh else []
  overrides = [f"data.dir={args.data}", f"run_dir={args.run_dir}", "train.eval_every=0",
               f"stages.0.steps={args.steps}", "train.checkpoint_every=1000",
               "stages.2.batch=8", *mesh]  # stage 2 (not run) has 2 rows: 8 batch ways need 8
  config = config_lib.load(str(ROOT / "configs" / "moe_demo.yaml"), overrides)
  loop.train(config, stop_after=args.steps, log=lambda *_: None)
  rows = [json.loads(line) for line in
          (pathlib.Path(args.run_dir) / "metrics.jsonl").read_text().splitlines()]
  print(json.dumps([r for r in rows if "loss" in r and "val_loss" not in r]))


def run_mesh(mesh, devices, data, steps, tmp):
  env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
         "PYTHONPATH": str(ROOT)}
  proc = subprocess.run([sys.executable, __file__, "--worker", "--mesh", mesh, "--data", data,
                         "--steps", str(steps), "--run-dir", os.path.join(tmp, mesh or "one")],
                        capture_output=True, text=True, env=env, check=False)
  if proc.returncode:
    raise SystemExit(f"mesh {mesh or 'one device'} failed:\n{proc.stderr[-3000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def compare(one, other):
  """Largest relative difference per metric over the steps, and whether the batches matched."""
  keys = [k for k in one[0] if k in COMPARED or k.startswith("moe/")]
  worst = {k: max(abs(b[k] - a[k]) / max(abs(a[k]), 1e-12) for a, b in zip(one, other))
           for k in keys}
  return {"same_batches": all(a["fingerprint"] == b["fingerprint"] for a, b in zip(one, other)),
          "metrics_compared": len(keys), "max_rel_diff": max(worst.values()),
          "worst_metric": max(worst, key=worst.get),
          "loss_rel_diff": worst["loss"], "grad_norm_rel_diff": worst["grad_norm"],
          "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in other[1:]), 1),
          "losses": [round(r["loss"], 6) for r in other]}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--json", action="store_true", help="print one JSON object")
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--data", default=str(ROOT / "runs" / "demo" / "data"))
  parser.add_argument("--mesh", action="append", default=None,
                      help="mesh sizes on 8 devices, e.g. data=1,fsdp=2,expert=4 (repeatable)")
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--run-dir", default="", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    args.mesh = args.mesh[0] if args.mesh else ""
    return worker(args)
  sys.path.insert(0, str(ROOT / "tools"))
  import bench_moe_train  # pylint: disable=import-outside-toplevel
  bench_moe_train.ensure_data(args.data)
  meshes = args.mesh or ["data=1,fsdp=2,expert=4"]
  with tempfile.TemporaryDirectory() as tmp:
    one = run_mesh("", 1, args.data, args.steps, tmp)
    report = {"config": "configs/moe_demo.yaml (stage 0: L=128, batch 16)", "steps": args.steps,
              "one_device": {"tokens_per_s": round(statistics.median(
                  r["tokens_per_s"] for r in one[1:]), 1),
                             "losses": [round(r["loss"], 6) for r in one]}}
    for mesh in meshes:
      report[mesh] = compare(one, run_mesh(mesh, 8, args.data, args.steps, tmp))
  print(json.dumps(report, indent=None if args.json else 1))
  return None


if __name__ == "__main__":
  main()

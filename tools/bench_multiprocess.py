"""Multi-process training on this machine, measured: 2 CPU processes x 2 devices against
1 process x 4 devices (gloo, as `distributed: true` runs it) and against a plain single process
(XLA's in-process all-reduce); both processes SIGKILLed mid-run and rerun; and the time from a
peer's death to the survivor's exit, for process 1 and for process 0 (the coordinator).

  python tools/bench_multiprocess.py [--steps 8] [--peer-timeout 10] [--json]
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from maxlm.data import prepare, tokenizer  # noqa: E402
from maxlm.train import metrics  # noqa: E402


def data_dir(path):
  rng = np.random.default_rng(0)
  writer = prepare.DataDirWriter(path)
  for i, n in enumerate(rng.lognormal(np.log(40), 0.8, 200).astype(int) + 1):
    source = "prose" if i % 2 else "code"
    writer.add(source, f"{source}-{i}", rng.integers(11, 1000, n).astype(np.int32), [], [], [],
               nbytes=4 * n)
  writer.finish(prepare.Report(), tokenizer.DEFAULT_SPECIAL, 1000, val_fraction=0.1)
  return path


def start(config, run_dir, processes, *args, env=None):
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  return [subprocess.Popen(
      [sys.executable, "-m", "maxlm.cli", "train", config, f"run_dir={run_dir}", *args],
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={4 // processes}",
           "MAXLM_COORDINATOR": f"127.0.0.1:{port}", "MAXLM_NUM_PROCESSES": str(processes),
           "MAXLM_PROCESS_ID": str(i), **(env or {})}) for i in range(processes)]


def finish(procs):
  outs = [p.communicate(timeout=600) for p in procs]
  for p, (_, err) in zip(procs, outs):
    if p.returncode:
      raise SystemExit(f"a training process failed: {err[-500:]}")
  return outs


def rows(run_dir):
  return {r["step"]: r for r in metrics.read_jsonl(run_dir)}


def wait_for_step(run_dir, step):
  while not rows(run_dir) or max(rows(run_dir)) < step:
    time.sleep(0.02)


def compare(a, b):
  steps = sorted(a)
  return {"steps": len(steps),
          "fingerprints_equal": all(a[s]["fingerprint"] == b[s]["fingerprint"] for s in steps),
          "losses_bitwise_equal": sum(a[s]["loss"] == b[s]["loss"] for s in steps),
          "max_abs_loss_diff": max(abs(a[s]["loss"] - b[s]["loss"]) for s in steps)}


def peer_death(config, work, victim, timeout):
  run_dir = os.path.join(work, f"peer{victim}")
  procs = start(config, run_dir, 2, "stages.0.steps=400", env={
      "MAXLM_PEER_TIMEOUT": str(timeout)})
  wait_for_step(run_dir, 3)
  procs[victim].send_signal(signal.SIGKILL)
  t0 = time.perf_counter()
  survivor = procs[1 - victim]
  _, err = survivor.communicate(timeout=600)
  seconds = time.perf_counter() - t0
  procs[victim].wait()
  lines = [x for x in err.splitlines() if x.strip()]
  return {"killed": victim, "exit_code": survivor.returncode, "seconds_to_exit": seconds,
          "last_line": lines[-1][:200] if lines else "", "stderr_lines": len(lines),
          "traceback": "Traceback" in err}


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=8)
  ap.add_argument("--peer-timeout", type=float, default=10)
  ap.add_argument("--json", action="store_true")
  args = ap.parse_args()
  work = tempfile.mkdtemp(prefix="maxlm-bench-mp-")
  raw = {"seed": 0, "distributed": True,
         "data": {"dir": data_dir(os.path.join(work, "data")), "overlap": 4,
                  "mix": {"prose": 0.5, "code": 0.5}, "shuffle_rows": 8, "block_rows": 64},
         "stages": [{"seq_len": 32, "batch": 8, "steps": args.steps}],
         "model": {"size": "tiny", "dtype": "float32", "remat": "none", "d_model": 32,
                   "n_heads": 2, "n_kv_heads": 1, "head_dim": 16, "d_ff": 64, "loss_chunk": 32},
         "train": {"lr": 0.01, "warmup_steps": 2, "checkpoint_every": 2, "eval_every": 4,
                   "eval_tokens": 256}}
  config = os.path.join(work, "cfg.yaml")
  with open(config, "w") as f:
    yaml.safe_dump(raw, f)
  out = {"steps": args.steps, "peer_timeout_s": args.peer_timeout}
  runs = {}
  for name, n, extra in (("1x4", 1, ()), ("2x2", 2, ()), ("plain_1x4", 1, ("distributed=false",))):
    runs[name] = os.path.join(work, name)
    finish(start(config, runs[name], n, *extra))
  out["2x2_vs_1x4"] = compare(rows(runs["1x4"]), rows(runs["2x2"]))
  out["plain_1x4_vs_2x2"] = compare(rows(runs["plain_1x4"]), rows(runs["2x2"]))
  killed = os.path.join(work, "killed")
  procs = start(config, killed, 2)
  wait_for_step(killed, args.steps // 2)
  for p in procs:
    p.send_signal(signal.SIGKILL)
  for p in procs:
    p.wait()
  finish(start(config, killed, 2))
  out["2x2_killed_both_and_rerun_vs_2x2"] = compare(rows(runs["2x2"]), rows(killed))
  out["peer_death"] = [peer_death(config, work, victim, args.peer_timeout) for victim in (1, 0)]
  if args.json:
    print(json.dumps(out, indent=1))
  else:
    for key, value in out.items():
      print(f"{key}: {value}")


if __name__ == "__main__":
  main()

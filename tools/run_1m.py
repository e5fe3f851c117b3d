"""The 1M stage end to end on this machine: configs/tiny_1m.yaml trained, stopped inside the
1M stage, resumed, compared bit for bit with an uninterrupted run, and evaluated; the peak RSS
and wall time of every child process, and the seconds per 1M step.

  python tools/run_1m.py --json                      # one device
  python tools/run_1m.py --json --devices 8          # context parallelism over 8 CPU devices

1. run A: `maxlm train` to the end (uninterrupted).
2. run B: `maxlm train --stop-after N` stops after the first 1M step (a checkpoint is saved),
   then a new process resumes it to the end.
3. A and B must agree bit for bit: every metrics row's loss and batch fingerprint, and every
   parameter and optimizer tensor of the last checkpoint (maxlm/train/verify.py's checks).
4. `maxlm eval A --json` at the 1M stage's L.
Peak RSS is each child's ru_maxrss (os.wait4), the kernel's high-water mark of its resident
memory. Seconds per step are L x batch / tokens_per_s of the 1M stage's metrics rows (its rows
carry no padding: `maxlm ledger configs/tiny_1m.yaml`); the first step of a stage includes
compiling it. With --devices N every stage runs on mesh {data: 1, context: N} of N host-platform
CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=N), on the same 2 cores.
The data dir is the demo's (runs/demo/data, built as `maxlm demo` builds it when missing).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "tiny_1m.yaml")


def child(args, env=None):
  """(returncode, stdout, wall seconds, peak RSS in GiB) of `python -m maxlm.cli ARGS`."""
  t0 = time.perf_counter()
  proc = subprocess.Popen([sys.executable, "-m", "maxlm.cli", *args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, env=env, text=True)
  out, err = _drain(proc)
  _, status, usage = os.wait4(proc.pid, 0)
  proc.returncode = os.waitstatus_to_exitcode(status)
  if proc.returncode:
    raise SystemExit(f"maxlm {' '.join(args[:2])} failed ({proc.returncode}):\n{err[-3000:]}")
  return out, time.perf_counter() - t0, usage.ru_maxrss / 2**20  # KiB on Linux


def _drain(proc):
  """stdout and stderr read to their end without reaping the child (wait4 reaps it)."""
  import threading
  chunks = {"out": [], "err": []}
  threads = [threading.Thread(target=lambda s=s, k=k: chunks[k].append(s.read()))
             for k, s in (("out", proc.stdout), ("err", proc.stderr))]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  return "".join(chunks["out"]), "".join(chunks["err"])


def ensure_data(data_dir):
  """The demo's data dir, prepared as `maxlm demo` prepares it when it is not there yet."""
  from maxlm import demo
  from maxlm.data import corpus, prepare
  if os.path.exists(os.path.join(data_dir, "manifest.json")):
    return
  raw = os.path.join(os.path.dirname(data_dir.rstrip("/")), "raw")
  if not os.path.exists(os.path.join(raw, "code.jsonl")):
    corpus.build(raw)
  prepare.prepare([os.path.join(raw, "prose.jsonl"), os.path.join(raw, "code.jsonl")], data_dir,
                  prepare.Options(vocab_size=4096, overwrite=True, quality=demo.DEMO_QUALITY))


def overrides(data_dir, run_dir, devices, extra=()):
  out = [f"data.dir={data_dir}", f"run_dir={run_dir}", *extra]
  if devices > 1:
    from maxlm import config as config_lib
    n = len(config_lib.load(CONFIG).stages)
    out += [f"stages.{i}.mesh={{data: 1, fsdp: 1, tensor: 1, context: {devices}}}"
            for i in range(n)]
  return out


def steps_1m(rows, stage):
  """[{step, s_per_step, tokens_per_s}] of the rows of the given stage."""
  return [{"step": r["step"], "stage_step": r["stage_step"],
           "s_per_step": stage["tokens"] / r["tokens_per_s"], "loss": r["loss"]}
          for r in rows if r["stage"] == stage["index"]]


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--data", default=os.path.join(REPO, "runs", "demo", "data"))
  p.add_argument("--workdir", help="where runs A and B go (default: a new temporary folder)")
  p.add_argument("--devices", type=int, default=1, help="CPU devices; > 1: mesh context=N")
  p.add_argument("--no-resume", action="store_true", help="run A and the eval only")
  p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                 help="config overrides (the tests shrink the last stage's seq_len)")
  p.add_argument("--json", action="store_true")
  args = p.parse_args()
  from maxlm import config as config_lib
  from maxlm.train import metrics, verify
  ensure_data(args.data)
  work = args.workdir or tempfile.mkdtemp(prefix="maxlm-1m-")
  env = dict(os.environ)  # exactly --devices CPU devices, whatever the caller's XLA_FLAGS
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={args.devices}"])
  cfg = config_lib.load(CONFIG, args.set)
  last = len(cfg.stages) - 1
  stage = {"index": last, "tokens": cfg.stages[last].seq_len * cfg.stages[last].batch}
  before_1m = sum(st.num_steps for st in cfg.stages[:last])
  result = {"config": "configs/tiny_1m.yaml", "devices": args.devices,
            "seq_len": cfg.stages[last].seq_len, "batch": cfg.stages[last].batch, "runs": {}}
  run_a, run_b = os.path.join(work, "a"), os.path.join(work, "b")

  def record(name, run_args, run_dir=None):
    extra = overrides(args.data, run_dir, args.devices, args.set) if run_dir else []
    out, wall, rss = child(run_args + extra, env)
    result["runs"][name] = {"wall_s": round(wall, 1), "peak_rss_gib": round(rss, 3)}
    return out

  record("train", ["train", CONFIG], run_a)
  rows_a = metrics.read_jsonl(run_a)
  result["steps_1m"] = steps_1m(rows_a, stage)
  if not args.no_resume:
    record("train_stopped", ["train", CONFIG, "--stop-after", str(before_1m + 1)], run_b)
    record("train_resumed", ["train", CONFIG], run_b)
    rows_b = metrics.read_jsonl(run_b)
    compared, bad = verify._compare(rows_a, rows_b)
    step_a, state_a = verify._final_state(run_a)
    step_b, state_b = verify._final_state(run_b)
    tensors, differ = verify._compare_states(state_a, state_b)
    result["resume"] = {"stopped_after_step": before_1m + 1, "rows_compared": compared,
                        "rows_differing": bad, "checkpoint": [step_a, step_b],
                        "tensors_compared": tensors, "tensors_differing": differ,
                        "bitwise": not bad and not differ and step_a == step_b}
  out = record("eval", ["eval", run_a, "--json"])
  result["eval"] = json.loads(out.strip().splitlines()[-1])
  result["peak_rss_gib"] = max(r["peak_rss_gib"] for r in result["runs"].values())
  if args.json:
    print(json.dumps(result, indent=1))
  else:
    for name, r in result["runs"].items():
      print(f"{name:<15} {r['wall_s']:>8.1f} s  peak RSS {r['peak_rss_gib']:.2f} GiB")
    for s in result["steps_1m"]:
      print(f"1M step {s['step']}: {s['s_per_step']:.1f} s, loss {s['loss']:.4f}")
    if "resume" in result:
      print(f"resume bitwise: {result['resume']['bitwise']}")
  return 0 if result.get("resume", {}).get("bitwise", True) else 1


if __name__ == "__main__":
  sys.exit(main())

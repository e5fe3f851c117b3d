"""`maxlm verify-restart`: proof that killing and resuming a run changes nothing.

1. Run the config uninterrupted, in a subprocess, to its last step.
2. Run it again in another run_dir and SIGKILL it N times, cycling through three moments:
   mid-stage, right after a stage's last step (the boundary), and while an async checkpoint
   is being written; resume after each kill.
3. Resume once more in this process from a run stopped half way, reusing compiled functions
   (skipped with --processes > 1: it is one process by nature).
   With `corrupt`, the latest checkpoint of the killed run has 64 bytes flipped in its largest
   file before the last resume: that resume must report it corrupt and fall back.
4. Compare step by step the batch fingerprints and losses (every recomputed step too), and at
   the end every parameter and optimizer tensor, bit for bit. Exit 0 only if all are equal.

With `processes` > 1 every run of steps 1 and 2 is that many local processes joined by
jax.distributed (MAXLM_COORDINATOR on a free local port; on CPU over gloo, see
maxlm/parallel/distributed.py), and each kill SIGKILLs all of them at once.
"""

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
import orbax.checkpoint as ocp

from maxlm import MaxlmError, config as config_lib
from maxlm.train import metrics

MOMENTS = ("mid-stage", "stage-boundary", "during-save")


def _command(config_path, overrides, run_dir, processes=1):
  return [sys.executable, "-m", "maxlm.cli", "train", str(config_path), *overrides,
          f"run_dir={run_dir}", *(["distributed=true"] if processes > 1 else [])]


class _Job:
  """`maxlm train` as `processes` local processes (one plain process when 1)."""

  def __init__(self, config_path, overrides, run_dir, processes, env, **popen):
    envs = [env]
    if processes > 1:
      with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
      envs = [{**env, "MAXLM_COORDINATOR": f"127.0.0.1:{port}",
               "MAXLM_NUM_PROCESSES": str(processes), "MAXLM_PROCESS_ID": str(i)}
              for i in range(processes)]
    self.procs = [subprocess.Popen(_command(config_path, overrides, run_dir, processes),
                                   env=e, text=True, **popen) for e in envs]

  def poll(self):
    """None while every process runs, else the first exit status seen."""
    codes = [p.poll() for p in self.procs]
    return next((c for c in codes if c is not None), None)

  def send_signal(self, sig):
    for p in self.procs:
      if p.poll() is None:
        p.send_signal(sig)

  def wait(self):
    return [p.wait() for p in self.procs]

  def communicate(self):
    """(worst exit status, process 0's stdout, every process's stderr)."""
    outs = [p.communicate() for p in self.procs]
    codes = [p.returncode for p in self.procs]
    return (max(codes, key=abs), outs[0][0] or "",
            "".join(err or "" for _, err in outs))


def _run(config_path, overrides, run_dir, processes, env):
  return _Job(config_path, overrides, run_dir, processes, env, stdout=subprocess.PIPE,
              stderr=subprocess.PIPE).communicate()


def _rows(run_dir):
  return metrics.read_jsonl(run_dir)


def _saving(run_dir):
  path = os.path.join(run_dir, "checkpoints")
  return os.path.isdir(path) and any("tmp" in name for name in os.listdir(path))


def _kill_when(proc, run_dir, moment, after_step, boundaries, timeout=600):
  """SIGKILLs proc at the moment; returns (the last step logged, what happened)."""
  end = time.time() + timeout
  target = None
  while time.time() < end and proc.poll() is None:
    rows = _rows(run_dir)
    last = rows[-1]["step"] if rows else -1
    if moment == "during-save" and last > after_step and _saving(run_dir):
      break
    if moment == "stage-boundary" and last in boundaries and last > after_step:
      break
    if moment == "mid-stage":
      if target is None and last >= after_step:
        later = [s for s in range(last + 2, max(boundaries) + 1) if s not in boundaries]
        target = later[len(later) // 3] if later else None
      if target is not None and last >= target:
        break
    time.sleep(0.005)
  if proc.poll() is not None:
    return None, "finished before the kill"
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  rows = _rows(run_dir)
  return (rows[-1]["step"] if rows else -1), "killed"


def corrupt_latest(run_dir):
  """Flips 64 bytes in the middle of the largest file of the latest checkpoint's state;
  returns that checkpoint's step."""
  root = os.path.join(run_dir, "checkpoints")
  steps = [int(n) for n in os.listdir(root) if n.isdigit()] if os.path.isdir(root) else []
  if not steps:
    return None  # nothing saved yet (e.g. --kills 0): nothing to corrupt
  step = max(steps)
  files = [os.path.join(d, f) for d, _, names in os.walk(os.path.join(root, str(step), "state"))
           for f in names]
  target = max(files, key=os.path.getsize)
  with open(target, "r+b") as f:
    middle = os.path.getsize(target) // 2
    f.seek(middle)
    chunk = f.read(64)
    f.seek(middle)
    f.write(bytes(b ^ 0x5A for b in chunk))
  return step


def _final_state(run_dir):
  manager = ocp.CheckpointManager(os.path.abspath(os.path.join(run_dir, "checkpoints")))
  step = manager.latest_step()
  manager.close()
  path = os.path.join(os.path.abspath(run_dir), "checkpoints", str(step), "state")
  with ocp.StandardCheckpointer() as ckpt:  # whole on one device: any saved topology restores
    saved = ckpt.metadata(path).item_metadata
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    state = ckpt.restore(path, jax.tree_util.tree_map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), saved))
  return step, {jax.tree_util.keystr(p): np.asarray(x) for p, x in
                jax.tree_util.tree_leaves_with_path(state)}


def _compare(reference, candidate):
  """(steps compared, mismatching steps) over every logged row of the candidate."""
  want = {r["step"]: r for r in reference}
  bad = []
  for row in candidate:
    ref = want.get(row["step"])
    if ref is None or ref["fingerprint"] != row["fingerprint"] or ref["loss"] != row["loss"]:
      bad.append(row["step"])
  return len(candidate), bad


def _compare_states(a, b):
  diff = [k for k in a if k not in b or a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
          or a[k].tobytes() != b[k].tobytes()]
  return len(a), diff + [k for k in b if k not in a]


def verify(config_path, overrides=(), kills=3, seed=0, workdir=None, log=print, corrupt=False,
           processes=1):
  config = config_lib.load(config_path, overrides)
  rng = random.Random(seed)
  steps = [st.num_steps for st in config.stages]
  boundaries = set(np.cumsum(steps) - 1)
  work = workdir or tempfile.mkdtemp(prefix="maxlm-verify-")
  base, killed, inproc = (os.path.join(work, n) for n in ("uninterrupted", "killed", "inproc"))
  env = {**os.environ, "PYTHONUNBUFFERED": "1"}
  t0 = time.time()
  if processes < 1:
    raise MaxlmError(f"--processes must be >= 1, got {processes}")
  each = f" as {processes} processes" if processes > 1 else ""
  log(f"[1/3] uninterrupted run{each} in {base}")
  code, _, err = _run(config_path, overrides, base, processes, env)
  if code:
    raise MaxlmError(f"the uninterrupted run failed: {err.strip()[-300:]}")
  log(f"[2/3] {kills} SIGKILLs in {killed}")
  events, after = [], -1
  for i in range(kills):
    moment = MOMENTS[i % len(MOMENTS)]
    proc = _Job(config_path, overrides, killed, processes, env, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL)
    time.sleep(rng.random() * 0.2)
    last, what = _kill_when(proc, killed, moment, after, boundaries)
    events.append((moment, last, what))
    log(f"      kill {i + 1}: {moment:<15} at step {last} ({what})")
    after = last if last is not None else after
  flipped = corrupt_latest(killed) if corrupt else None
  if flipped is not None:
    log(f"      corrupted checkpoint {flipped} (64 bytes flipped)")
  code, out, err = _run(config_path, overrides, killed, processes, env)
  if code:
    raise MaxlmError(f"the resumed run failed: {err.strip()[-300:]}")
  caught = flipped is None or f"checkpoint {flipped} is corrupt" in out
  if not caught:
    log(f"      the resume did not report checkpoint {flipped} as corrupt")
  runs = [("killed x%d" % kills, killed)]
  if processes == 1:
    log(f"[3/3] in-process stop and resume in {inproc}")
    from maxlm.train import loop
    cfg = config_lib.load(config_path, [*overrides, f"run_dir={inproc}"])
    quiet = lambda *_: None
    loop.train(cfg, stop_after=max(1, sum(steps) // 2), log=quiet)
    loop.train(cfg, log=quiet)
    runs.append(("in-process", inproc))
  else:
    log("[3/3] in-process stop and resume: skipped (one process by nature)")

  reference = _rows(base)
  ref_step, ref_state = _final_state(base)
  table, ok = [], True
  for name, run_dir in runs:
    n_rows, bad_rows = _compare(reference, _rows(run_dir))
    missing = set(r["step"] for r in reference) - set(r["step"] for r in _rows(run_dir))
    step, state = _final_state(run_dir)
    n_tensors, bad_tensors = _compare_states(ref_state, state)
    same = not bad_rows and not missing and not bad_tensors and step == ref_step
    ok &= same
    table.append((name, n_rows, len(bad_rows) + len(missing), n_tensors, len(bad_tensors),
                  "identical" if same else "DIFFERENT"))
  ok &= caught
  log(f"\n{'run':<12}{'steps logged':>14}{'step diffs':>12}{'tensors':>9}{'tensor diffs':>14}"
      f"  verdict")
  for row in table:
    log(f"{row[0]:<12}{row[1]:>14}{row[2]:>12}{row[3]:>9}{row[4]:>14}  {row[5]}")
  log("\nkills: " + ", ".join(f"{m} at step {s}" for m, s, _ in events)
      + (f"; checkpoint {flipped} corrupted and {'caught' if caught else 'NOT caught'}"
         if flipped is not None else ""))
  log(f"wall time {time.time() - t0:.0f} s; work dir {work}")
  return ok

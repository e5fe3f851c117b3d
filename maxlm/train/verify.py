"""`maxlm verify-restart`: proof that killing and resuming a run changes nothing.

1. Run the config uninterrupted, in a subprocess, to its last step.
2. Run it again in another run_dir and SIGKILL it N times, cycling through three moments:
   mid-stage, right after a stage's last step (the boundary), and while an async checkpoint
   is being written; resume after each kill.
3. Resume once more in this process from a run stopped half way, reusing compiled functions.
   With `corrupt`, the latest checkpoint of the killed run has 64 bytes flipped in its largest
   file before the last resume: that resume must report it corrupt and fall back.
4. Compare step by step the batch fingerprints and losses (every recomputed step too), and at
   the end every parameter and optimizer tensor, bit for bit. Exit 0 only if all are equal.
"""

import os
import random
import signal
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


def _command(config_path, overrides, run_dir):
  return [sys.executable, "-m", "maxlm.cli", "train", str(config_path), *overrides,
          f"run_dir={run_dir}"]


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
  state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
  manager.close()
  return step, {jax.tree_util.keystr(p): np.asarray(x) for p, x in
                jax.tree_util.tree_leaves_with_path(state["state"])}


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


def verify(config_path, overrides=(), kills=3, seed=0, workdir=None, log=print, corrupt=False):
  config = config_lib.load(config_path, overrides)
  rng = random.Random(seed)
  steps = [st.num_steps for st in config.stages]
  boundaries = set(np.cumsum(steps) - 1)
  work = workdir or tempfile.mkdtemp(prefix="maxlm-verify-")
  base, killed, inproc = (os.path.join(work, n) for n in ("uninterrupted", "killed", "inproc"))
  env = {**os.environ, "PYTHONUNBUFFERED": "1"}
  t0 = time.time()
  log(f"[1/3] uninterrupted run in {base}")
  done = subprocess.run(_command(config_path, overrides, base), env=env, capture_output=True,
                        text=True)
  if done.returncode:
    raise MaxlmError(f"the uninterrupted run failed: {done.stderr.strip()[-300:]}")
  log(f"[2/3] {kills} SIGKILLs in {killed}")
  events, after = [], -1
  for i in range(kills):
    moment = MOMENTS[i % len(MOMENTS)]
    proc = subprocess.Popen(_command(config_path, overrides, killed), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(rng.random() * 0.2)
    last, what = _kill_when(proc, killed, moment, after, boundaries)
    events.append((moment, last, what))
    log(f"      kill {i + 1}: {moment:<15} at step {last} ({what})")
    after = last if last is not None else after
  flipped = corrupt_latest(killed) if corrupt else None
  if flipped is not None:
    log(f"      corrupted checkpoint {flipped} (64 bytes flipped)")
  finish = subprocess.run(_command(config_path, overrides, killed), env=env,
                          capture_output=True, text=True)
  if finish.returncode:
    raise MaxlmError(f"the resumed run failed: {finish.stderr.strip()[-300:]}")
  caught = flipped is None or f"checkpoint {flipped} is corrupt" in finish.stdout
  if not caught:
    log(f"      the resume did not report checkpoint {flipped} as corrupt")
  log(f"[3/3] in-process stop and resume in {inproc}")
  from maxlm.train import loop
  cfg = config_lib.load(config_path, [*overrides, f"run_dir={inproc}"])
  quiet = lambda *_: None
  loop.train(cfg, stop_after=max(1, sum(steps) // 2), log=quiet)
  loop.train(cfg, log=quiet)

  reference = _rows(base)
  ref_step, ref_state = _final_state(base)
  table, ok = [], True
  for name, run_dir in (("killed x%d" % kills, killed), ("in-process", inproc)):
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

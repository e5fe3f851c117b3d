"""`maxlm verify-restart`: proof that killing and resuming a run changes nothing.

1. Run the config uninterrupted, in a subprocess, to its last step.
2. Run it again in another run_dir and SIGKILL it N times, cycling through three moments:
   mid-stage, right after a stage's last step (the boundary), and while an async checkpoint
   is being written; resume after each kill. Each job pauses at the step it is to be killed
   at (MAXLM_PAUSE_AFTER, maxlm/train/pause.py; during-save: at a later save, should the save
   in flight be missed), so a kill always lands, however fast the job or loaded the machine.
3. Resume once more in this process from a run stopped half way, reusing compiled functions
   (skipped with --processes > 1: it is one process by nature).
   With `corrupt`, the last kill waits until the killed run has a committed checkpoint; one
   bit of array data in the latest checkpoint is flipped, and the flip is kept only once the
   checkpoint, read back here, fails its checksums (a flip that makes it unreadable instead is
   undone and another place tried); the last resume must then report it corrupt and fall back.
4. Compare step by step the batch fingerprints and losses (every recomputed step too), and at
   the end every parameter and optimizer tensor, bit for bit. Exit 0 only if all are equal.

With `processes` > 1 every run of steps 1 and 2 is that many local processes joined by
jax.distributed (MAXLM_COORDINATOR on a free local port; on CPU over gloo, see
maxlm/parallel/distributed.py), and each kill SIGKILLs all of them at once.
"""

import json
import os
import random
import re
import shutil
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
from maxlm.ckpt import integrity
from maxlm.train import metrics, schedule

MOMENTS = ("mid-stage", "stage-boundary", "during-save")


def _command(config_path, overrides, run_dir, processes=1):
  return [sys.executable, "-m", "maxlm.cli", "train", str(config_path), *overrides,
          f"run_dir={run_dir}", *(["distributed=true"] if processes > 1 else [])]


class _Job:
  """`maxlm train` as `processes` local processes (one plain process when 1)."""

  def __init__(self, config_path, overrides, run_dir, processes, env, **popen):
    envs = [dict(env)]
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


def _committed(run_dir):
  """The steps of the committed checkpoints (Orbax renames a save's folder to its step)."""
  path = os.path.join(run_dir, "checkpoints")
  return sorted(int(n) for n in os.listdir(path) if n.isdigit()) if os.path.isdir(path) else []


def kill_step(moment, after, boundaries, saves, need_checkpoint=False):
  """The global step after which a job resumed past `after` pauses and is killed (during-save:
  where it pauses should the save in flight be missed); None if no later step fits.
  need_checkpoint: no earlier than the first save, so that one is committed by then."""
  later = [s for s in range(after + 2, max(boundaries) + 1) if s not in boundaries]
  at = {"mid-stage": later[len(later) // 3] if later else None,
        "stage-boundary": min((b for b in boundaries if b > after), default=None),
        "during-save": ([s for s in saves if s > after][:2] or [None])[-1]}[moment]
  if at is not None and need_checkpoint:
    at = max(at, min(saves))
  return at


def _kill_when(proc, run_dir, moment, after_step, target, need_checkpoint=False):
  """SIGKILLs proc at the moment (once it has logged `target`, where it pauses; during-save as
  soon as a save is seen in flight); returns (the last step logged, what happened).
  need_checkpoint: not before a checkpoint has been committed. No clock: the job pauses at its
  target, so this waits for that (however slow the machine) or for the job to end."""
  while proc.poll() is None:
    rows = _rows(run_dir)
    last = rows[-1]["step"] if rows else -1
    ready = not need_checkpoint or _committed(run_dir)
    if ready and target is not None and last >= target:
      break
    if ready and moment == "during-save" and last > after_step and _saving(run_dir):
      break
    time.sleep(0.005)
  if proc.poll() is not None:
    return None, "finished before the kill"
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  rows = _rows(run_dir)
  return (rows[-1]["step"] if rows else -1), "killed"


def _flip_bit(path, at):
  with open(path, "r+b") as f:
    f.seek(at)
    byte = f.read(1)[0]
    f.seek(at)
    f.write(bytes([byte ^ 0x01]))


def _plain(key):
  """A leaf path as keystr writes it for dicts and lists: the state restored without its
  optax types names `.mu` as `['mu']`."""
  return re.sub(r"\.(\w+)", r"['\1']", key)


def _fails_its_checksums(run_dir, step):
  """True if checkpoint `step` reads back and an array differs from its digest; False if it
  reads back intact or cannot be read at all (then a resume would call it unreadable)."""
  with open(os.path.join(run_dir, "checkpoints", str(step), "meta", "metadata")) as f:
    want = json.load(f).get("integrity", {}).get("arrays")
  if not want:
    raise MaxlmError(f"--corrupt: checkpoint {step} was written without checksums")
  try:
    state = _restore_whole(run_dir, step)
  except Exception:  # noqa: BLE001 (unreadable: the flip hit a node or a frame, not data)
    return False
  leaves = {_plain(jax.tree_util.keystr(p)): x
            for p, x in jax.tree_util.tree_leaves_with_path(state)}
  for key, digest in want.items():
    name, _, where = key.partition("@")
    if integrity._piece_digest(leaves[_plain(name)], where) != digest:  # noqa: SLF001
      return True
  return False


def corrupt_latest(run_dir, tries=16):
  """Flips one bit of array data in the latest committed checkpoint so that it provably fails
  its checksums; returns that checkpoint's step, or raises MaxlmError saying why it could not.
  Places in the largest data file are tried from the middle outwards; a flip that leaves the
  checkpoint unreadable (an OCDBT node, a compressed frame's header) or unchanged is undone."""
  steps = _committed(run_dir)
  if not steps:
    raise MaxlmError(f"--corrupt: {run_dir} has no committed checkpoint to corrupt")
  step = steps[-1]
  files = [os.path.join(d, f) for d, _, names in
           os.walk(os.path.join(run_dir, "checkpoints", str(step), "state")) for f in names]
  target = max(files, key=os.path.getsize)
  size = os.path.getsize(target)
  if _fails_its_checksums(run_dir, step):
    raise MaxlmError(f"--corrupt: checkpoint {step} fails its checksums before any flip")
  places = [size * (2 * i + 1) // (2 ** (n + 1)) for n in range(5) for i in range(2 ** n)]
  for at in list(dict.fromkeys(places))[:tries]:
    _flip_bit(target, at)
    if _fails_its_checksums(run_dir, step):
      return step
    _flip_bit(target, at)  # undone: the checkpoint is as it was
  raise MaxlmError(f"--corrupt: no one-bit flip among {tries} places in {target} made "
                   f"checkpoint {step} fail its checksums")


def _restore_whole(run_dir, step):
  path = os.path.join(os.path.abspath(run_dir), "checkpoints", str(step), "state")
  with ocp.StandardCheckpointer() as ckpt:  # whole on one device: any saved topology restores
    saved = ckpt.metadata(path).item_metadata
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return ckpt.restore(path, jax.tree_util.tree_map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), saved))


def _final_state(run_dir):
  manager = ocp.CheckpointManager(os.path.abspath(os.path.join(run_dir, "checkpoints")))
  step = manager.latest_step()
  manager.close()
  state = _restore_whole(run_dir, step)
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
  """Runs the proof (the module docstring); True when every run is identical. Without
  `workdir` the proof runs in a temporary folder, removed when it passes and kept (and named)
  when it does not."""
  config = config_lib.load(config_path, overrides)
  _check_args(kills, corrupt, processes)
  work = _work_dir(workdir)
  base, killed, inproc = (os.path.join(work, n) for n in ("uninterrupted", "killed", "inproc"))
  env = {**os.environ, "PYTHONUNBUFFERED": "1"}
  t0 = time.time()
  each = f" as {processes} processes" if processes > 1 else ""
  log(f"[1/3] uninterrupted run{each} in {base}")
  code, _, err = _run(config_path, overrides, base, processes, env)
  if code:
    raise MaxlmError(f"the uninterrupted run failed: {err.strip()[-300:]}")
  log(f"[2/3] {kills} SIGKILLs in {killed}")
  events, flipped, caught = _kill_and_resume(config_path, overrides, killed, work, processes,
                                             env, schedule.Schedule(config), kills, corrupt,
                                             random.Random(seed), log)
  runs = [("killed x%d" % kills, killed)]
  if processes == 1:
    log(f"[3/3] in-process stop and resume in {inproc}")
    _stop_and_resume_here(config_path, overrides, inproc)
    runs.append(("in-process", inproc))
  else:
    log("[3/3] in-process stop and resume: skipped (one process by nature)")
  ok = compare(base, runs, log) and caught
  log("\nkills: " + ", ".join(f"{m} at step {s}" for m, s, _ in events)
      + (f"; checkpoint {flipped} corrupted and {'caught' if caught else 'NOT caught'}"
         if flipped is not None else ""))
  if workdir is None and ok:
    shutil.rmtree(work, ignore_errors=True)
    log(f"wall time {time.time() - t0:.0f} s; temporary work dir {work} removed")
  else:
    log(f"wall time {time.time() - t0:.0f} s; work dir {work} kept")
  return ok


def _check_args(kills, corrupt, processes):
  if processes < 1:
    raise MaxlmError(f"--processes must be >= 1, got {processes}")
  if corrupt and kills < 1:
    raise MaxlmError("--corrupt needs --kills >= 1: it corrupts the killed run's latest "
                     "checkpoint before the last resume")


def _work_dir(workdir):
  """The folder the proof's runs go in: a new temporary one, or `workdir` when it is empty or
  absent (refused when it holds anything: the runs would resume what is there)."""
  if workdir is None:
    return tempfile.mkdtemp(prefix="maxlm-verify-")
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise MaxlmError(f"--workdir {workdir} is a file, not a folder")
  held = sorted(os.listdir(workdir)) if os.path.isdir(workdir) else []
  if held:
    what = ("a run dir" if "config.yaml" in held or "checkpoints" in held else
            "a data dir" if "manifest.json" in held else "not empty")
    raise MaxlmError(f"--workdir {workdir} is {what}: verify-restart writes three runs there "
                     "and would resume or overwrite what it holds; give it a new or empty folder")
  os.makedirs(workdir, exist_ok=True)
  return workdir


def _kill_and_resume(config_path, overrides, killed, work, processes, env, sched, kills,
                     corrupt, rng, log):
  """Kills the run in `killed` `kills` times (cycling through MOMENTS), corrupts its latest
  checkpoint when asked, then resumes it to the end: (kill events, the corrupted checkpoint or
  None, whether the resume reported it corrupt)."""
  boundaries, saves = sched.stage_ends(), sched.save_steps()
  events, after = [], -1
  for i in range(kills):
    moment = MOMENTS[i % len(MOMENTS)]
    need = corrupt and i == kills - 1  # --corrupt needs a checkpoint in the killed run
    at = kill_step(moment, after, boundaries, saves, need)
    pause = {} if at is None else {"MAXLM_PAUSE_AFTER": f"{at}:{os.path.join(work, 'never')}"}
    proc = _Job(config_path, overrides, killed, processes, {**env, **pause},
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(rng.random() * 0.2)
    last, what = _kill_when(proc, killed, moment, after, at, need)
    events.append((moment, last, what))
    log(f"      kill {i + 1}: {moment:<15} at step {last} ({what})")
    after = last if last is not None else after
  flipped = corrupt_latest(killed) if corrupt else None
  if flipped is not None:
    log(f"      corrupted checkpoint {flipped} (one bit of its array data flipped)")
  code, out, err = _run(config_path, overrides, killed, processes, env)
  if code:
    raise MaxlmError(f"the resumed run failed: {err.strip()[-300:]}")
  caught = flipped is None or f"checkpoint {flipped} is corrupt (" in out
  if not caught:
    log(f"      the resume did not report checkpoint {flipped} as corrupt")
  return events, flipped, caught


def _stop_and_resume_here(config_path, overrides, run_dir):
  """Stops a run half way and resumes it in this process, reusing its compiled functions."""
  from maxlm.train import loop
  cfg = config_lib.load(config_path, [*overrides, f"run_dir={run_dir}"])
  quiet = lambda *_: None
  loop.train(cfg, stop_after=max(1, schedule.Schedule(cfg).total // 2), log=quiet)
  loop.train(cfg, log=quiet)


def compare(base, runs, log):
  """Every run against the uninterrupted one, step by step and tensor by tensor; the table."""
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
  log(f"\n{'run':<12}{'steps logged':>14}{'step diffs':>12}{'tensors':>9}{'tensor diffs':>14}"
      f"  verdict")
  for row in table:
    log(f"{row[0]:<12}{row[1]:>14}{row[2]:>12}{row[3]:>9}{row[4]:>14}  {row[5]}")
  return ok

"""Running the points of a sweep: one ordinary `maxlm train` run per (budget, size).

Each point is a config written to OUT/runs/<point>/config.sweep.yaml: the user's config with
the point's model shape, one stage at the first stage's length and batch, `steps` so that
6 N D lands within 2% of the budget (D = steps x batch x L; at least MIN_STEPS steps), a
cosine schedule with 5% warm-up, the width-scaled learning rate lr = 1e-3 sqrt(256 / d_model)
(unless `--lr` or a `train.lr=` override fixes it) and one held-out evaluation at the last
step. The point's own run dir holds its checkpoints, so a killed sweep reruns from where each
point stopped (`maxlm train` resumes); a finished point (its last metrics row carries a
val_loss) is read, not rerun. Points run in child processes, `workers` at a time, each with
its own log in its run dir. Nothing in the point configs depends on time or on the worker
count, so a sweep is deterministic.
"""

import concurrent.futures
import dataclasses
import fcntl
import math
import os
import subprocess
import sys
import threading
import time

import numpy as np
import yaml

from maxlm import MaxlmError, config as config_lib, outputs
from maxlm.data import store
from maxlm.sweep import grid
from maxlm.train import metrics

MIN_STEPS = 25  # rounding steps then moves 6ND at most 2% off the budget
REFERENCE_WIDTH = 256
REFERENCE_LR = 1e-3


@dataclasses.dataclass
class Point:
  budget: float
  shape: grid.Shape
  n_params: int
  steps: int
  tokens: int
  epochs: float
  run_dir: str
  config: dict

  @property
  def name(self):
    return os.path.basename(self.run_dir)

  def result(self):
    """The point's final evaluation, or None while it is not finished."""
    rows = metrics.read_jsonl(self.run_dir)
    last = [r for r in rows if r.get("step") == self.steps - 1 and "val_loss" in r]
    return last[-1] if last else None


def budget_label(budget):
  mantissa, exponent = f"{budget:.2e}".split("e")
  mantissa = mantissa.rstrip("0").rstrip(".")
  return f"{mantissa}e{int(exponent)}"


def width_lr(d_model):
  return REFERENCE_LR * math.sqrt(REFERENCE_WIDTH / d_model)


def base_config(config_path, overrides):
  """(validated Config, plain dict) of the user's config with overrides."""
  base = config_lib.load(config_path, overrides)
  return base, config_lib.to_dict(base)


def data_facts(base):
  """(vocab size, unique training tokens of the sources the first stage mixes)."""
  manifest = store.load_manifest(base.data.dir)
  index = store.load_index(base.data.dir)
  vocab = base.model.vocab_size or int(manifest["vocab_size"])
  mix = base.mix_for(0)
  names = index.sources
  chosen = [i for i, n in enumerate(names) if not mix or n in mix]
  train = (np.asarray(index.split) == store.TRAIN) & np.isin(np.asarray(index.source), chosen)
  return vocab, int(np.asarray(index.length, np.int64)[train].sum())


def plan_points(base, raw, budgets, shapes_for, out, lr, eval_tokens):
  """Every point of the sweep, in budget then size order. shapes_for(budget) -> [Shape]."""
  vocab, unique = data_facts(base)
  first = base.stages[0]
  per_step = first.batch * first.seq_len
  points = []
  for budget in budgets:
    for shape in shapes_for(budget, vocab, base.model.tied_embeddings, per_step):
      n = grid.n_params(shape, vocab, base.model.tied_embeddings, base.model, active=True)
      steps = round(budget / (6 * n) / per_step)
      if steps < MIN_STEPS:
        raise MaxlmError(f"size {shape.label} (N={n:,}) gets {steps} steps of {per_step} "
                         f"tokens at budget {budget:.3g}; a point needs {MIN_STEPS}: drop it "
                         f"or raise the budget")
      name = f"c{budget_label(budget)}_{shape.label}"
      run_dir = os.path.join(out, "runs", name)
      points.append(Point(budget, shape, n, steps, steps * per_step,
                          steps * per_step / unique if unique else float("inf"), run_dir,
                          _point_config(raw, shape, steps, run_dir, lr, eval_tokens)))
  return points, vocab, unique


def _point_config(raw, shape, steps, run_dir, lr, eval_tokens):
  cfg = yaml.safe_load(yaml.safe_dump(raw))  # a deep copy of plain data
  cfg["run_dir"] = run_dir
  cfg["model"].update(shape.model_keys())
  stage = dict(cfg["stages"][0], steps=steps, tokens=0, name="sweep")
  cfg["stages"] = [stage]
  cfg["train"].update(lr=width_lr(shape.d_model) if lr is None else lr,
                      warmup_steps=max(1, round(0.05 * steps)), schedule="cosine",
                      eval_every=steps, checkpoint_every=max(1, steps // 4), keep=2)
  if eval_tokens is not None:
    cfg["train"]["eval_tokens"] = eval_tokens
  return cfg


def check_out(out, points):
  """Refuses an OUT whose existing point configs differ from this sweep's."""
  for p in points:
    path = os.path.join(p.run_dir, "config.sweep.yaml")
    if os.path.exists(path):
      with open(path) as f:
        try:
          found = yaml.safe_load(f)
        except yaml.YAMLError:  # cut short (an older maxlm on a full disk): never trained
          continue
        if found != p.config:
          raise MaxlmError(f"{out} holds another sweep ({path} differs: other config, "
                           f"overrides or options); pass a new --out")


def lock(out):
  """An exclusive lock on OUT for this sweep (released when the process exits)."""
  os.makedirs(out, exist_ok=True)
  handle = open(os.path.join(out, ".sweep-lock"), "a")
  try:
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    raise MaxlmError(f"another `maxlm sweep` is running in {out}; wait for it or pass "
                     f"another --out") from None
  return handle


def run_points(points, workers, log=print):
  """Runs the unfinished points, `workers` at a time, stopping at the first failure; returns
  {name: error line} of failures."""
  todo = [p for p in points if p.result() is None]
  done_flops, started, failures = 0.0, time.perf_counter(), {}
  remaining = sum(6.0 * p.n_params * p.tokens for p in todo)
  if len(todo) < len(points):
    log(f"{len(points) - len(todo)} of {len(points)} points already finished: reusing them")
  pool = concurrent.futures.ThreadPoolExecutor(max(1, workers))
  stop = threading.Event()
  try:
    futures = {pool.submit(_run_one, p, log, stop): p for p in todo}
    for i, future in enumerate(concurrent.futures.as_completed(futures), 1):
      p = futures[future]
      error = future.result()
      if error is _SKIPPED:
        continue
      flops = 6.0 * p.n_params * p.tokens
      done_flops += flops
      remaining -= flops
      eta = (time.perf_counter() - started) / done_flops * remaining
      if error:  # most likely the config: stop rather than fail every point alike
        failures[p.name] = error
        status = f"FAILED: {error}"
        stop.set()
      else:
        r = p.result()
        status = f"val_loss {r['val_loss']:.4f} val_bpb {r.get('val_bpb', float('nan')):.3f}"
      log(f"[{i}/{len(todo)}] {p.name}: N={p.n_params:,} D={p.tokens:,} {status} "
          f"(ETA {int(eta // 60)}:{int(eta % 60):02d})")
  except KeyboardInterrupt:  # the children got the Ctrl-C too: they save and exit
    stop.set()
    pool.shutdown(wait=True)
    raise MaxlmError("interrupted; finished points and checkpoints are kept: rerun the same "
                     "command to continue") from None
  pool.shutdown(wait=True)
  return failures


_SKIPPED = "skipped"  # not started: an earlier point failed or the sweep was interrupted


def _run_one(p, log, stop):
  """Trains one point in a child process; None, _SKIPPED or the error line of a failure."""
  if stop.is_set():
    return _SKIPPED
  log(f"running {p.name}: {p.shape.model_keys()} N={p.n_params:,}, {p.steps} steps, "
      f"{p.epochs:.2f} epochs")
  path = os.path.join(p.run_dir, "config.sweep.yaml")
  try:
    os.makedirs(p.run_dir, exist_ok=True)
    with outputs.writing(path) as tmp, open(tmp, "w") as f:
      f.write(yaml.safe_dump(p.config, sort_keys=False))
  except (OSError, MaxlmError) as e:
    stop.set()
    return str(e) if isinstance(e, MaxlmError) else f"cannot write {p.run_dir}: {e.strerror}"
  with open(os.path.join(p.run_dir, "train.log"), "ab") as logfile:
    code = subprocess.run([sys.executable, "-m", "maxlm.cli", "train", path],
                          stdout=logfile, stderr=subprocess.STDOUT, check=False).returncode
  if code == 0 and p.result() is not None:
    return None
  stop.set()  # before the next point starts in this worker
  if code in (130, -2):
    raise KeyboardInterrupt
  with open(os.path.join(p.run_dir, "train.log"), "rb") as logfile:
    lines = logfile.read().decode(errors="replace").strip().splitlines()
  return (lines[-1] if lines else f"exit code {code}") + f" (log: {p.run_dir}/train.log)"

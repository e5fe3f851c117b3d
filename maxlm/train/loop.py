"""`maxlm train`: the driver of a run, one readable loop.

For each stage: its parts (maxlm/train/stage.py: mesh, model, compiled step), the state
resharded onto its mesh, then for each step: step, log, evaluate and checkpoint when due
(maxlm/train/schedule.py says when). Everything a resume needs is in the checkpoint, and batch
k of stage s depends only on (data, config, s, k), so a run killed at any moment and restarted
continues bit for bit on the same mesh.
"""

import contextlib
import os
import typing

import jax
import yaml

from maxlm import MaxlmError, config as config_lib
from maxlm.ckpt import checkpoint, integrity
from maxlm.data import plan
from maxlm.interop import load as init_lib
from maxlm.parallel import mesh as mesh_lib, preemption, watchdog
from maxlm.train import (console, dpo, grpo, lease, metrics, pause, planned, resume, rundir,
                         schedule, sparse_stage, stage as stage_lib, step as step_lib, step_log)


def train(config, *, stop_after=None, force=False, log=print, lookahead=True):
  """Runs (or resumes) the schedule; returns a summary dict. stop_after: global steps to run
  in this call before saving and returning (the in-process restart check uses it). force:
  take the run_dir's lease over from a holder known to be dead. lookahead: dispatch step k + 1
  before reading step k's metrics (maxlm/train/planned.py; off only to measure its gain)."""
  log = log if isinstance(log, console.Console) else console.Console(log)
  mesh_lib.initialize_distributed(config.distributed)
  with watchdog.watched():  # a lost peer ends this process in bounded time, with one line
    return _train(config, stop_after, force, lookahead, log)


def _train(config, stop_after, force, lookahead, log):
  with log.phase(f"opening {config.data.dir} and checking the config against it"):
    data, vocab = stage_lib.validate(config)
  _warn_unmixed(config, data, log)
  run_dir = rundir.RunDir(config.run_dir)
  run_dir.check_writable()
  with metrics.write_errors(run_dir.local):
    held = lease.acquire(config.run_dir, run_dir.primary, force)
  writer = ckpts = None
  try:
    run_dir.pull()
    ckpts = checkpoint.Checkpoints(config.run_dir, config.train.keep,
                                   config.train.async_checkpoints, log)
    writer = metrics.Writer(run_dir.local)
    return _run(config, data, vocab, run_dir, ckpts, writer, held, stop_after, lookahead,
                log)
  finally:
    log.end_line()  # an error printed next starts on a line of its own
    try:
      if writer is not None:
        writer.close()
      if ckpts is not None:
        ckpts.close(rotate=not held.lost)
    finally:
      run_dir.push(log)
      held.release()


def _warn_unmixed(config, data, log):
  left_out = plan.untrained(config, data.index.sources)
  if left_out and config.data.strict:
    raise MaxlmError(plan.unmixed_line(left_out, strict=True))
  if left_out:
    log(f"warning: {plan.unmixed_line(left_out)}")


def _run(config, data, vocab, run_dir, ckpts, writer, held, stop_after, lookahead, log):
  sched, preempt = schedule.Schedule(config), preemption.Preemption()
  try:
    start = _begin(config, data, vocab, run_dir, ckpts, log)
    steplog = step_log.StepLog(config, sched, log, start.spike_state, start.first_row)
    state = start.state
    for s in range(start.stage, len(config.stages)):
      parts = stage_lib.parts(config, s, vocab)
      state = _enter_stage(config, s, parts, state, start, ckpts, log)
      k0 = start.k if s == start.stage else 0
      steps = _stage_steps(config, data, vocab, s, parts, start, k0, ckpts, run_dir.local,
                           lookahead, log)
      steplog.eta.start_stage()
      for k in range(k0, config.stages[s].num_steps):
        g = sched.offset(s) + k
        stop = preempt.stop_at(g + 1) or (stop_after is not None and
                                          steplog.ran + 1 >= stop_after)
        state, m, batch, seconds, tokens = steps.step(
            state, k, start.consumed, read_now=sched.saves(g, stop) or sched.evaluates(g))
        row = steplog.row(s, k, m, batch, seconds, tokens, parts.model)
        finite = integrity.all_finite(m)
        if finite and sched.evaluates(g):
          row.update(steps.evaluate(state))
        held.check()  # another trainer took the run_dir over: write nothing more
        writer.write(g, row)
        if not finite:
          raise MaxlmError(_diverged(g, m, config, ckpts))
        ckpts.check_errors()
        steplog.done(s, k, row)
        if sched.saves(g, stop):
          resume.save(ckpts, data, state, s, k + 1, g + 1, start.consumed, config, steps.it,
                      steps.it_start, steplog.detector.state(), start.init_from)
          run_dir.push()
        pause.maybe_wait(g, preempt)  # MAXLM_PAUSE_AFTER: tests and verify-restart only
        if stop:
          ckpts.wait()
          log(f"stopped after step {g} ({preempt.reason() or 'stop_after'}); "
              f"checkpoint {g + 1} saved: rerun the same command to resume")
          return {**start.summary, "stopped": True, "step": g + 1}
    ckpts.wait()
    return {**start.summary, "stopped": False, "step": sched.total,
            "final": dict(steplog.last_row)}
  finally:
    preempt.restore()


class _Start(typing.NamedTuple):
  """Where this call starts: a checkpoint's state and position, or nothing (step 0)."""
  state: typing.Any  # None: initialize at the first stage
  stage: int
  k: int
  consumed: dict  # tokens trained on per source, so far
  it_start: typing.Any  # the stage step the saved Grain iterator started at
  resumed: typing.Any  # (checkpoint step, its metadata), or None
  spike_state: typing.Any
  first_row: dict  # {"data_changed": 1} after a resume on changed data
  init_source: typing.Any  # init.from's opened weights (a fresh run only), or None
  init_from: typing.Any  # the init.from record the checkpoints carry
  summary: dict


def _begin(config, data, vocab, run_dir, ckpts, log):
  """The newest good checkpoint, else a fresh start (init.from checked before compiling)."""
  with log.phase(f"looking for checkpoints in {config.run_dir}"):
    found = resume.resume(ckpts, config, data, vocab, log)
  with metrics.write_errors(run_dir.local), open(  # only once the run_dir accepted this config
      os.path.join(run_dir.local, "config.yaml"), "w") as f:
    yaml.safe_dump(config_lib.to_dict(config), f, sort_keys=False)
  run_dir.push()
  checking = (log.phase(f"checking init.from {config.init.from_}")
              if config.init.from_ and found is None else contextlib.nullcontext())
  with checking:  # before anything compiles; a checkpoint in run_dir wins over init.from
    init_source, init_from = init_lib.start(config, data, vocab, found, log)
  if found is None:
    return _Start(None, 0, 0, {}, None, None, None, {}, init_source, init_from,
                  {"resumed_from": None})
  state, meta, step_no, changed = found
  log(f"resumed from checkpoint {step_no} (stage {meta['stage']}, step {meta['stage_step']})")
  return _Start(state, meta["stage"], meta["stage_step"], meta.get("consumed", {}),
                meta.get("iterator_start"), (step_no, meta), meta.get("spikes"),
                {"data_changed": 1} if changed else {}, init_source, init_from,
                {"resumed_from": step_no})


def _enter_stage(config, s, parts, state, start, ckpts, log):
  """The state on stage s's mesh: initialized (or read from init.from) before the first
  stage, grown by the indexer where the stage adds one, resharded."""
  stage = config.stages[s]
  if state is None:
    with log.phase(f"initializing the parameters (seed {config.seed})"):
      state = step_lib.init_state(parts.model, parts.opt, parts.mesh, config.rules, config.seed,
                                  stage.seq_len)
    if start.init_source is not None:
      with log.phase(f"reading the parameters from init.from {config.init.from_}"):
        state = init_lib.into_state(start.init_source, state, parts.model, parts.opt,
                                    parts.mesh, parts.shardings, log)
    ckpts.check_space(state)
  state = sparse_stage.grow(state, parts.model, parts.opt, parts.mesh, config.rules,
                            config.seed, stage.seq_len, parts.shardings)
  return jax.device_put(state, parts.shardings)  # a new stage's mesh reshards the state


def _stage_steps(config, data, vocab, s, parts, start, k0, ckpts, run_dir, lookahead, log):
  """The stage's step runner for its objective (maxlm/train/planned.py, or GRPO's rollouts)."""
  objective, seq_len = config.objective_for(s), config.stages[s].seq_len
  if objective == "grpo":  # rollouts from the current policy: no planned batches to read
    ref = grpo.reference(config, data, vocab, start.init_from, parts.model, parts.shardings,
                         seq_len, log)
    return grpo.Stage(config, data, s, parts, parts.step, ref, run_dir, log)
  step_fn = parts.step
  if objective == "dpo":  # the frozen reference, re-read on every (re)start
    step_fn = dpo.with_reference(step_fn, dpo.reference_params(
        config, data, vocab, start.init_from, parts.model, parts.shardings, seq_len, log))
  first = s == start.stage
  it, it_start = resume.iterator(ckpts, start.resumed if first else None, data, s, k0,
                                 start.it_start if first else None, log)
  return planned.Steps(config, data, s, parts, step_fn, it, it_start, lookahead, log, k0,
                       evaluates=objective != "dpo")


def _diverged(g, m, config, ckpts):
  values = ", ".join(f"{k} {m[k]}" for k in ("loss", "grad_norm", "param_norm") if k in m)
  good = [s for s in ckpts.steps() if s not in ckpts.corrupt and s <= g]
  kept = f"checkpoint {good[-1]} is the last good one" if good else "no checkpoint was saved"
  return (f"step {g + 1}: non-finite values ({values}); stopped without saving, {kept}. "
          f"Likely cause: train.lr={config.train.lr} too high for this model (lower it, or "
          f"raise train.warmup_steps={config.train.warmup_steps}), or train.eps="
          f"{config.train.eps} / model.norm_eps={config.model.norm_eps} too small, or damaged "
          f"data (check it: maxlm check-data {config.data.dir})")

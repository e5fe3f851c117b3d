"""`maxlm train`: the whole schedule, one readable loop.

for each stage: build its mesh and model (recompiles once), reshard the state, then for each
step: read batch k of stage s, step, log, evaluate and checkpoint when due. Everything a resume
needs is in the checkpoint, and batch k of stage s depends only on (data, config, s, k), so a
run killed at any moment and restarted continues bit for bit on the same mesh.
"""

import contextlib
import os
import time
import typing

import jax
import numpy as np
import optax
import yaml

from maxlm import MaxlmError, config as config_lib
from maxlm.data import ledger, loader, plan
from maxlm.eval import bpb, positions
from maxlm.interop import load as init_lib
from maxlm.model import attention as attention_lib, build
from maxlm.parallel import distributed, mesh as mesh_lib, peaks, preemption, watchdog
from maxlm.train import dpo, grpo
from maxlm.train import (checkpoint, console, integrity, lease, metrics, moe_state, optimizer,
                         pause, resume, rundir, sparse_stage, spikes, step as step_lib)

_COMPILED = {}  # (config, stage, vocab) -> compiled functions; an in-process resume reuses them
# Dispatch step k+1 before reading step k's metrics (read one step late; a step that is due to
# evaluate, checkpoint or stop is read at once, so a non-finite state is never saved).
# tools/bench_step_overlap.py turns it off to measure the gain.
LOOKAHEAD = True


def validate(config):
  """Every check that needs no compilation: data, vocabulary, meshes, attention impls."""
  data = loader.Data(config)
  vocab = _vocab(config, data)
  if vocab < int(data.manifest["vocab_size"]):
    raise MaxlmError(f"model.vocab_size={vocab} is smaller than the tokenizer's "
                     f"{data.manifest['vocab_size']}")
  _check_objective(config, data)
  n = len(jax.devices())
  params = build.param_axes(config, vocab)
  for i, stage in enumerate(config.stages):
    try:
      shape = dict(zip(config_lib.MESH_AXES, mesh_lib.mesh_shape(stage.mesh, n)))
    except MaxlmError as e:
      raise MaxlmError(f"stages.{i}.mesh: {e}") from None
    _check_params_divide(i, shape, config.rules, params)
    batch_ways = int(np.prod([shape[a] for a in config.rules.get("batch", ())]))
    if (stage.batch // config.train.grad_accum) % batch_ways:
      raise MaxlmError(f"stages.{i}.batch={stage.batch} (per micro-batch "
                       f"{stage.batch // config.train.grad_accum}) is not divisible by the "
                       f"{batch_ways} ways the batch is sharded")
    if shape["context"] > 1 and stage.seq_len % (2 * shape["context"]):
      raise MaxlmError(f"stages.{i}.seq_len={stage.seq_len} must divide into 2 x context = "
                       f"{2 * shape['context']} equal chunks for context parallelism")
    if shape["context"] > 1 and stage.sparse.mode == "sparse" and (
        stage.sparse.select == "token" or (stage.seq_len // (2 * shape["context"]))
        % stage.sparse.block):
      raise MaxlmError(f"stages.{i}.sparse: context parallelism (mesh context="
                       f"{shape['context']}) needs select=block with seq_len / (2 x context) "
                       f"a multiple of sparse.block={stage.sparse.block}")
    impl = attention_lib.resolve(stage.attention, seq_len=stage.seq_len)
    multiple = {"splash": 128, "gpu": 16}.get(impl)  # rows of any length are padded to a tile
    if multiple and min(stage.block_q, 128 if impl == "gpu" else stage.block_q) % multiple:
      raise MaxlmError(f"stages.{i}.block_q={stage.block_q}: the {impl} kernel's tiles must be "
                       f"multiples of {multiple}")
    backend = jax.default_backend()
    if (impl, backend) in (("gpu", "cpu"), ("splash", "cpu")):
      raise MaxlmError(f"stages.{i}.attention={impl} needs a {'GPU' if impl == 'gpu' else 'TPU'}"
                       f"; this machine has only a CPU (set stages.{i}.attention=auto)")
    data.rows_per_host(i, jax.process_count())
  return data, vocab


def _check_objective(config, data):
  """Pairs under the LM objective would teach the rejected answers too: refused."""
  paired = {n for n, src in data.manifest["sources"].items() if src.get("pairs")}
  for i in range(len(config.stages)):
    mix = config.mix_for(i) or dict.fromkeys(data.manifest["sources"], 1.0)
    used = sorted(n for n in paired if mix.get(n, 0) > 0)
    if used and config.objective_for(i) == "lm":
      raise MaxlmError(f"stages.{i} trains on preference pairs (source {used[0]!r}) with "
                       "train.objective=lm, which would learn the rejected answers too: set "
                       "train.objective=dpo, or leave the source out of the mix (docs/pairs.md)")
    if not used and config.objective_for(i) == "dpo":
      raise MaxlmError(f"stages.{i}: train.objective=dpo, but no source in its mix holds "
                       f"preference pairs ({config.data.dir}; docs/pairs.md)")


def _check_params_divide(i, shape, rules, params):
  for path, dims, names in params:
    for size, name in zip(dims, names):
      axes = rules.get(name, ()) if name else ()
      ways = int(np.prod([shape[a] for a in axes]))
      if size % ways:
        raise MaxlmError(f"stages.{i}.mesh: parameter {path} has {size} along '{name}', which "
                         f"the mesh splits {ways} ways ({' x '.join(axes)}); choose mesh sizes "
                         "that divide it")


def _vocab(config, data):
  return config.model.vocab_size or int(data.manifest["vocab_size"])


class StageParts(typing.NamedTuple):
  mesh: typing.Any
  model: typing.Any
  opt: typing.Any
  step: typing.Any  # jitted train step
  nll: typing.Any  # jitted per-position NLL
  shardings: dict  # of the train state on this stage's mesh


def stage_parts(config, s, vocab):
  """The stage's mesh, model, optimizer, compiled functions and state shardings (cached)."""
  key = (repr(config), s, vocab)
  if key not in _COMPILED:
    stage = config.stages[s]
    mesh = mesh_lib.make_mesh(stage.mesh)
    model = build.model_for(config, s, mesh, vocab)
    total = sum(st.num_steps for st in config.stages)
    opt, schedule = optimizer.make(config.train, total)
    objective = config.objective_for(s)
    step = (dpo.jit_step(model, opt, schedule, config) if objective == "dpo" else
            grpo.jit_update(model, opt, schedule, config) if objective == "grpo" else
            jax.jit(step_lib.make_train_step(model, opt, schedule, config.rules, model.cfg,
                                             config.train.grad_accum), donate_argnums=0))
    nll = jax.jit(step_lib.make_eval_step(model, config.rules, model.cfg))
    shardings = _state_shardings(model, opt, mesh, config.rules, stage.seq_len)
    _COMPILED[key] = StageParts(mesh, model, opt, step, nll, shardings)
  return _COMPILED[key]


def _state_shardings(model, opt, mesh, rules, seq_len):
  params = build.param_shardings(model, mesh, rules, seq_len)
  abstract_params = jax.tree_util.tree_map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      build.abstract_params(model, seq_len), params)
  scalar = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  # AdamW's moments are sharded as their parameters, its counters replicated. (XLA left to
  # choose replicates the moments: zeros_like does not depend on the sharded input.)
  opt_sh = optax.tree_map_params(opt, lambda _, sh: sh, jax.eval_shape(opt.init, abstract_params),
                                 params, transform_non_params=lambda _: scalar)
  out = {"params": params, "opt_state": opt_sh, "step": scalar, "rng": scalar}
  if moe_state.enabled(model.cfg):  # MoE's balancing bias (maxlm/train/moe_state.py)
    out[moe_state.BIAS] = moe_state.shardings(
        build.abstract_collection(model, moe_state.BIAS, seq_len), mesh)
  return out


def train(config, *, stop_after=None, force=False, log=print):
  """Runs (or resumes) the schedule; returns a summary dict. stop_after: global steps to run
  in this call before saving and returning (the in-process restart check uses it). force:
  take the run_dir's lease over from a holder known to be dead."""
  log = log if isinstance(log, console.Console) else console.Console(log)
  mesh_lib.initialize_distributed(config.distributed)
  with watchdog.watched():  # a lost peer ends this process in bounded time, with one line
    return _train(config, stop_after, force, log)


def _train(config, stop_after, force, log):
  with log.phase(f"opening {config.data.dir} and checking the config against it"):
    data, vocab = validate(config)
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
    return _run(config, data, vocab, run_dir, ckpts, writer, held, stop_after, log)
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


def _run(config, data, vocab, run_dir, ckpts, writer, held, stop_after, log):
  offsets = np.cumsum([0] + [st.num_steps for st in config.stages])
  total = int(offsets[-1])
  peak, _ = peaks.per_device(config.model.dtype)  # MFU's denominator: x the device count
  preempt = preemption.Preemption()
  state, stage0, k0, consumed, it_start, resumed = None, 0, 0, {}, None, None
  spike_state = None
  ran, summary, first_row = 0, {"resumed_from": None}, {}
  eta = console.Eta((st.num_steps, st.batch * st.seq_len) for st in config.stages)
  try:
    with log.phase(f"looking for checkpoints in {config.run_dir}"):
      found = resume.resume(ckpts, config, data, vocab, stage_parts, log)
    with metrics.write_errors(run_dir.local), open(  # only once the run_dir accepted this config
        os.path.join(run_dir.local, "config.yaml"), "w") as f:
      yaml.safe_dump(config_lib.to_dict(config), f, sort_keys=False)
    run_dir.push()
    if found is not None:
      state, meta, step_no, changed = found
      stage0, k0, consumed = meta["stage"], meta["stage_step"], meta.get("consumed", {})
      it_start, resumed = meta.get("iterator_start"), (step_no, meta)
      summary["resumed_from"] = step_no
      first_row = {"data_changed": 1} if changed else {}
      spike_state = meta.get("spikes")
      log(f"resumed from checkpoint {step_no} (stage {stage0}, step {k0})")
    checking = (log.phase(f"checking init.from {config.init.from_}")
                if config.init.from_ and found is None else contextlib.nullcontext())
    with checking:  # before anything compiles; a checkpoint in run_dir wins over init.from
      init_source, init_from = init_lib.start(config, data, vocab, found, log)
    detector = spikes.Detector(config.train.spike_window, config.train.spike_sigmas, spike_state)
    for s in range(stage0, len(config.stages)):
      stage = config.stages[s]
      mesh, model, opt, step_fn, nll_fn, shardings = stage_parts(config, s, vocab)
      if state is None:
        with log.phase(f"initializing the parameters (seed {config.seed})"):
          state = step_lib.init_state(model, opt, mesh, config.rules, config.seed,
                                      stage.seq_len)
        if init_source is not None:
          with log.phase(f"reading the parameters from init.from {config.init.from_}"):
            state = init_lib.into_state(init_source, state, model, opt, mesh, shardings, log)
        ckpts.check_space(state)
      state = sparse_stage.grow(state, model, opt, mesh, config.rules, config.seed,
                                stage.seq_len, shardings)  # the first indexer stage adds it
      state = jax.device_put(state, shardings)  # a new stage's mesh reshards the state
      objective, runner = config.objective_for(s), None
      if objective == "dpo":  # the frozen reference, re-read on every (re)start
        step_fn = dpo.with_reference(step_fn, dpo.reference_params(
            config, data, vocab, init_from, model, shardings, stage.seq_len, log))
      if objective == "grpo":  # rollouts from the current policy: no planned batches to read
        runner = grpo.Stage(config, data, s, stage_parts(config, s, vocab), step_fn,
                            grpo.reference(config, data, vocab, init_from, model, shardings,
                                           stage.seq_len, log), run_dir.local, log)
        it, it_start = None, None
      else:
        it, it_start = resume.iterator(ckpts, resumed, data, s, k0, it_start, log)
      steps = stage.num_steps
      eta.start_stage()
      ahead = None  # (batch, metrics on device) of step k, dispatched while k-1 ran
      for k in range(k0, steps):
        g = int(offsets[s]) + k
        last = k == steps - 1
        stop = preempt.stop_at(g + 1) or (stop_after is not None and ran + 1 >= stop_after)
        due = last or stop or (g + 1) % config.train.checkpoint_every == 0 or bool(
            config.train.eval_every and (g + 1) % config.train.eval_every == 0)
        if runner is not None:
          t0 = time.perf_counter()
          state, m, batch, prompt_tokens = runner.step(state, s, k, g)
        elif ahead is None:
          batch = next(it)
          t0 = time.perf_counter()
          with (log.phase(f"compiling the stage-{s} step (L={stage.seq_len}, batch "
                          f"{stage.batch}) and running step {k + 1}") if k == k0
                else contextlib.nullcontext()):
            with mesh:
              state, m = step_fn(state, mesh_lib.place_batch(batch, mesh, config.rules))
            if k == k0:
              jax.block_until_ready(m)
        else:
          (batch, m), ahead = ahead, None
        if LOOKAHEAD and not due and runner is None:  # queue step k+1 before reading step k's metrics: the
          nb = next(it)            # device never waits on the host (its batch is placed now)
          with mesh:
            state, m_next = step_fn(state, mesh_lib.place_batch(nb, mesh, config.rules))
          ahead = (nb, m_next)
        m = {key: float(v) for key, v in jax.device_get(m).items()}
        dt = time.perf_counter() - t0
        t0 = time.perf_counter()  # step k+1's time starts when step k's metrics arrive
        real = int((batch["segment_ids"] > 0).sum()) * jax.process_count()
        flops = build.batch_flops_per_token(model.cfg, stage.seq_len, batch["segment_ids"])
        row = {"stage": s, "stage_step": k, **m, "tokens_per_s": real / dt,
               "mfu": peaks.mfu(flops, real, dt, peak, jax.device_count()),
               "fingerprint": distributed.fingerprint(batch, g),
               **(grpo.ledger(prompt_tokens, consumed) if runner is not None else
                  _loss_tokens(data, s, k, consumed)), **first_row}
        first_row = {}
        spike = detector.observe(s, m["loss"])
        if spike:
          row["spike"] = spike
          log(f"loss spike at step {g}: "
              f"{m['loss']:.4f} > {spike['threshold']:.4f} (mean + "
              f"{config.train.spike_sigmas:g} std of the last {config.train.spike_window} "
              f"steps); maxlm trace {config.run_dir} --step {g}")
        finite = integrity.all_finite(m)
        if finite and config.train.eval_every and (g + 1) % config.train.eval_every == 0 and (
            objective != "dpo"):
          row.update(runner.evaluate(state["params"]) if runner is not None else
                     _evaluate(nll_fn, state, data, stage, mesh, config, log))
        held.check()  # another trainer took the run_dir over: write nothing more
        writer.write(g, row)
        if not finite:
          raise MaxlmError(_diverged(g, m, config, ckpts))
        ckpts.check_errors()
        ran += 1
        _progress(log, eta, s, k, steps, g, total, m, row)
        if last or stop or (g + 1) % config.train.checkpoint_every == 0:
          resume.save(ckpts, data, state, s, k + 1, g + 1, consumed, config, it, it_start,
                      detector.state(), init_from)
          run_dir.push()
        pause.maybe_wait(g, preempt)  # MAXLM_PAUSE_AFTER: tests and verify-restart only
        if stop:
          ckpts.wait()
          log(f"stopped after step {g + 1} ({preempt.reason() or 'stop_after'}); "
              f"checkpoint {g + 1} saved: rerun the same command to resume")
          return {**summary, "stopped": True, "step": g + 1}
      k0, it_start, resumed = 0, None, None
    ckpts.wait()
    return {**summary, "stopped": False, "step": total, "final": dict(row) if ran else {}}
  finally:
    preempt.restore()


def _diverged(g, m, config, ckpts):
  values = ", ".join(f"{k} {m[k]}" for k in ("loss", "grad_norm", "param_norm") if k in m)
  good = [s for s in ckpts.steps() if s not in ckpts.corrupt and s <= g]
  kept = f"checkpoint {good[-1]} is the last good one" if good else "no checkpoint was saved"
  return (f"step {g + 1}: non-finite values ({values}); stopped without saving, {kept}. "
          f"Likely cause: train.lr={config.train.lr} too high for this model (lower it, or "
          f"raise train.warmup_steps={config.train.warmup_steps}), or train.eps="
          f"{config.train.eps} / model.norm_eps={config.model.norm_eps} too small, or damaged "
          f"data (check it: maxlm check-data {config.data.dir})")


def _loss_tokens(data, s, k, consumed):
  """Loss positions per source in global batch k of stage s (from the plan), and the totals."""
  rows = data.global_batch_pieces(s, k)
  pieces = [p for row in rows for p in row]
  cols = np.array([p[:6] for p in pieces], np.int64)
  block = plan.Block(row_ptr=None, pool=cols[:, 0], doc=cols[:, 1], start=cols[:, 2],
                     end=cols[:, 3], ctx=cols[:, 4], fim=cols[:, 5], order=None)
  loss = ledger.piece_counts(data.index, block)["loss"]
  out = {}
  for i, name in enumerate(data.index.sources):
    n = int(loss[cols[:, 0] == i].sum())
    if n:
      consumed[name] = consumed.get(name, 0) + n
      out[f"loss_tokens/{name}"] = n
  return out


def _evaluate(nll_fn, state, data, stage, mesh, config, log):
  """The held-out metrics (maxlm/eval/bpb.py) and loss by position (maxlm/eval/positions.py);
  the first evaluation of a process says which sources have too little held-out text to
  trust."""
  def nll(batch):
    with mesh:
      return distributed.gather_rows(nll_fn(state["params"], mesh_lib.place_batch(
          distributed.host_rows(batch), mesh, config.rules), state.get(moe_state.BIAS)))
  table = bpb.evaluate_table(nll, data, stage.seq_len, stage.batch, config.train.eval_tokens)
  if config.run_dir not in _WARNED_SMALL and bpb.small_sources(table):
    _WARNED_SMALL.add(config.run_dir)
    log(bpb.small_note(bpb.small_sources(table)))
  by_position = positions.by_position(nll, data, stage.seq_len, stage.batch,
                                      config.train.eval_tokens)
  return {**bpb.as_metrics(table), **positions.as_metrics(by_position)}


_WARNED_SMALL = set()  # run dirs whose small held-out sets this process has named


def _progress(log, eta, s, k, steps, g, total, m, row):
  eta.step(g)
  log.progress(console.progress_line(s, k, steps, g, total, row, eta.left(g)),
               keep="val_loss" in row or k + 1 == steps)


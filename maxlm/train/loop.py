"""`maxlm train`: the whole schedule, one readable loop.

for each stage: build its mesh and model (recompiles once), reshard the state, then for each
step: read batch k of stage s, step, log, evaluate and checkpoint when due. Everything a resume
needs is in the checkpoint, and batch k of stage s depends only on (data, config, s, k), so a
run killed at any moment and restarted continues bit for bit on the same mesh.
"""

import hashlib
import os
import signal
import sys
import time
import typing

import jax
import numpy as np
import yaml

from maxlm import MaxlmError, config as config_lib
from maxlm.data import ledger, loader, plan
from maxlm.eval import bpb
from maxlm.model import attention as attention_lib, build
from maxlm.parallel import mesh as mesh_lib
from maxlm.train import checkpoint, metrics, optimizer, rundir, step as step_lib

_COMPILED = {}  # (config, stage, vocab) -> compiled functions; an in-process resume reuses them


class Preemption:
  """SIGTERM / SIGINT set a flag; the loop saves a checkpoint and exits 0."""

  def __init__(self):
    self.signal = None
    self._old = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
      try:
        self._old[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread
        pass

  def _handle(self, signum, _):
    self.signal = signal.Signals(signum).name

  def restore(self):
    for sig, old in self._old.items():
      signal.signal(sig, old)


def fingerprint(batch):
  h = hashlib.sha256()
  for name in sorted(batch):
    h.update(np.ascontiguousarray(batch[name]).tobytes())
  return h.hexdigest()[:16]


def validate(config):
  """Every check that needs no compilation: data, vocabulary, meshes, attention impls."""
  data = loader.Data(config)
  vocab = _vocab(config, data)
  if vocab < int(data.manifest["vocab_size"]):
    raise MaxlmError(f"model.vocab_size={vocab} is smaller than the tokenizer's "
                     f"{data.manifest['vocab_size']}")
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
    impl = attention_lib.resolve(stage.attention)
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


def check_same_model(config, vocab, meta):
  """A checkpoint restores only into the parameter shapes it was saved with."""
  saved_vocab = meta.get("vocab", vocab)
  shapes = lambda c, v: [(path, shape) for path, shape, _ in build.param_axes(c, v)]
  if shapes(config_lib.from_dict(meta["config"]), saved_vocab) == shapes(config, vocab):
    return
  there = {**meta["config"]["model"], "vocab": saved_vocab}
  here = {**config_lib.to_dict(config)["model"], "vocab": vocab}
  diff = [f"{k} {there.get(k)} there, {v} here" for k, v in here.items() if there.get(k) != v]
  raise MaxlmError(f"run_dir {config.run_dir} holds checkpoints of another model "
                   f"({'; '.join(diff)}): pass a new run_dir=, or the model settings it "
                   "was trained with")


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
    step = jax.jit(step_lib.make_train_step(model, opt, schedule, config.rules, model.cfg,
                                            config.train.grad_accum), donate_argnums=0)
    nll = jax.jit(step_lib.make_eval_step(model, config.rules, model.cfg))
    shardings = _state_shardings(model, opt, mesh, config.rules, stage.seq_len)
    _COMPILED[key] = StageParts(mesh, model, opt, step, nll, shardings)
  return _COMPILED[key]


def _state_shardings(model, opt, mesh, rules, seq_len):
  params = build.param_shardings(model, mesh, rules, seq_len)
  abstract_params = jax.tree_util.tree_map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      jax.eval_shape(lambda: build.init_params_abstract(model, seq_len)), params)
  with mesh:
    opt_sh = jax.jit(opt.init).lower(abstract_params).compile().output_shardings
  scalar = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  opt_sh = jax.tree_util.tree_map(  # optimizer counters come back on one device: replicate
      lambda sh: sh if isinstance(sh, jax.sharding.NamedSharding) else scalar, opt_sh)
  return {"params": params, "opt_state": opt_sh, "step": scalar, "rng": scalar}


def train(config, *, stop_after=None, log=print):
  """Runs (or resumes) the schedule; returns a summary dict. stop_after: global steps to run
  in this call before saving and returning (the in-process restart check uses it)."""
  mesh_lib.initialize_distributed(config.distributed)
  data, vocab = validate(config)
  run_dir = rundir.RunDir(config.run_dir)
  run_dir.check_writable()
  run_dir.pull()
  with open(os.path.join(run_dir.local, "config.yaml"), "w") as f:
    yaml.safe_dump(config_lib.to_dict(config), f, sort_keys=False)
  run_dir.push()
  ckpts = checkpoint.Checkpoints(config.run_dir, config.train.keep,
                                 config.train.async_checkpoints, log)
  writer = metrics.Writer(run_dir.local)
  offsets = np.cumsum([0] + [st.num_steps for st in config.stages])
  total = int(offsets[-1])
  peak = measure_peak_flops()
  preempt = Preemption()
  state, stage0, k0, consumed, it_start = None, 0, 0, {}, None
  resume = ckpts.latest_readable()
  ran, summary = 0, {"resumed_from": None}
  try:
    while resume is not None and state is None:
      step_no, meta = resume
      check_same_model(config, vocab, meta)
      stage0, k0, consumed = meta["stage"], meta["stage_step"], meta.get("consumed", {})
      it_start = meta.get("iterator_start")
      if meta.get("planner"):
        data.planner.seed_snapshot(plan.Snapshot(**meta["planner"]))
      try:
        state = restore_state(ckpts, step_no, config, stage0, vocab)
        summary["resumed_from"] = step_no
        log(f"resumed from checkpoint {step_no} (stage {stage0}, step {k0})")
      except Exception as e:
        log(f"checkpoint {step_no} is unreadable ({type(e).__name__}); trying the one before")
        earlier = [s for s in ckpts.steps() if s < step_no]
        if not earlier:  # never start over silently on top of a run's checkpoints
          raise MaxlmError(f"no checkpoint in {ckpts.dir} restores into this model (last: "
                           f"{type(e).__name__}: {str(e).splitlines()[0][:160]}); pass a new "
                           "run_dir=, or delete that folder to start over") from None
        resume = (earlier[-1], ckpts.meta(earlier[-1]))
        stage0, k0, consumed, it_start = 0, 0, {}, None
    for s in range(stage0, len(config.stages)):
      stage = config.stages[s]
      mesh, model, opt, step_fn, nll_fn, shardings = stage_parts(config, s, vocab)
      if state is None:
        state = step_lib.init_state(model, opt, mesh, config.rules, config.seed, stage.seq_len)
      state = jax.device_put(state, shardings)  # a new stage's mesh reshards the state
      it, it_start = _iterator(ckpts, summary["resumed_from"], data, s, k0, it_start, log)
      steps = stage.num_steps
      start_time = time.perf_counter()
      for k in range(k0, steps):
        batch = next(it)
        g = int(offsets[s]) + k
        t0 = time.perf_counter()
        with mesh:
          state, m = step_fn(state, mesh_lib.place_batch(batch, mesh, config.rules))
        m = {key: float(v) for key, v in jax.device_get(m).items()}
        dt = time.perf_counter() - t0
        real = int((batch["segment_ids"] > 0).sum()) * jax.process_count()
        flops = build.flops_per_token(model.cfg, stage.seq_len,
                                      build.mean_attended(batch["segment_ids"]))
        row = {"stage": s, "stage_step": k, **m, "tokens_per_s": real / dt,
               "mfu": flops * real / dt / peak, "fingerprint": fingerprint(batch),
               **_loss_tokens(data, s, k, consumed)}
        if config.train.eval_every and (g + 1) % config.train.eval_every == 0:
          row.update(_evaluate(nll_fn, state, data, stage, mesh, config))
        writer.write(g, row)
        ran += 1
        _progress(log, s, k, steps, g, total, m, row, start_time, k0)
        last = k == steps - 1
        stop = preempt.signal or (stop_after is not None and ran >= stop_after)
        if last or stop or (g + 1) % config.train.checkpoint_every == 0:
          _save(ckpts, data, state, s, k + 1, g + 1, consumed, config, it, it_start)
          run_dir.push()
        if stop:
          ckpts.wait()
          log(f"stopped after step {g + 1} ({preempt.signal or 'stop_after'}); "
              f"checkpoint {g + 1} saved: rerun the same command to resume")
          return {**summary, "stopped": True, "step": g + 1}
      k0, it_start = 0, None
    ckpts.wait()
    return {**summary, "stopped": False, "step": total, "final": dict(row) if ran else {}}
  finally:
    preempt.restore()
    writer.close()
    try:
      ckpts.close()
    finally:
      run_dir.push(log)


def restore_state(ckpts, step_no, config, s, vocab):
  """The train state of checkpoint step_no, placed in stage s's shardings."""
  parts = stage_parts(config, s, vocab)
  abstract = checkpoint.abstract(jax.eval_shape(
      lambda: step_lib.init_state_abstract(parts.model, parts.opt, config.seed,
                                           config.stages[s].seq_len)), parts.shardings)
  return ckpts.restore(step_no, abstract)


def _iterator(ckpts, resumed_step, data, s, k0, it_start, log):
  """The stage's Grain iterator at step k0: its saved state restored when there is one (the
  iterator is rebuilt from the same start), else started at k0 (batches depend on k alone)."""
  host, hosts = jax.process_index(), jax.process_count()
  if resumed_step is not None and it_start is not None and k0 > 0:
    try:
      it = loader.iterator(data, s, host, hosts, start_step=it_start)
      return ckpts.restore_iterator(resumed_step, it), it_start
    except Exception as e:  # another worker or host count: the step alone is enough
      log(f"Grain iterator state not restored ({type(e).__name__}); starting at step {k0}")
  return loader.iterator(data, s, host, hosts, start_step=k0), k0


def _save(ckpts, data, state, s, next_k, global_step, consumed, config, it, it_start):
  stage = config.stages[s]
  if next_k >= stage.num_steps and s + 1 < len(config.stages):
    s, next_k = s + 1, 0  # a stage boundary: resume at the next stage's first step
    it = None
  rows = next_k * stage.batch if it is not None else 0
  snap = data.planner.snapshot(s, rows // config.data.block_rows)
  meta = {"stage": s, "stage_step": next_k, "global_step": global_step, "consumed": consumed,
          "iterator_start": it_start if it is not None else None,
          "planner": checkpoint.snapshot_to_json(snap), "config": config_lib.to_dict(config),
          "vocab": _vocab(config, data)}
  ckpts.save(global_step, state, meta, it)


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


def _evaluate(nll_fn, state, data, stage, mesh, config):
  def nll(batch):
    with mesh:
      return jax.device_get(nll_fn(state["params"], mesh_lib.place_batch(batch, mesh,
                                                                          config.rules)))
  return bpb.evaluate(nll, data, stage.seq_len, stage.batch, config.train.eval_rows)


def _progress(log, s, k, steps, g, total, m, row, start_time, k0):
  done = k - k0 + 1
  eta = (time.perf_counter() - start_time) / done * (total - g - 1)
  line = (f"stage {s} step {k + 1}/{steps} (total {g + 1}/{total}) loss {m['loss']:.4f} "
          f"lr {m['lr']:.2e} {row['tokens_per_s']:,.0f} tok/s ETA {int(eta // 60)}:"
          f"{int(eta % 60):02d}")
  if "val_loss" in row:
    line += f" val_loss {row['val_loss']:.4f} val_bpb {row['val_bpb']:.3f}"
  if sys.stdout.isatty() and "val_loss" not in row and k + 1 < steps:
    print("\r" + line, end="", flush=True)
  else:
    log(("\r" if sys.stdout.isatty() else "") + line)


def measure_peak_flops(n=1024, repeats=3):
  """This machine's matmul FLOP/s in f32 (the MFU denominator on CPU; a datasheet elsewhere)."""
  kind = jax.devices()[0].device_kind.lower()
  for name, flops in (("h200", 989e12), ("h100", 989e12), ("a100", 312e12), ("v5p", 459e12),
                      ("v5 lite", 197e12), ("v6", 918e12), ("v4", 275e12)):
    if name in kind:
      return flops
  x = jax.numpy.ones((n, n), jax.numpy.float32)
  f = jax.jit(lambda a: a @ a)
  jax.block_until_ready(f(x))
  best = float("inf")
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(f(x))
    best = min(best, time.perf_counter() - t)
  return 2 * n ** 3 / best

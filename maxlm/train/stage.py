"""A stage's parts, shared by every command that runs or reads a run: the checks that need no
compilation (`validate`), and per stage its mesh, model, optimizer, jitted train and eval steps
and the train state's shardings (`parts`, compiled once per process and reused by an
in-process resume). The train loop, eval, trace, resume, verify-restart and the memory estimate
all ask here, so they build the same step.
"""

import typing

import jax
import numpy as np
import optax

from maxlm import MaxlmError, config as config_lib
from maxlm.data import loader
from maxlm.model import build, impl as impl_lib, moe_state
from maxlm.parallel import mesh as mesh_lib
from maxlm.train import dpo, grpo, optimizer, schedule, step as step_lib

_COMPILED = {}  # (config, stage, vocab) -> StageParts


def validate(config):
  """Every check that needs no compilation: data, vocabulary, meshes, attention impls."""
  data = loader.Data(config)
  vocab = vocab_of(config, data)
  if vocab < int(data.manifest["vocab_size"]):
    raise MaxlmError(f"model.vocab_size={vocab} is smaller than the tokenizer's "
                     f"{data.manifest['vocab_size']}")
  _check_objective(config, data)
  params = build.param_axes(config, vocab)
  for i, stage in enumerate(config.stages):
    check_stage_mesh(config, i, len(jax.devices()), params)
    impl_lib.choose(stage, jax.default_backend(), f"stages.{i}")
    data.rows_per_host(i, jax.process_count())
  return data, vocab


def check_stage_mesh(config, i, n, params):
  """Stage i's mesh on n devices, asked by a run and by `maxlm compile` for its target: the
  mesh fits n, the parameters (`params`: build.param_axes) and the rows divide over it, and
  context parallelism's chunks are whole. One-line errors."""
  stage = config.stages[i]
  try:
    shape = dict(zip(config_lib.MESH_AXES, mesh_lib.mesh_shape(stage.mesh, n)))
  except MaxlmError as e:
    raise MaxlmError(f"stages.{i}.mesh: {e}") from None
  check_params_divide(i, shape, config.rules, params)
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


def check_params_divide(i, shape, rules, params):
  for path, dims, names in params:
    for size, name in zip(dims, names):
      axes = rules.get(name, ()) if name else ()
      ways = int(np.prod([shape[a] for a in axes]))
      if size % ways:
        raise MaxlmError(f"stages.{i}.mesh: parameter {path} has {size} along '{name}', which "
                         f"the mesh splits {ways} ways ({' x '.join(axes)}); choose mesh sizes "
                         "that divide it")


def vocab_of(config, data):
  return config.model.vocab_size or int(data.manifest["vocab_size"])


class StageParts(typing.NamedTuple):
  mesh: typing.Any
  model: typing.Any
  opt: typing.Any
  step: typing.Any  # jitted train step
  nll: typing.Any  # jitted per-position NLL
  shardings: dict  # of the train state on this stage's mesh


def parts(config, s, vocab):
  """The stage's mesh, model, optimizer, compiled functions and state shardings (cached)."""
  key = (repr(config), s, vocab)
  if key not in _COMPILED:
    mesh, model, opt, step, shardings = unjitted(config, s, vocab)
    nll = jax.jit(step_lib.make_eval_step(model, config.rules, model.cfg))
    _COMPILED[key] = StageParts(mesh, model, opt, jax.jit(step, donate_argnums=0), nll,
                                shardings)
  return _COMPILED[key]


def unjitted(config, s, vocab, devices=None, platform=None):
  """(mesh, model, optimizer, the objective's train step before jit, state shardings) of
  stage s over `devices` (default: every device of the job) of `platform` (default: this
  process's backend): what `parts` compiles here, what the memory estimate compiles on other
  device counts, and what `maxlm compile` compiles for a TPU slice."""
  stage = config.stages[s]
  mesh = mesh_lib.make_mesh(stage.mesh, *([devices] if devices is not None else []))
  model = build.model_for(config, s, mesh, vocab, platform)
  opt, lr = optimizer.make(config.train, schedule.Schedule(config).total,
                           build.param_names(model, stage.seq_len), mesh)
  step = train_step(config, s, model, opt, lr)
  return mesh, model, opt, step, state_shardings(model, opt, mesh, config.rules, stage.seq_len)


def train_step(config, s, model, opt, schedule):
  """Stage s's train step for its objective, unjitted: lm's step(state, batch), dpo's
  step(state, batch, reference params), grpo's update(state, batch, old_logp, reference
  params, inner)."""
  objective, t = config.objective_for(s), config.train
  if objective == "dpo":
    return dpo.make_train_step(model, opt, schedule, config.rules, model.cfg, t.grad_accum,
                               t.dpo.beta, t.dpo.label_smoothing)
  if objective == "grpo":
    return grpo.make_update(model, opt, schedule, config.rules, model.cfg, t.grad_accum, t.grpo)
  return step_lib.make_train_step(model, opt, schedule, config.rules, model.cfg, t.grad_accum)


def state_shardings(model, opt, mesh, rules, seq_len):
  params = build.param_shardings(model, mesh, rules, seq_len)
  abstract_params = jax.tree_util.tree_map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      build.abstract_params(model, seq_len), params)
  scalar = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  # AdamW's moments are sharded as their parameters, its counters replicated. (XLA left to
  # choose replicates the moments: zeros_like does not depend on the sharded input.)
  # (Muon's partition masks each half's state where the other half's parameters are)
  masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
  opt_sh = optax.tree_map_params(opt, lambda x, sh: x if masked(x) else sh,
                                 jax.eval_shape(opt.init, abstract_params), params,
                                 transform_non_params=lambda _: scalar, is_leaf=masked)
  out = {"params": params, "opt_state": opt_sh, "step": scalar, "rng": scalar}
  if moe_state.enabled(model.cfg):  # MoE's balancing bias (maxlm/model/moe_state.py)
    out[moe_state.BIAS] = moe_state.shardings(
        build.abstract_collection(model, moe_state.BIAS, seq_len), mesh)
  return out


def clear_cache():
  """Forgets every stage's compiled parts, as a new process would start."""
  _COMPILED.clear()

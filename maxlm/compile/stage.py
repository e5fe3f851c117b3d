"""One stage's real train step compiled for a target's devices: the stage's parts as a run
builds them (maxlm/train/stage.py: its objective, sparse mode, MoE, mesh, remat, loss_chunk,
grad_accum) over the target's devices, with the implementations the target runs, lowered from
abstract arguments (nothing is allocated) and compiled by the target's compiler."""

import time

import jax

from maxlm.compile import report
from maxlm.model import build, impl as impl_lib
from maxlm.train import memory, stage as stage_lib


def compile_stage(config, s, vocab, devices, platform):
  """{"stage", "seq_len", "compiled", "collectives", "cost", "flops", "compile_s", ...} of
  stage s compiled for `devices` of `platform`."""
  stage = config.stages[s]
  t0 = time.perf_counter()
  stage_lib.check_stage_mesh(config, s, len(devices), build.param_axes(config, vocab))
  lowered, model = memory.lower(config, s, vocab, devices, platform)
  try:
    compiled = lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    compiled, refused = None, report.out_of_memory(str(e))
    if refused is None:
      raise
  tokens = stage.batch * stage.seq_len
  choice = impl_lib.choose(stage, platform, f"stages.{s}")
  out = {"stage": s, "name": stage.name or str(s), "seq_len": stage.seq_len,
         "batch": stage.batch, "objective": config.objective_for(s),
         "attention": impl_lib.attention_name(config.model, stage, choice),
         "sparse": impl_lib.sparse_name(config.model, stage, choice),
         "grouped": choice.grouped if config.model.moe.experts else None,
         "flops": {"analytic": build.flops_per_token(model.cfg, stage.seq_len) * tokens},
         "compile_s": round(time.perf_counter() - t0, 1)}
  if compiled is None:  # the compiler refused the step: it needs more than a chip holds
    return {**out, "compiled": refused, "collectives": {}, "cost": {}}
  return {**out, "compiled": memory.compiled_bytes(compiled),
          "collectives": report.collectives(compiled.as_text()), "cost": report.cost(compiled)}

"""Opening a finished (or running) run_dir: its config, data, model and latest parameters."""

from maxlm import MaxlmError, config as config_lib, io
from maxlm.ckpt import checkpoint
from maxlm.train import resume, stage as stage_lib


def open_run(run_dir, overrides=(), stage=None):
  """(config, data, stage index, mesh, model, params, step, collections) at the run's latest
  checkpoint, built for `stage` (None: the checkpoint's); `collections` holds the model's other
  variables ({"moe_bias": ...} for an MoE run balanced by bias, so routing matches training;
  else {})."""
  path = io.join(run_dir, "config.yaml")
  if not io.exists(path):
    raise MaxlmError(f"{run_dir} is not a run dir (no config.yaml); run `maxlm train` first")
  config = config_lib.load(path, [*overrides, f"run_dir={run_dir}"])
  if stage is not None and not 0 <= stage < len(config.stages):  # before reading anything
    raise MaxlmError(f"--stage {stage}: the run's config has stages 0..{len(config.stages) - 1}")
  data, vocab = stage_lib.validate(config)
  for attempt in range(3):  # a live trainer may rotate a checkpoint out while we read it
    try:
      state, meta, step = _latest(run_dir, config, data, vocab)
      break
    except _Rotated as e:
      if attempt == 2:
        raise MaxlmError(str(e)) from None
  s = meta["stage"] if stage is None else stage
  parts = stage_lib.parts(config, s, vocab)
  collections = {"moe_bias": state["moe_bias"]} if "moe_bias" in state else {}
  return config, data, s, parts.mesh, parts.model, state["params"], step, collections


def _latest(run_dir, config, data, vocab):
  """(state, meta, step) of the newest checkpoint that verifies (read-only: a run may be
  training in run_dir)."""
  try:
    ckpts = checkpoint.Checkpoints(run_dir, config.train.keep, False, log=print, read_only=True)
  except MaxlmError as e:  # a step folder vanished while Orbax listed them
    raise _Rotated(str(e)) from None
  try:
    before = ckpts.steps()
    try:
      found = resume.resume(ckpts, config, data, vocab, log=print, reader=True)
    except MaxlmError as e:
      if sorted(ckpts.manager.all_steps(read=True)) != before:
        raise _Rotated(str(e)) from None
      raise
    if found is None:
      raise MaxlmError(f"{run_dir} has no readable checkpoint yet")
    state, meta, step, _ = found
    return state, meta, step
  finally:
    ckpts.close()


class _Rotated(MaxlmError):
  """The checkpoints changed while we read them (a trainer is running in run_dir)."""

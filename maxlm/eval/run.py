"""Opening a finished (or running) run_dir: its config, data, model and latest parameters."""

from maxlm import MaxlmError, config as config_lib, io
from maxlm.train import checkpoint, loop, resume


def open_run(run_dir, overrides=()):
  """(config, data, stage index, mesh, model, params) at the run's latest checkpoint."""
  path = io.join(run_dir, "config.yaml")
  if not io.exists(path):
    raise MaxlmError(f"{run_dir} is not a run dir (no config.yaml); run `maxlm train` first")
  config = config_lib.load(path, [*overrides, f"run_dir={run_dir}"])
  data, vocab = loop.validate(config)
  ckpts = checkpoint.Checkpoints(run_dir, config.train.keep, False, log=print, read_only=True)
  try:
    found = resume.resume(ckpts, config, data, vocab, loop.stage_parts, log=print)
    if found is None:
      raise MaxlmError(f"{run_dir} has no readable checkpoint yet")
    state, meta, step, _ = found
    s = meta["stage"]
  finally:
    ckpts.close()
  parts = loop.stage_parts(config, s, vocab)
  return config, data, s, parts.mesh, parts.model, state["params"], step

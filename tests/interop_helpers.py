"""Helpers of the export/import tests (tests/test_interop_moe.py, tests/test_interop_v4.py): a
tree flattened by key, parameters read back through `init.from`, and a run's saved state."""

import dataclasses
import os

import jax
import numpy as np

from maxlm import config as config_lib
from maxlm.interop import load


def flat(tree):
  """{keystr: numpy array} of a tree."""
  return {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def load_back(config, folder, params, bias, **model):
  """(params, bias or None) read from `folder` by init.from, for `config` with `model` keys
  replaced, shaped like `params` and `bias`."""
  cfg = dataclasses.replace(config.model, **model)
  raw = config_lib.to_dict(config)
  raw["model"] = {**raw["model"], **model}
  raw["init"] = {"from": str(folder)}
  source = load.open_source(config_lib.from_dict(raw), cfg.vocab_size, None, log=lambda _: 0)
  shaped = jax.tree_util.tree_map(np.asarray, params)
  return (load.params(source, cfg, shaped),
          None if bias is None else load.moe_bias(source, cfg, bias))


def checkpoint_state(run_dir, step):
  """The train state a run saved at `step`, as numpy arrays."""
  import orbax.checkpoint as ocp
  state = ocp.PyTreeCheckpointer().restore(os.path.join(run_dir, "checkpoints", str(step),
                                                        "state"))
  return jax.tree_util.tree_map(np.asarray, state)

"""Orbax checkpoints: state, data position and metadata, saved async, restored with fallback.

A checkpoint at global step n holds
  state  params, optimizer state, step and RNG key (restored into the stage's shardings)
  data   the Grain iterator state of the stage being read
  meta   stage, the next step within it, the planner snapshot for that step's block, the
         ledger consumed so far, and the resolved config
Orbax writes into a temporary folder and renames it when complete, so a process killed during
a save leaves the previous checkpoint as the latest. A checkpoint that fails to restore is
reported and skipped for the one before it.
"""

import dataclasses
import os

import grain
import jax
import orbax.checkpoint as ocp

from maxlm import MaxlmError


class Checkpoints:

  def __init__(self, run_dir, keep, use_async, log=print):
    self.log = log
    self.dir = os.path.join(os.path.abspath(run_dir) if "://" not in run_dir else run_dir,
                            "checkpoints")
    try:
      self.manager = ocp.CheckpointManager(self.dir, options=ocp.CheckpointManagerOptions(
          max_to_keep=keep, enable_async_checkpointing=use_async, create=True))
    except (OSError, PermissionError) as e:
      raise MaxlmError(f"cannot use run_dir {run_dir!r} for checkpoints: {e}") from None

  def steps(self):
    return sorted(self.manager.all_steps())

  def save(self, step, state, meta, iterator=None):
    if step in self.manager.all_steps():  # one that failed to restore: replace it
      self.log(f"replacing checkpoint {step}")
      self.manager.delete(step)
    items = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}
    if iterator is not None:
      items["data"] = grain.checkpoint.CheckpointSave(iterator)
    self.manager.save(step, args=ocp.args.Composite(**items), force=True)

  def meta(self, step):
    return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
        "meta"]

  def restore(self, step, abstract_state):
    return self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state)))["state"]

  def restore_iterator(self, step, iterator):
    self.manager.restore(step, args=ocp.args.Composite(
        data=grain.checkpoint.CheckpointRestore(iterator)))
    return iterator

  def latest_readable(self):
    """(step, meta) of the newest checkpoint whose metadata reads, or None."""
    for step in reversed(self.steps()):
      try:
        return step, self.meta(step)
      except Exception as e:  # a damaged checkpoint: say so and fall back
        self.log(f"checkpoint {step} is unreadable ({type(e).__name__}: "
                 f"{str(e).splitlines()[0][:120]}); trying the one before")
    return None

  def wait(self):
    self.manager.wait_until_finished()

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()


def abstract(tree, shardings):
  return jax.tree_util.tree_map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def snapshot_to_json(snap):
  return dataclasses.asdict(snap)

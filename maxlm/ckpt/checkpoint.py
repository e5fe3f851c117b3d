"""Orbax checkpoints: state, data position and metadata, saved async, verified on restore.

A checkpoint at global step n holds
  state  params, optimizer state, step and RNG key (restored into the stage's shardings)
  data   the Grain iterator state of the stage being read
  meta   stage, the next step within it, the planner snapshot for that step's block, the
         ledger consumed so far, the data dir's fingerprint, the resolved config, and the
         checksums of all of it (`maxlm.ckpt.integrity`)
Orbax writes into a temporary folder and renames it when complete, so a process killed during
a save leaves the previous checkpoint as the latest; its partial folder is removed on the next
start. A checkpoint whose metadata or arrays do not match their checksums is reported as
corrupt and the one before it is used.

Rotation is ours, not Orbax's `max_to_keep`: the newest `keep` checkpoints not known to be
corrupt are kept, and so is the checkpoint this run resumed from (the last one verified by a
restore), so a run of bad saves can never rotate the last good checkpoint out. Only
checkpoints whose step had a finite loss and finite parameters are written (the loop stops
before saving otherwise). A write that fails (disk full, permissions, quota) raises a one-line
`MaxlmError` at the next step instead of letting training go on without checkpoints.
"""

import dataclasses
import errno
import logging
import os
import shutil

import grain
import jax
import orbax.checkpoint as ocp

from maxlm import MaxlmError, io
from maxlm.ckpt import integrity


class Checkpoints:

  def __init__(self, run_dir, keep, use_async, log=print, read_only=False):
    self.log = log
    self.read_only = read_only  # a reader (eval, generate) beside a live run: no cleanup
    self.keep = keep
    self.anchor = None  # the checkpoint this run resumed from: verified, never rotated out
    self.corrupt = set()
    self.failed = False
    self.pending = None  # the step of the last save, until it is seen committed
    _quiet_background_errors()
    self.dir = io.join(os.path.abspath(run_dir) if io.is_local(run_dir) else run_dir,
                       "checkpoints")
    partial = [] if read_only else self._partial_folders()
    try:
      self.manager = ocp.CheckpointManager(self.dir, options=ocp.CheckpointManagerOptions(
          max_to_keep=None, enable_async_checkpointing=use_async, create=not read_only,
          cleanup_tmp_directories=not read_only, read_only=read_only))
    except (OSError, PermissionError) as e:
      raise MaxlmError(f"cannot use run_dir {run_dir!r} for checkpoints: {e}") from None
    if partial:
      log(f"removed {len(partial)} partial checkpoint folder(s) left by an interrupted save: "
          f"{', '.join(partial)}")

  def _partial_folders(self):
    if not io.is_local(self.dir) or not os.path.isdir(self.dir):
      return []
    return sorted(n for n in os.listdir(self.dir) if ".orbax-checkpoint-tmp" in n)

  def steps(self):
    return sorted(self.manager.all_steps())

  def check_space(self, state):
    """Fails before the first save when the run_dir's file system cannot hold a checkpoint."""
    if not io.is_local(self.dir):
      return
    need = sum(x.nbytes for x in jax.tree_util.tree_leaves(state))
    free = shutil.disk_usage(self.dir).free
    if free < need:
      raise MaxlmError(f"{self.dir} has {_size(free)} free, and a checkpoint of this model "
                       f"needs about {_size(need)}: free space or choose another run_dir=")

  def save(self, step, state, meta, iterator=None):
    self.check_errors()
    self._wait()
    self._prune()
    if step in self.manager.all_steps():  # a corrupt or unrestorable one: replace it
      self.log(f"replacing checkpoint {step}")
      self.manager.delete(step)
      self.corrupt.discard(step)
    meta = integrity.seal(meta, state, iterator.get_state() if iterator is not None else None)
    items = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}
    if iterator is not None:
      items["data"] = grain.checkpoint.CheckpointSave(iterator)
    try:
      self.manager.save(step, args=ocp.args.Composite(**items), force=True)
    except Exception as e:  # noqa: BLE001 (a write failure, whatever layer reports it)
      raise self._write_error(step, e) from None
    self.pending = step

  def check_errors(self):
    """Raises the failure of the last save as soon as it has ended in the background. (Orbax's
    finalize thread only logs the exception, and lists the step either way, so an ended save
    is judged by its thread's exception and by the step's folder being there.)"""
    thread = self._save_thread()
    if self.pending is None or (thread is not None and thread.is_alive()):
      return
    step, self.pending = self.pending, None
    error = getattr(thread, "exception", None)
    if error is None and step in self.manager.all_steps(read=True):
      return
    raise self._write_error(step, error or RuntimeError("the save ended without committing"))

  def _save_thread(self):
    holder = getattr(self.manager, "_finalize_thread", None)  # orbax 0.12's save thread
    return holder.get() if holder is not None else None

  def _write_error(self, step, e):
    self.failed = True
    text = io.describe_error(e)
    where = f"checkpoint {step}" if step is not None else "a checkpoint"
    space = ""
    if io.is_local(self.dir) and os.path.isdir(self.dir):
      space = f"; {_size(shutil.disk_usage(self.dir).free)} free there"
    hint = (" (the disk is full)" if _is_enospc(e) else "")
    return MaxlmError(f"could not write {where} to {self.dir}{hint}: {text}{space}. Training "
                      "stopped; earlier checkpoints are intact: fix the cause and rerun to "
                      "resume")

  def _prune(self):
    steps = [s for s in self.steps() if s not in self.corrupt]
    keep = set(steps[-self.keep:]) | {self.anchor}
    newest_good = steps[-1] if steps else None
    for s in self.steps():
      if s not in keep and (s not in self.corrupt or (newest_good or -1) > s):
        self.manager.delete(s)
        self.corrupt.discard(s)

  def meta(self, step):
    meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
        "meta"]
    integrity.check_meta(step, meta)
    return meta

  def restore(self, step, abstract_state, meta):
    """The verified train state of checkpoint `step`; CorruptCheckpoint if it does not match
    its checksums."""
    state = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state)))["state"]
    integrity.check_state(step, meta, state)
    if not integrity.is_sealed(meta):
      self.log(f"checkpoint {step} was written before checksums existed: not verified")
    self.anchor = step
    return state

  def restore_iterator(self, step, iterator):
    self.manager.restore(step, args=ocp.args.Composite(
        data=grain.checkpoint.CheckpointRestore(iterator)))
    return iterator

  def latest_readable(self):
    """(step, meta) of the newest checkpoint whose metadata reads and checks, or None."""
    return self.readable_before(None)

  def readable_before(self, limit):
    for step in reversed([s for s in self.steps() if limit is None or s < limit]):
      try:
        return step, self.meta(step)
      except integrity.CorruptCheckpoint as e:
        self.corrupt.add(step)
        self.log(f"{e}; trying the one before")
      except Exception as e:  # noqa: BLE001 (a damaged checkpoint: say so and fall back)
        self.log(f"checkpoint {step} is unreadable ({type(e).__name__}: "
                 f"{str(e).splitlines()[0][:120] if str(e) else ''}); trying the one before")
    return None

  def _wait(self):
    try:
      self.manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001
      raise self._write_error(self.pending, e) from None
    self.check_errors()

  def wait(self):
    self._wait()

  def close(self, rotate=True):
    """Waits for a save in flight and rotates; after a failed write, only releases. rotate:
    False when the run_dir is no longer ours (its lease was lost)."""
    try:
      if not self.failed:
        self._wait()
        if rotate and not self.read_only:
          self._prune()
    finally:
      try:
        self.manager.close()
      except Exception:  # noqa: BLE001 (the failure was already reported)
        if not self.failed:
          raise


def _quiet_background_errors():
  """Orbax's background threads log a failed write as pages of tracebacks, some at exit; we
  report it as one line instead (MAXLM_DEBUG=1 shows them)."""
  if not os.environ.get("MAXLM_DEBUG"):
    for name in ("absl", "asyncio"):
      logging.getLogger(name).setLevel(logging.CRITICAL)


def _is_enospc(e):
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(e):
      return True
    e = e.__cause__ or e.__context__
  return False


def _size(n):
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if n < 1024 or unit == "TiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024


def abstract(tree, shardings):
  return jax.tree_util.tree_map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def snapshot_to_json(snap):
  return dataclasses.asdict(snap)

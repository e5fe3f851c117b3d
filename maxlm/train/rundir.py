"""A run's directory, local or in an object store (gs://), through one code path.

Orbax writes checkpoints straight to `run_dir/checkpoints` either way. The small files
(`config.yaml`, `metrics.jsonl`, TensorBoard event files) are appended to in a local folder,
which for a local run_dir is the run_dir itself; for an object store it is a mirror under
`~/.cache/maxlm/runs`, pulled at start and copied up whole through `maxlm.io` at every
checkpoint and at exit, because objects cannot be appended to. Only process 0 keeps them
(and checks that the run_dir is writable); other processes write into a throwaway folder,
removed at exit.

A local run_dir is never a data dir nor inside one (recognised by its markers, manifest.json
and the token files: maxlm/outputs.py), refused before anything is written: a run's files
would mix with the data's. A data dir inside the run_dir is fine (the demo keeps runs/demo/data
beside its run's files).
"""

import atexit
import hashlib
import os
import re
import shutil
import tempfile

import jax

from maxlm import MaxlmError, io, outputs

SMALL_FILES = ("config.yaml", "metrics.jsonl")


class RunDir:

  def __init__(self, path):
    self.path = str(path)
    self.remote = not io.is_local(self.path)
    self.primary = jax.process_index() == 0
    if not self.primary:
      self.local = tempfile.mkdtemp(prefix="maxlm-run-")
      atexit.register(shutil.rmtree, self.local, True)
    elif self.remote:
      cache = os.environ.get("MAXLM_CACHE", os.path.expanduser("~/.cache/maxlm"))
      tag = hashlib.sha256(self.path.encode()).hexdigest()[:12]
      self.local = os.path.join(cache, "runs", re.sub(r"[^\w.-]+", "_", self.path) + "-" + tag)
    else:
      self.local = self.path
    if not self.remote:
      _refuse_data_dir(self.path)

  def check_writable(self):
    """Fails early, with what to do, when the run_dir cannot be written."""
    if not self.primary:
      return
    probe = io.join(self.path, ".maxlm-write-check")
    if not self.remote:
      try:
        os.makedirs(self.path, exist_ok=True)
        with open(probe, "w"):
          pass
        os.remove(probe)
      except OSError as e:
        raise MaxlmError(f"run_dir {self.path} is not writable ({e.strerror}); pass "
                         "run_dir=A_WRITABLE_FOLDER") from None
      return
    try:
      io.write_bytes(probe, b"")
      io.delete(probe)
    except MaxlmError as e:
      raise MaxlmError(f"run_dir {self.path} is not writable ({e}); check that the bucket "
                       "exists and that this machine's account may write to it "
                       "(roles/storage.objectAdmin)") from None

  def pull(self):
    """Brings an object-store run's small files into a fresh local mirror (to append to)."""
    if self.remote and self.primary:
      shutil.rmtree(self.local, ignore_errors=True)  # the store, not an old mirror, is the truth
    os.makedirs(self.local, exist_ok=True)
    for name in SMALL_FILES if self.remote and self.primary else ():
      remote = io.join(self.path, name)
      if io.exists(remote):
        with open(os.path.join(self.local, name), "wb") as f:
          f.write(io.read_bytes(remote))

  def push(self, log=None):
    """Copies the local mirror's small files and event files up to the object store. With
    `log`, a failure is reported there instead of raised (on the way out of a run)."""
    if not (self.remote and self.primary):
      return
    try:
      for name in sorted(os.listdir(self.local)):
        if name in SMALL_FILES or name.startswith("events.out.tfevents."):
          with open(os.path.join(self.local, name), "rb") as f:
            io.write_bytes(io.join(self.path, name), f.read())
    except (MaxlmError, OSError) as e:
      if log is None:
        raise
      log(f"could not copy metrics to {self.path}: {e}")


def _refuse_data_dir(path):
  """One line when the local `path` is a data dir or lies inside one."""
  found = outputs.data_dir_holding(path)
  if found:
    where = "is" if found == os.path.realpath(path) else "lies inside"
    raise MaxlmError(f"run_dir {path} {where} the data dir {found}: a run never writes into "
                     "its data; pass run_dir=A_FOLDER_OUTSIDE_IT")

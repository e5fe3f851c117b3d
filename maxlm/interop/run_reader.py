"""A run's checkpoint read one parameter at a time, by HF tensor name (layout.py).

Orbax restores whole pytrees into device shardings; exporting or initialising from a model
that may not fit one host needs less: each array is opened with TensorStore where Orbax wrote
it (`state/`, OCDBT or plain zarr, merged across the processes that wrote it) and read alone,
so a host holds one parameter (with all its layers: Orbax writes an array as chunks that span
the stacked layer axis, so a layer cannot be decoded without the others; reading layer by layer
measured 12x slower for the 150m model) and the Llama tensors made from it. Every array is
checked against the digest the checkpoint recorded for it (`maxlm.ckpt.integrity`) before it
is used. (A multi-process checkpoint records per-shard digests of process 0's shards only;
those arrays are read unverified, and `unverified` names them.)
"""

import dataclasses
import json
import os

import numpy as np
import tensorstore as ts

from maxlm import MaxlmError, config as config_lib, io
from maxlm.ckpt import checkpoint, integrity
from maxlm.interop import layout, tensor_map


def split_spec(spec):
  """'RUN_DIR' or 'RUN_DIR@STEP' -> (run_dir, step or None)."""
  path, at, step = spec.rpartition("@")
  if at and path and step.isdigit():
    return path, int(step)
  return spec, None


class RunCheckpoint:
  """The parameters of one checkpoint of a maxlm run, by HF tensor name (`get`)."""

  def __init__(self, run_dir, step=None, log=print):
    self.run_dir = run_dir
    if not io.exists(io.join(run_dir, "config.yaml")):
      what = "does not exist" if not io.exists(run_dir) else "is not a maxlm run dir"
      raise MaxlmError(f"{run_dir} {what} (no config.yaml)")
    ckpts = checkpoint.Checkpoints(run_dir, 1, False, log=log, read_only=True)
    try:
      steps = ckpts.steps()
      if not steps:
        raise MaxlmError(f"{run_dir} has no checkpoint yet")
      if step is None:
        found = ckpts.latest_readable()
        if found is None:
          raise MaxlmError(f"no checkpoint in {run_dir} has readable, intact metadata")
        step, meta = found
      elif step not in steps:
        raise MaxlmError(f"{run_dir} has no checkpoint {step}; it has "
                         f"{', '.join(map(str, steps))}")
      else:
        try:
          meta = ckpts.meta(step)
        except integrity.CorruptCheckpoint as e:
          raise MaxlmError(str(e)) from None
      self.state_dir = io.join(io.join(ckpts.dir, str(step)), "state")
    finally:
      ckpts.close()
    self.step, self.meta, self.steps = step, meta, sorted(steps)
    self.config = config_lib.from_dict(meta["config"])
    self.vocab = int(meta["vocab"])
    self.model_cfg = dataclasses.replace(self.config.model, vocab_size=self.vocab)
    self.digests = meta.get("integrity", {}).get("arrays", {})
    self.unverified = []
    self._cache = (None, None, {})
    self._names = self._hf_names()
    with _open(io.join(self.state_dir, "_METADATA")) as f:
      self._format = json.load(f)

  def _hf_names(self):
    """{hf name: (leaf, layer or None)}: where each Llama tensor comes from."""
    names = {}
    for leaf in layout.leaves(self.model_cfg):
      for row, i in enumerate(leaf.layer_ids()) if leaf.per_layer else [(None, None)]:
        for name in leaf.names:
          names[tensor_map.hf_layer_name(i, name) if leaf.per_layer else name] = (leaf, row)
    return names

  def names(self):
    return list(self._names)

  def get(self, name):
    """One Llama tensor (float32, numpy), from the parameter last read if it holds it."""
    leaf, i = self._names[name]
    if self._cache[0] != leaf.path or leaf.path is None:
      self._cache = (leaf.path, self.array(leaf), {})
    path, array, tensors = self._cache
    if i not in tensors:
      tensors.clear()
      tensors[i] = leaf.to_hf(array[i] if leaf.per_layer else array)
    return tensors[i][name.split(".", 3)[3] if leaf.per_layer else name]

  def array(self, leaf):
    """The whole array a Leaf reads (all its layers; None for a constant)."""
    if leaf.path is None:
      return None
    if leaf.collection == "params":
      return self._read(leaf.path)
    return self._read_in(leaf.collection, leaf.path)

  def _read(self, path):
    return self._read_in("params", path)

  def _read_in(self, collection, path):
    key = jax_keystr((collection, *path))
    store = _open_array(self.state_dir, self._format, (collection, *path))
    try:
      array = np.ascontiguousarray(store.read().result())
    except Exception as e:  # noqa: BLE001 (TensorStore: a damaged or missing chunk)
      first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
      raise Damaged(f"checkpoint {self.step} of {self.run_dir}: parameter "
                    f"{'/'.join(path)} is unreadable ({first})") from None
    want = self.digests.get(key)
    if want is None:
      if self.digests:
        self.unverified.append(key)
    elif integrity.array_digests({"x": array})["['x']"] != want:
      raise Damaged(f"checkpoint {self.step} of {self.run_dir} is corrupt: parameter "
                    f"{'/'.join(path)} does not match its checksum")
    return array


class Damaged(MaxlmError):
  """A parameter of the checkpoint is unreadable or fails its checksum."""


def jax_keystr(path):
  return "".join(f"[{k!r}]" for k in path)


def _open(path):
  if io.is_local(path):
    return open(path)
  import io as io_lib
  return io_lib.StringIO(io.read_bytes(path).decode())


def _open_array(state_dir, fmt, keys):
  base = (f"file://{os.path.abspath(state_dir)}/" if io.is_local(state_dir)
          else state_dir.rstrip("/") + "/")
  name = ".".join(keys)
  if fmt.get("use_ocdbt", True):
    kvstore = {"driver": "ocdbt", "base": base, "path": name + "/"}
  else:
    kvstore = base + name + "/"
  driver = "zarr3" if fmt.get("use_zarr3") else "zarr"
  try:
    return ts.open({"driver": driver, "kvstore": kvstore}, open=True, read=True).result()
  except Exception as e:  # noqa: BLE001 (TensorStore's errors: not found, unreadable)
    raise Damaged(f"cannot read parameter {'/'.join(keys[1:])} from {state_dir}: "
                  f"{str(e).splitlines()[0][:200]}") from None

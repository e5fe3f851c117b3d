"""`maxlm export RUN_DIR --out DIR`: a checkpoint as a transformers Llama folder.

The folder holds config.json, generation_config.json, the weights as safetensors and the
tokenizer files, and loads with `AutoModelForCausalLM.from_pretrained(DIR)` and
`AutoTokenizer.from_pretrained(DIR)` without maxlm. It is written into a temporary sibling and
renamed into place once complete, so an interrupted export leaves no half folder at DIR.

Memory: tensors are streamed. `RunCheckpoint` reads one parameter at a time (never the whole
state, whatever mesh or host count wrote it), and a shard holds at most `shard_bytes` of
tensors, which the `safetensors` package serialises when the shard is full (it takes a dict of
arrays per file, so a shard is gathered, never the model). Peak host memory is about twice the
shard size plus the largest parameter (all its layers). Above one shard the files are
model-0000i-of-0000n.safetensors with model.safetensors.index.json, as transformers writes
them.
"""

import json
import os
import shutil
import time

import ml_dtypes  # noqa: F401 (registers bfloat16 with numpy, which safetensors then writes)
import numpy as np
from safetensors.numpy import save_file

from maxlm import MaxlmError, io
from maxlm.data import tokenizer as tok_lib
from maxlm.interop import hf_config, layout, run_reader, tokenizer

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
SHARD_BYTES = 2 * 2**30


def export(run_dir, out, step=None, dtype="float32", shard_bytes=SHARD_BYTES,
           with_tokenizer=True, overwrite=False, log=print):
  """Writes the folder; returns a summary dict (files, tensors, bytes, seconds)."""
  t0 = time.perf_counter()
  if not io.is_local(out):
    raise MaxlmError(f"--out {out}: export writes a local folder (copy it up afterwards)")
  target = os.path.realpath(out)
  if io.is_local(run_dir) and (os.path.realpath(run_dir) + os.sep).startswith(target + os.sep):
    raise MaxlmError(f"--out {out} holds the run dir {run_dir}: export to another folder")
  if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)) and not overwrite:
    raise MaxlmError(f"--out {out} exists and is not empty: choose another folder, or pass "
                     "--overwrite to replace it once the export is complete")
  if dtype not in DTYPES:
    raise MaxlmError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
  source = run_reader.RunCheckpoint(run_dir, step, log=log)
  config, meta = source.config, source.meta
  special, proto = _tokenizer(config, with_tokenizer)
  hf = hf_config.llama_config(config, meta, source.vocab, special, dtype)
  tmp = f"{os.path.abspath(out).rstrip('/')}.tmp-{os.getpid()}"
  _remove_stale(out)
  os.makedirs(tmp)
  try:
    files, total = write_model(tmp, hf, special, source, dtype, shard_bytes)
    if proto is not None:
      tokenizer.write(tmp, proto, special, hf["max_position_embeddings"])
    if os.path.exists(out) and (os.listdir(out) if os.path.isdir(out) else True):
      if not overwrite:
        raise MaxlmError(f"--out {out} appeared while exporting (another export?); this one "
                         "is not written: choose another folder")
      shutil.rmtree(out) if os.path.isdir(out) else os.remove(out)
    elif os.path.isdir(out):
      os.rmdir(out)
    os.rename(tmp, out)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  if source.unverified:
    log(f"note: {len(source.unverified)} parameters have no whole-array checksum (a "
        "multi-process checkpoint) and were exported unverified")
  return {"out": out, "step": source.step, "stage": hf["maxlm"]["stage"], "files": files,
          "tensors": len(source.names()), "bytes": total,
          "seconds": time.perf_counter() - t0}


def _remove_stale(out):
  """Removes the temporary folders of exports to `out` whose process is gone (killed)."""
  parent, name = os.path.split(os.path.abspath(out).rstrip("/"))
  for entry in os.listdir(parent) if os.path.isdir(parent) else ():
    pid = entry[len(name) + len(".tmp-"):]
    if entry.startswith(name + ".tmp-") and pid.isdigit() and not io.process_alive(int(pid)):
      shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def _tokenizer(config, with_tokenizer):
  """(special ids, tokenizer proto or None) from the run's data dir."""
  manifest_path = io.join(config.data.dir, "manifest.json")
  if not io.exists(manifest_path):
    if with_tokenizer:
      raise MaxlmError(f"the run's data dir {config.data.dir} is not found from here (its "
                       "tokenizer and special ids are exported too): run in the folder the run "
                       "was trained from, or pass --no-tokenizer")
    return tok_lib.DEFAULT_SPECIAL, None
  manifest = json.loads(io.read_bytes(manifest_path))
  special = tok_lib.SpecialIds(**manifest["special_ids"])
  if not with_tokenizer:
    return special, None
  if not manifest.get("tokenizer"):
    raise MaxlmError(f"the data dir {config.data.dir} has no tokenizer.model (it was made "
                     "without one): pass --no-tokenizer to export the weights alone")
  return special, io.read_bytes(io.join(config.data.dir, manifest["tokenizer"]))


def write_model(folder, hf, special, source, dtype="float32", shard_bytes=SHARD_BYTES):
  """config.json, generation_config.json and the weights of `source` (`names()`, `get(name)`,
  `model_cfg`) into an existing folder; returns (safetensors file names, bytes)."""
  _dump(os.path.join(folder, "config.json"), hf)
  _dump(os.path.join(folder, "generation_config.json"), hf_config.generation_config(special))
  return _write_weights(folder, source, DTYPES[dtype], shard_bytes)


def _write_weights(folder, source, dtype, shard_bytes):
  """Streams every tensor into shards of at most shard_bytes; returns (file names, bytes)."""
  shapes = layout.hf_shapes(source.model_cfg)
  names = source.names()
  size = {n: int(np.prod(shapes[n])) * np.dtype(dtype).itemsize for n in names}
  shards, current = [], []
  for n in names:  # planned from the shapes first: file names need the shard count
    if current and sum(size[m] for m in current) + size[n] > shard_bytes:
      shards.append(current)
      current = []
    current.append(n)
  shards.append(current)
  files = (["model.safetensors"] if len(shards) == 1 else
           [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
  weight_map = {}
  for file, shard in zip(files, shards):
    tensors = {}
    for n in shard:
      array = source.get(n)
      if array.shape != tuple(shapes[n]):  # a layout bug, never a user's doing
        raise AssertionError(f"{n}: {array.shape} != {shapes[n]}")
      tensors[n] = np.ascontiguousarray(array.astype(dtype, copy=False))
      weight_map[n] = file
    save_file(tensors, os.path.join(folder, file), metadata={"format": "pt"})
    del tensors
  total = sum(size.values())
  if len(files) > 1:
    _dump(os.path.join(folder, "model.safetensors.index.json"),
          {"metadata": {"total_size": total}, "weight_map": weight_map})
  return files, total


def _dump(path, obj):
  with open(path, "w") as f:
    json.dump(obj, f, indent=2)
    f.write("\n")

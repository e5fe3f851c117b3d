"""`maxlm export RUN_DIR --out DIR`: a checkpoint as a transformers folder (families.py picks
the class: Llama, Ministral, Qwen2-MoE or GLM-4-MoE).

The folder holds config.json, generation_config.json, the weights as safetensors and the
tokenizer files, and loads with `AutoModelForCausalLM.from_pretrained(DIR)` and
`AutoTokenizer.from_pretrained(DIR)` without maxlm; `maxlm-export.json` lists every file's
XXH3-128, which `init.from` checks. It is written into a temporary sibling and renamed into
place once complete, so an interrupted export (or a full disk) leaves no half folder at DIR.
DIR is never a run dir, a data dir or inside one, and `--overwrite` replaces only a previous
export (maxlm/outputs.py).

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
import re
import shutil
import time

import ml_dtypes  # noqa: F401 (registers bfloat16 with numpy, which safetensors then writes)
import numpy as np
import xxhash
from safetensors import SafetensorError
from safetensors.numpy import save_file

from maxlm import MaxlmError, io, outputs
from maxlm.data import tokenizer as tok_lib
from maxlm.interop import families, hf_config, layout, run_reader, tensor_map, tokenizer

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
SHARD_BYTES = 2 * 2**30


def export(run_dir, out, step=None, dtype="float32", shard_bytes=SHARD_BYTES,
           with_tokenizer=True, overwrite=False, log=print):
  """Writes the folder; returns a summary dict (files, tensors, bytes, seconds)."""
  t0 = time.perf_counter()
  if not io.is_local(out):
    raise MaxlmError(f"--out {out}: export writes a local folder (copy it up afterwards)")
  if dtype not in DTYPES:
    raise MaxlmError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
  _check_out(out, overwrite, run_dir)  # before any reading, then again with the data dir
  source = run_reader.RunCheckpoint(run_dir, step, log=log)
  config = source.config
  target = _check_out(out, overwrite, run_dir, config.data.dir)
  special, proto = _tokenizer(config, with_tokenizer)
  tmp = f"{target}.tmp-{os.getpid()}"
  _remove_stale(target, log)
  try:
    while True:
      hf = families.config_json(source.config, source.meta, source.vocab, special, dtype)
      try:
        files, total = _write_folder(tmp, hf, special, source, dtype, shard_bytes, proto)
        break
      except run_reader.Damaged as e:  # the default is the newest intact checkpoint
        older = [s for s in source.steps if s < source.step]
        if step is not None or not older:
          raise
        log(f"{e}: exporting checkpoint {older[-1]}, the newest before it")
        source = run_reader.RunCheckpoint(run_dir, older[-1], log=log)
      except (OSError, SafetensorError) as e:
        fix = "free space or choose" if "o space left" in _why(e) else "choose"
        raise MaxlmError(f"--out {out}: cannot write the export ({_why(e)}); nothing was "
                         f"written there: {fix} another folder") from None
    _put_in_place(tmp, target, out, overwrite)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  if source.model_cfg.mtp.depth and not families.writes_mtp(source.model_cfg):
    log(f"note: the MTP block (model.mtp) is not exported: {hf['architectures'][0]} has none")
  if source.unverified:
    log(f"note: {len(source.unverified)} parameters have no whole-array checksum (a "
        "multi-process checkpoint) and were exported unverified")
  return {"out": out, "step": source.step, "stage": hf["maxlm"]["stage"], "files": files,
          "tensors": len(source.names()), "bytes": total,
          "seconds": time.perf_counter() - t0}


def _write_folder(tmp, hf, special, source, dtype, shard_bytes, proto):
  """The whole export into `tmp` (made afresh); returns (safetensors files, bytes)."""
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  files, total = write_model(tmp, hf, special, source, dtype, shard_bytes)
  if proto is not None:
    tokenizer.write(tmp, proto, special, hf["max_position_embeddings"])
  write_digests(tmp, {"run_dir": os.path.abspath(source.run_dir), "step": source.step})
  return files, total


def _check_out(out, overwrite, run_dir, data_dir=None):
  """The resolved --out, once it is known to hold nothing but a previous export (see
  maxlm/outputs.py); the run dir and data dir are never an export's place."""
  inputs = [(name, path) for name, path in (("the run dir", run_dir), ("the data dir", data_dir))
            if path and io.is_local(path)]
  return outputs.check_output("--out", out, outputs.EXPORT, inputs, overwrite)


def _why(e):
  text = getattr(e, "strerror", None) or str(e).splitlines()[0] if str(e) else type(e).__name__
  return f"{text}: {e.filename}" if getattr(e, "filename", None) else text


def _put_in_place(tmp, target, out, overwrite):
  """Renames the complete export to `target`; an old export there is moved aside first and
  deleted after, so a failure at any point leaves one whole folder."""
  if os.path.isdir(target) and os.listdir(target):
    if not overwrite or outputs.kind_of(target) != outputs.EXPORT:  # appeared meanwhile
      raise MaxlmError(f"--out {out} was filled while exporting (another export?); this one "
                       "is not written: choose another folder")
    aside = f"{target}.old-{os.getpid()}"
    os.rename(target, aside)
    try:
      os.rename(tmp, target)
    except OSError:
      os.rename(aside, target)
      raise
    shutil.rmtree(aside, ignore_errors=True)
    return
  if os.path.isdir(target):
    os.rmdir(target)
  os.rename(tmp, target)


def _remove_stale(target, log):
  """Cleans what exports to `target` killed midway left: a temporary folder is removed, an old
  export moved aside is put back if nothing replaced it."""
  parent, name = os.path.split(target)
  for entry in sorted(os.listdir(parent)) if os.path.isdir(parent) else ():
    found = re.fullmatch(re.escape(name) + r"\.(tmp|old)-(\d+)", entry)
    if not found or io.process_alive(int(found[2])):
      continue
    path = os.path.join(parent, entry)
    if found[1] == "old" and not os.path.exists(target):
      os.rename(path, target)
      log(f"restored {target} from {path}, left by an interrupted maxlm export")
    elif found[1] == "tmp" or outputs.kind_of(path) == outputs.EXPORT:
      shutil.rmtree(path, ignore_errors=True)


def write_digests(folder, origin):
  """maxlm-export.json: every file's size and XXH3-128, which `init.from` checks before it
  reads a tensor (written last: a folder without it is not a whole export)."""
  files = {name: {"bytes": os.path.getsize(os.path.join(folder, name)),
                  "xxh3_128": file_digest(os.path.join(folder, name))}
           for name in sorted(os.listdir(folder))}
  _dump(os.path.join(folder, outputs.EXPORT_DIGESTS),
        {"format": 1, "origin": origin, "files": files})


def file_digest(path, chunk=1 << 24):
  digest = xxhash.xxh3_128()
  with open(path, "rb") as f:
    while block := f.read(chunk):
      digest.update(block)
  return digest.hexdigest()


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
  _check_expressible(source)
  names = [n for n in source.names() if families.writes_mtp(source.model_cfg)
           or not n.startswith(tensor_map.MTP_PREFIX)]
  size = {n: int(np.prod(shapes[n])) * np.dtype(_dtype(n, dtype)).itemsize for n in names}
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
      tensors[n] = np.ascontiguousarray(array.astype(_dtype(n, dtype), copy=False))
      weight_map[n] = file
    save_file(tensors, os.path.join(folder, file), metadata={"format": "pt"})
    _readable(os.path.join(folder, file))
    del tensors
  total = sum(size.values())
  if len(files) > 1:
    _dump(os.path.join(folder, "model.safetensors.index.json"),
          {"metadata": {"total_size": total}, "weight_map": weight_map})
  return files, total


def _readable(path):
  """The mode every other exported file has (safetensors writes 0600, through a temp file)."""
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(path, 0o666 & ~umask)


def _dtype(name, dtype):
  """The router of an MoE layer and its bias stay float32 (families.FLOAT32_SUFFIXES)."""
  return np.float32 if name.endswith(families.FLOAT32_SUFFIXES) else dtype


def _check_expressible(source):
  """Arrays no tensor is made of (Qwen2-MoE's absent selection bias) are read once to check
  that leaving them out changes nothing: to_hf refuses them otherwise."""
  for leaf in layout.leaves(source.model_cfg):
    if leaf.path is not None and not leaf.names:
      array = source.array(leaf)
      for row in range(leaf.shape[0]) if leaf.per_layer else [None]:
        leaf.to_hf(array if row is None else array[row])


def _dump(path, obj):
  with open(path, "w") as f:
    json.dump(obj, f, indent=2)
    f.write("\n")

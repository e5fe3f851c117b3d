"""`init.from: PATH`: a new run's parameters from another run or from a Hugging Face folder.

PATH is a maxlm run dir (its newest intact checkpoint), `RUN_DIR@STEP` (that checkpoint), or a
transformers folder (config.json + safetensors, sharded or not) of the class this config's model
exports to (families.py: Llama, or Ministral / Qwen2-MoE / GLM-4-MoE, whose layer plan must be
this config's; GLM-4-MoE's correction bias becomes the train state's balancing bias). Only the parameters are
taken: the optimizer starts fresh, the step counter at 0 and the data at the first batch of the
schedule, which is what fine-tuning (SFT) from a pretrained run and extending a model through
a length schedule want. Both kinds of source are read through the Llama tensor names
(`layout`), so a scanned run can start an unrolled one and an export starts a run bit for bit
where its source stopped.

Checked before anything compiles, each as one line: the path exists and is one of the kinds
above, its shapes and vocabulary are this model's (named by the model key to change), its
tokenizer is this data dir's (where both are known). A folder `maxlm export` wrote is checked
against its maxlm-export.json (every file's XXH3-128) before a tensor is read; any other HF
folder is read with a note; NaN or infinite weights are refused either way. A checkpoint already in run_dir wins over
init.from (that is a resume), and the loop says so. Where the parameters came from is kept in
every checkpoint's metadata (`init_from`) and logged.
"""

import dataclasses
import glob
import hashlib
import json
import os

import jax
import ml_dtypes  # noqa: F401 (lets safetensors' numpy reader return bfloat16 tensors)
import numpy as np
from safetensors import safe_open

from maxlm import MaxlmError, io, outputs
from maxlm.interop import export, families, layout, run_reader, tensor_map
from maxlm.model import moe_state

_MODEL_KEYS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab_size",
               "tied_embeddings", "moe.experts", "moe.top_k", "moe.shared_experts", "moe.d_ff",
               "moe.every", "moe.first_dense", "moe.score", "moe.norm_topk",
               "attention.window", "attention.global_every")


def _get(cfg, dotted):
  for key in dotted.split("."):
    cfg = getattr(cfg, key)
  return cfg


class HfFolder:
  """The tensors of a transformers folder, by name, read one at a time (memory-mapped)."""

  def __init__(self, path):
    self.path = path
    try:
      with open(os.path.join(path, "config.json")) as f:
        self.hf = json.load(f)
    except (OSError, ValueError) as e:
      raise MaxlmError(f"init.from {path}: config.json unreadable ({e})") from None
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
      try:
        with open(index) as f:
          weight_map = json.load(f)["weight_map"]
        self.files = {n: os.path.join(path, os.path.basename(file))
                      for n, file in weight_map.items()}
      except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise MaxlmError(f"init.from {path}: model.safetensors.index.json unreadable "
                         f"({type(e).__name__}: {e})") from None
    else:
      files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
      if not files:
        raise MaxlmError(f"init.from {path}: no *.safetensors files (PyTorch .bin weights are "
                         "not read: save them with safe_serialization=True)")
      self.files = {}
      for file in files:
        self.files.update({n: file for n in self._file(file).keys()})
    self._open = {}

  def _file(self, file):
    try:
      return safe_open(file, framework="np")
    except Exception as e:  # noqa: BLE001 (a missing or damaged file)
      raise MaxlmError(f"init.from {self.path}: cannot read {os.path.basename(file)} "
                       f"({e})") from None

  def get(self, name):
    file = self.files.get(name)
    if file is None:
      raise MaxlmError(f"init.from {self.path}: tensor {name} is missing")
    if file not in self._open:
      self._open = {file: self._file(file)}  # one file open at a time
    try:
      return self._open[file].get_tensor(name).astype(np.float32)
    except Exception as e:  # noqa: BLE001 (a truncated or damaged file)
      raise MaxlmError(f"init.from {self.path}: cannot read {name} from "
                       f"{os.path.basename(file)} ({e})") from None


@dataclasses.dataclass
class Source:
  get: object  # hf tensor name -> float32 array
  names: list
  record: dict  # what went into the checkpoint metadata
  tokenizer: bytes | None


def open_source(config, vocab, data_tokenizer, log=print):
  """The checked source of config.init.from for this model (vocab resolved)."""
  spec = config.init.from_
  cfg = dataclasses.replace(config.model, vocab_size=vocab)
  path, step = run_reader.split_spec(spec)
  where = f"init.from {spec}"
  if io.is_local(path) and not os.path.exists(path):
    raise MaxlmError(f"{where}: no such file or folder")
  if io.exists(io.join(path, "config.yaml")):
    source = _from_run(path, step, cfg, where, log)
  elif step is not None:
    raise MaxlmError(f"{where}: {path} is not a maxlm run dir (no config.yaml), so @{step} "
                     "names no checkpoint")
  elif io.is_local(path) and os.path.exists(os.path.join(path, "config.json")):
    source = _from_hf(path, cfg, where, log)
  else:
    raise MaxlmError(f"{where}: neither a maxlm run dir (config.yaml) nor a Hugging Face "
                     "folder (config.json + safetensors)")
  _check_tokenizer(source.tokenizer, data_tokenizer, where, log)
  return source


def _from_run(path, step, cfg, where, log):
  try:
    run = run_reader.RunCheckpoint(path, step, log=log)
  except MaxlmError as e:
    raise MaxlmError(f"{where}: {e}") from None
  there = run.model_cfg
  diff = [f"model.{k} {_get(there, k)} there, {_get(cfg, k)} here" for k in _MODEL_KEYS
          if _get(there, k) != _get(cfg, k)]
  if diff:
    raise MaxlmError(f"{where} is another model than this config's: {'; '.join(diff)}. Set "
                     "those model keys (model.vocab_size for the vocabulary)")
  tokenizer = None
  manifest = io.join(run.config.data.dir, "manifest.json")
  if io.exists(manifest):
    name = json.loads(io.read_bytes(manifest)).get("tokenizer")
    tokenizer = io.read_bytes(io.join(run.config.data.dir, name)) if name else None
  record = {"from": f"{path}@{run.step}", "kind": "maxlm", "path": _absolute(path),
            "step": run.step, "global_step": int(run.meta.get("global_step", run.step))}
  return Source(run.get, run.names(), record, tokenizer)


def _from_hf(path, cfg, where, log):
  folder = HfFolder(path)
  _check_digests(path, where, log)
  for note in families.check_folder(folder.hf, cfg, where):
    log(f"note: {where}: {note}")
  shapes = layout.hf_shapes(cfg)
  optional = {n for leaf in layout.leaves(cfg) if leaf.optional for n in leaf.names}
  missing = [n for n in shapes if n not in folder.files and n not in optional]
  if optional and not optional & set(folder.files):
    log(f"note: {where} holds no MTP block: model.mtp starts from its initialisation")
  if missing:
    raise MaxlmError(f"{where}: {len(missing)} tensors missing, e.g. {missing[0]}")
  get = _checked(folder.get, shapes, where)
  for leaf in layout.leaves(cfg):
    if leaf.path is None:  # a tensor maxlm has no parameter for must hold its constant
      try:
        leaf.from_hf(get)
      except MaxlmError as e:
        raise MaxlmError(f"{where}: {e}") from None
  tok = os.path.join(path, "tokenizer.model")
  tokenizer = open(tok, "rb").read() if os.path.exists(tok) else None
  with open(os.path.join(path, "config.json"), "rb") as f:
    digest = hashlib.sha256(f.read()).hexdigest()[:16]
  record = {"from": path, "kind": "hf", "path": _absolute(path), "config_sha256": digest}
  return Source(get, [n for n in shapes if n in folder.files], record, tokenizer)


def _check_digests(path, where, log):
  """Every file maxlm-export.json lists has its size and XXH3-128 (a damaged or edited export
  is refused); a folder without it (not made by maxlm export) is read with a note."""
  listing = os.path.join(path, outputs.EXPORT_DIGESTS)
  if not os.path.exists(listing):
    log(f"note: {where}: no {outputs.EXPORT_DIGESTS} (not written by maxlm export), so its "
        "files are not checked against digests; non-finite weights are still refused")
    return
  try:
    with open(listing) as f:
      files = json.load(f)["files"]
    wanted = {str(n): (int(e["bytes"]), str(e["xxh3_128"])) for n, e in files.items()}
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    raise MaxlmError(f"{where}: {outputs.EXPORT_DIGESTS} unreadable ({type(e).__name__}: "
                     f"{e}); export the run again") from None
  for name, (size, digest) in sorted(wanted.items()):
    file = os.path.join(path, os.path.basename(name))
    found = os.path.getsize(file) if os.path.isfile(file) else None
    if found is None or found != size or export.file_digest(file) != digest:
      what = "is missing" if found is None else (
          f"has {found} bytes where {outputs.EXPORT_DIGESTS} lists {size}" if found != size
          else f"does not match its XXH3-128 in {outputs.EXPORT_DIGESTS}")
      raise MaxlmError(f"{where}: {name} {what}: damaged or edited after maxlm export; export "
                       "the run again")


def _checked(get, shapes, where):
  def read(name):
    array = get(name)
    if tuple(array.shape) != tuple(shapes[name]):
      raise MaxlmError(f"{where}: tensor {name} has shape {list(array.shape)}, this model "
                       f"needs {list(shapes[name])}")
    if not np.isfinite(array).all():
      raise MaxlmError(f"{where}: tensor {name} holds {int((~np.isfinite(array)).sum())} NaN "
                       "or infinite values: the weights are damaged")
    return array
  return read


def _check_tokenizer(theirs, ours, where, log):
  if theirs is None or ours is None:
    log(f"note: {where}: tokenizer not compared (no tokenizer.model on one side): make sure "
        "this data dir was prepared with the source's tokenizer")
  elif hashlib.sha256(theirs).digest() != hashlib.sha256(ours).digest():
    raise MaxlmError(f"{where}: its tokenizer differs from this data dir's, so token ids "
                     "would mean other pieces: prepare the data with --tokenizer and the "
                     "source's tokenizer.model")


def _absolute(path):
  return os.path.abspath(path) if io.is_local(path) else path


def params(source, cfg, params_like, put=lambda path, array: array, fresh=None):
  """A tree shaped like `params_like` (the parameters of ModelConfig `cfg`, vocab resolved),
  read from the source one parameter at a time; `put(path, array)` places each as it is read
  (the identity: host arrays). A parameter the source may lack (Leaf.optional: the MTP block)
  and does lack is `fresh(path)`, the run's own initial value."""
  return _collection(source, cfg, params_like, put, "params", fresh)


def moe_bias(source, cfg, bias_like, put=lambda path, array: array):
  """The balancing bias (a tree shaped like the train state's "moe_bias") from the source:
  GLM-4-MoE's e_score_correction_bias, zero where the source has none."""
  return _collection(source, cfg, bias_like, put, "moe_bias")


def _collection(source, cfg, like_tree, put, collection, fresh=None):
  by_path = {leaf.path: leaf for leaf in layout.leaves(cfg, biased=collection == "moe_bias"
                                                       or None)
             if leaf.collection == collection}
  there = set(source.names)

  def one(path, like):
    keys = tuple(getattr(k, "key", k) for k in path)
    leaf = by_path[keys]
    if leaf.optional and not set(leaf.names) <= there:
      if fresh is None:
        raise MaxlmError(f"the source holds no {leaf.names[0]}")
      return fresh(keys)
    if leaf.per_layer:
      array = np.stack([leaf.from_hf(lambda n, i=i: source.get(tensor_map.hf_layer_name(i, n)))
                        for i in leaf.layer_ids()])
    else:
      array = leaf.from_hf(source.get)
    assert array.shape == tuple(like.shape), (leaf.path, array.shape, like.shape)
    return put(keys, array)
  return jax.tree_util.tree_map_with_path(one, like_tree)


def start(config, data, vocab, found, log):
  """(source or None, record or None) for a run about to train: the checked init.from source
  when the run starts fresh; when it resumes (`found`: resume.resume's result), none, and the
  record its checkpoint carries."""
  if found is not None:
    step_no, meta = found[2], found[1]
    if config.init.from_:
      log(f"init.from {config.init.from_} not used: run_dir holds checkpoint {step_no}, "
          "which wins (this is a resume)")
    return None, meta.get("init_from")
  if not config.init.from_:
    return None, None
  name = data.manifest.get("tokenizer")
  ours = io.read_bytes(io.join(config.data.dir, name)) if name else None
  source = open_source(config, vocab, ours, log)
  return source, source.record


def into_state(source, state, model, opt, mesh, shardings, log):
  """The fresh train state with its parameters (and the optimizer state made from them)
  replaced by the source's. Each parameter goes to its sharding as soon as it is read (every
  process reads it and keeps its own shards), so a host holds one parameter at a time."""
  where = {tuple(getattr(k, "key", k) for k in p): s
           for p, s in jax.tree_util.tree_leaves_with_path(shardings["params"])}

  def put(keys, array):
    return jax.make_array_from_callback(array.shape, where[keys], lambda index: array[index])
  fresh = {tuple(getattr(k, "key", k) for k in p): x
           for p, x in jax.tree_util.tree_leaves_with_path(state["params"])}
  placed = params(source, model.cfg, jax.eval_shape(lambda: state["params"]), put,
                  fresh.__getitem__)
  with mesh:
    opt_state = jax.jit(opt.init)(placed)
  log(f"parameters from init.from {source.record['from']} ({source.record['kind']})")
  out = {**state, "params": placed, "opt_state": opt_state}
  if moe_state.BIAS in state:  # the source's balancing bias, placed where the fresh one was
    sharding = {tuple(getattr(k, "key", k) for k in p): x.sharding for p, x in
                jax.tree_util.tree_leaves_with_path(state[moe_state.BIAS])}
    out[moe_state.BIAS] = moe_bias(source, model.cfg, state[moe_state.BIAS], lambda keys, a:
                                   jax.make_array_from_callback(a.shape, sharding[keys],
                                                                lambda index: a[index]))
  return out

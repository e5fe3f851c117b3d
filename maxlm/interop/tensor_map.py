"""One maxlm parameter and its transformers tensors: the `Leaf` record that layout.py lists for a
Llama and planned.py for a model whose layers differ, the HF name of a layer's tensor, and the
leaves every family ends with (the final norm and the untied head)."""

import dataclasses
from typing import Callable

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Leaf:
  """One maxlm parameter: its path in the params tree, whether it is stacked over layers, and
  how one layer's (or the whole) array maps to Llama tensors (name suffixes) and back."""
  path: tuple
  shape: tuple  # the whole parameter's (layers first when stacked)
  per_layer: bool
  names: tuple  # the Llama tensors it makes (suffixes after model.layers.N. when per_layer)
  to_hf: Callable  # maxlm array -> {hf name (a suffix for per-layer leaves): array}
  from_hf: Callable  # get(hf name) -> maxlm array
  layers: tuple = None  # the model layer of each row of a stacked leaf (None: row i, layer i)
  collection: str = "params"  # its variable collection ("moe_bias": the balancing bias)
  hf: dict = None  # {hf name (suffix when per_layer): shape} (None: a Llama leaf, hf_shapes)
  optional: bool = False  # a source may lack it (the MTP block): the run keeps its own init

  def layer_ids(self):
    return tuple(range(self.shape[0])) if self.layers is None else self.layers


def hf_layer_name(i, suffix):
  return f"model.layers.{i}.{suffix}"


def contiguous(x):
  return np.ascontiguousarray(x)  # safetensors writes an array's memory as it lies


def outer_leaves(cfg):
  """The final norm and the head (untied): every family's, after the layers."""
  d, v = cfg.d_model, cfg.vocab_size
  out = [Leaf(("final_norm", "scale"), (d,), False, ("model.norm.weight",),
              lambda a: {"model.norm.weight": contiguous(a)},
              lambda get: contiguous(get("model.norm.weight")))]
  if not cfg.tied_embeddings:
    out.append(Leaf(("head",), (d, v), False, ("lm_head.weight",),
                    lambda a: {"lm_head.weight": contiguous(a.T)},
                    lambda get: contiguous(get("lm_head.weight").T)))
  return out


MTP_PREFIX = "mtp.0."  # DeepSeek's name for the first MTP module; transformers ignores mtp.*


def mtp_leaves(cfg):
  """The MTP block's parameters (model.mtp.depth 1), each one tensor `mtp.0.<its path>` in our
  own layout: no transformers class but DeepSeek-V4's names them, and that one skips them, so
  only maxlm reads them back (init.from)."""
  if not cfg.mtp.depth:
    return []
  from maxlm.config import RopeConfig
  from maxlm.model import transformer
  out = []
  shapes = transformer.mtp_param_shapes(cfg, RopeConfig())
  for path, shape in jax.tree_util.tree_leaves_with_path(shapes):
    keys = tuple(getattr(k, "key", k) for k in path)
    name = MTP_PREFIX + ".".join(keys)
    out.append(Leaf(("mtp", *keys), tuple(shape.shape), False, (name,),
                    lambda a, name=name: {name: contiguous(a)},
                    lambda get, name=name: contiguous(get(name)), hf={name: tuple(shape.shape)},
                    optional=True))
  return out


def named_in_layer(i, to_hf):
  """A layer's to_hf (suffixes) as layer i's: the full HF names."""
  return lambda a: {hf_layer_name(i, k): v for k, v in to_hf(a).items()}


def got_in_layer(i, from_hf):
  """A layer's from_hf (asks for suffixes) as layer i's: asks for the full HF names."""
  return lambda get: from_hf(lambda name: get(hf_layer_name(i, name)))

"""The Leaf list (tensor_map.py; layout.py lists a Llama's) of a model whose layers differ: MoE and
dense layers, local and global attention, stored as maxlm/model/layers.py plans them (scanned
groups of blocks, one stack, or unrolled layers).

Where each layer lives is asked of `layers.per_layer` itself (on a stand-in tree that records
the keys and indices it is asked for), so this module follows the layer plan without a copy of
its rules. Each stored array becomes one Leaf whose rows are the model layers `layers` names,
and each layer's tensors carry the HF names of its layer index, whatever group holds it.
A Leaf with path None is a constant: an HF tensor maxlm holds no parameter for (families.py),
written as its value and, on import, checked to be it.

Tested through layout.py, for every family and plan (scanned, stacked, unrolled):
tests/test_interop_moe.py test_layout_makes_every_hf_tensor_once_and_inverts (each HF tensor made
once, import inverting export) and test_export_then_import_is_bitwise; those are the properties a
direct test of `locations` would check.
"""

import numpy as np

from maxlm.interop import deepseek_v4, families
from maxlm.interop.tensor_map import (Leaf, contiguous, got_in_layer, hf_layer_name,
                                      named_in_layer, outer_leaves)
from maxlm.model import layers as layers_lib


class _Where:
  """Stands in for a params tree: indexing it records the keys (names) and rows (ints)."""

  def __init__(self, *keys):
    self.keys = keys

  def __getitem__(self, key):
    return _Where(*self.keys, key)


def locations(cfg):
  """[(storage prefix (names), row or None)] per layer: where layers.per_layer finds it."""
  out = []
  for where in layers_lib.per_layer(_Where(), cfg):
    names = tuple(k for k in where.keys if isinstance(k, str))
    rows = [k for k in where.keys if not isinstance(k, str)]
    out.append((names, rows[0] if rows else None))
  return out


def layer_parts(cfg, spec, llama_layer, llama_names, biased):
  """{local path: (collection, shape, {hf suffix: shape}, to_hf, from_hf)} of one layer."""
  if families.family(cfg) == families.DEEPSEEK_V4:
    return deepseek_v4.layer_parts(cfg, spec, biased)
  parts = {}
  for local, (shape, to_hf, from_hf) in llama_layer.items():
    if spec.moe and local[0] == "mlp":
      continue
    parts[local] = ("params", shape, dict(zip(llama_names[local], _llama_hf_shapes(cfg, local))),
                    to_hf, from_hf)
  if spec.moe:
    parts.update(families.moe_parts(cfg, biased))
  return parts


def _llama_hf_shapes(cfg, local):
  d, h, k, hd, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
  return {("attention", "query", "kernel"): [(h * hd, d)],
          ("attention", "key", "kernel"): [(k * hd, d)],
          ("attention", "value", "kernel"): [(k * hd, d)],
          ("attention", "out", "kernel"): [(d, h * hd)],
          ("attention_norm", "scale"): [(d,)],
          ("mlp", "gate_up", "kernel"): [(f, d), (f, d)],
          ("mlp", "down", "kernel"): [(d, f)],
          ("mlp_norm", "scale"): [(d,)]}[local]


def leaves(cfg, llama_layer, llama_names, biased):
  specs = layers_lib.specs(cfg)
  by_store = {}
  for i, (prefix, row) in enumerate(locations(cfg)):
    by_store.setdefault(prefix, []).append((row, i))
  d, v = cfg.d_model, cfg.vocab_size
  out = [Leaf(("embedding",), (v, d), False, ("model.embed_tokens.weight",),
              lambda a: {"model.embed_tokens.weight": contiguous(a)},
              lambda get: contiguous(get("model.embed_tokens.weight")),
              hf={"model.embed_tokens.weight": (v, d)})]
  for prefix, rows in by_store.items():
    rows.sort(key=lambda r: -1 if r[0] is None else r[0])
    parts = layer_parts(cfg, specs[rows[0][1]], llama_layer, llama_names, biased)
    for local, (collection, shape, hf, to_hf, from_hf) in parts.items():
      if rows[0][0] is None:  # unrolled: one layer, full names
        i = rows[0][1]
        out.append(Leaf((*prefix, *local), shape, False,
                        tuple(hf_layer_name(i, x) for x in hf), named_in_layer(i, to_hf),
                        got_in_layer(i, from_hf), collection=collection,
                        hf={hf_layer_name(i, x): s for x, s in hf.items()}))
      else:
        out.append(Leaf((*prefix, *local), (len(rows), *shape), True, tuple(hf), to_hf,
                        from_hf, layers=tuple(i for _, i in rows), collection=collection,
                        hf=hf))
  out.extend(_constants(cfg, specs, biased))
  if families.family(cfg) == families.DEEPSEEK_V4:
    return out + deepseek_v4.outer_leaves(cfg)
  for leaf in outer_leaves(cfg):
    out.append(Leaf(leaf.path, leaf.shape, False, leaf.names, leaf.to_hf, leaf.from_hf,
                    hf={leaf.names[0]: leaf.shape[::-1] if leaf.path == ("head",)
                        else leaf.shape}))
  return out


def _constants(cfg, specs, biased):
  out = []
  for i, spec in enumerate(specs):
    for suffix, value in _layer_constants(cfg, spec, biased).items():
      name = hf_layer_name(i, suffix)

      def to_hf(_, name=name, value=value):
        return {name: value}

      def from_hf(get, name=name, value=value):
        families.check_constant(name, get(name), value)
      out.append(Leaf(None, value.shape, False, (name,), to_hf, from_hf, collection=None,
                      hf={name: value.shape}))
  return out


def _layer_constants(cfg, spec, biased):
  """{hf suffix: array} of a layer's tensors that hold no maxlm parameter (families.py)."""
  if families.family(cfg) == families.DEEPSEEK_V4:
    return deepseek_v4.constants(cfg, spec, biased)
  return {suffix: np.full(shape, value, np.float32) for suffix, (shape, value)
          in (families.constants(cfg, biased) if spec.moe else {}).items()}


def hf_shapes(cfg, all_leaves, biased):
  """{hf tensor name: shape} from the leaves' own HF shapes."""
  del biased
  shapes = {}
  for leaf in all_leaves:
    for row, i in enumerate(leaf.layer_ids()) if leaf.per_layer else [(None, None)]:
      for name, shape in leaf.hf.items():
        shapes[hf_layer_name(i, name) if row is not None else name] = tuple(shape)
  return shapes

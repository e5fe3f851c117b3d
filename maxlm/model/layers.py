"""The layer plan: which layers are MoE or local, and how the decoder stacks them.

One place decides a layer's kind, for the model, the FLOP count and interop alike:

1. `specs(cfg)` gives each layer a `LayerSpec(moe, window)`. Layer i is MoE iff model.moe has
   experts, i >= first_dense and (i - first_dense + 1) % every == 0 (every=1: all after the
   dense prefix; Qwen-MoE's `decoder_sparse_step` rule when first_dense is 0). With
   model.attention.window W > 0, layer i is global iff global_every > 0 and
   (i + 1) % global_every == 0, else local with window W (Gemma's 5:1 is global_every 6).
2. `groups(cfg)` cuts the specs into scanned groups so compile time stays flat in depth: the
   dense prefix, the hash-routed layers (up to the last of them) and the rest are each the
   shortest repeating unit of specs, scanned `repeats`
   times, plus a tail (the partial unit left over) scanned once. A model whose layers are all
   alike is one group of one block, stored as today: params["layers"], stacked.
3. Parameters then live at params["layers"] (one homogeneous group), params["group_G"]
   ["block_J"] stacked over repeats (several groups or a unit of several blocks), or
   params["layer_I"] (scan_layers false). `per_layer` / `from_per_layer` convert any tree of
   that layout (params, the MoE bias, optimizer moments) to and from one subtree per layer.
"""

import dataclasses

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class LayerSpec:
  moe: bool = False
  window: int = 0  # 0: global attention
  hashed: bool = False  # an MoE layer routing by token id (model.moe.hash_layers)
  compress: int = 0  # V4 attention's compression rate (model.mqa.compress): 0 window only


@dataclasses.dataclass(frozen=True)
class Group:
  first: int  # index of its first layer
  unit: tuple  # LayerSpec per block of the unit
  repeats: int

  def layers(self):
    return range(self.first, self.first + len(self.unit) * self.repeats)


def specs(cfg):
  moe, att = cfg.moe, cfg.attention
  out, moe_seen = [], 0
  for i in range(cfg.n_layers):
    is_moe = moe.experts > 0 and i >= moe.first_dense and (i - moe.first_dense + 1) % moe.every == 0
    is_global = att.window == 0 or att.global_every > 0 and (i + 1) % att.global_every == 0
    hashed = is_moe and moe_seen < moe.hash_layers
    moe_seen += is_moe
    compress = cfg.mqa.rate(i) if cfg.mqa.enabled else 0
    out.append(LayerSpec(moe=is_moe, window=0 if is_global else att.window, hashed=hashed,
                         compress=compress))
  return tuple(out)


def _period(seq):
  return next(p for p in range(1, len(seq) + 1)
              if all(seq[i] == seq[i + p] for i in range(len(seq) - p)))


def groups(cfg):
  all_specs = specs(cfg)
  first = cfg.moe.first_dense if cfg.moe.experts > 0 else 0
  after_hash = max([i + 1 for i, spec in enumerate(all_specs) if spec.hashed], default=first)
  out = []
  for start, seq in ((0, all_specs[:first]), (first, all_specs[first:after_hash]),
                     (after_hash, all_specs[after_hash:])):
    if not seq:
      continue
    p = _period(seq)
    repeats = len(seq) // p
    out.append(Group(start, tuple(seq[:p]), repeats))
    if len(seq) % p:
      out.append(Group(start + repeats * p, tuple(seq[repeats * p:]), 1))
  return tuple(out)


def homogeneous(cfg):
  g = groups(cfg)
  return len(g) == 1 and len(g[0].unit) == 1


def group_name(g):
  return f"group_{g}"


def block_name(j):
  return f"block_{j}"


def locations(cfg):
  """[(top-level name, block name or None, index on the stacked axis or None)] per layer."""
  if not cfg.scan_layers:
    return [(f"layer_{i}", None, None) for i in range(cfg.n_layers)]
  if homogeneous(cfg):
    return [("layers", None, i) for i in range(cfg.n_layers)]
  out = []
  for g, group in enumerate(groups(cfg)):
    for r in range(group.repeats):
      out += [(group_name(g), block_name(j), r) for j in range(len(group.unit))]
  return out


def per_layer(tree, cfg):
  """Each layer's subtree (unstacked) of a params-shaped tree."""
  out = []
  for top, block, index in locations(cfg):
    sub = tree[top] if block is None else tree[top][block]
    out.append(sub if index is None else jax.tree_util.tree_map(lambda x, i=index: x[i], sub))
  return out


def from_per_layer(layer_trees, cfg, stack=np.stack):
  """The layer entries of a params-shaped tree from one subtree per layer (inverse of
  per_layer); `stack` is np.stack or jnp.stack."""
  pieces = {}
  for tree, (top, block, index) in zip(layer_trees, locations(cfg)):
    pieces.setdefault((top, block), []).append((index, tree))
  out = {}
  for (top, block), items in pieces.items():
    if items[0][0] is None:
      value = items[0][1]
    else:
      value = jax.tree_util.tree_map(lambda *xs: stack(xs), *[t for _, t in sorted(
          items, key=lambda it: it[0])])
    if block is None:
      out[top] = value
    else:
      out.setdefault(top, {})[block] = value
  return out


def layer_names(cfg):
  """The top-level param names that hold layers (everything else is embedding/norm/head)."""
  return sorted({top for top, _, _ in locations(cfg)})

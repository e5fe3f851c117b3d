"""Which maxlm parameter is which tensor of transformers' `LlamaForCausalLM`, and the reshapes.

maxlm keeps DenseGeneral kernels as [in..., out...] with heads as their own axes, gate and up
in one [D, 2, F] kernel, and scanned layers stacked on a leading axis; Llama keeps each weight
as a torch Linear [out, in], one tensor per layer. RoPE rotates the same pairs (x_i, x_{i+D/2})
as transformers' `rotate_half`, so q and k need no permutation (tests/test_interop.py proves it
against transformers' logits). Every reshape here is a transpose or a view, so a round trip is
bit for bit.
"""

import numpy as np

from maxlm.interop import families, planned
from maxlm.interop.tensor_map import (Leaf, contiguous, got_in_layer, hf_layer_name,
                                      mtp_leaves, named_in_layer, outer_leaves)
from maxlm.model import moe_state


def leaves(cfg, biased=None):
  """The Leaf of every maxlm parameter, for a ModelConfig with vocab_size resolved (and of
  every layer's balancing bias when `biased`, default: the model trains one)."""
  return _family_leaves(cfg, biased) + mtp_leaves(cfg)


def _family_leaves(cfg, biased):
  if families.family(cfg) != families.LLAMA:
    return planned.leaves(cfg, _llama_layer(cfg), _LAYER_NAMES,
                          moe_state.enabled(cfg) if biased is None else biased)
  d, v, n = cfg.d_model, cfg.vocab_size, cfg.n_layers
  layer = _llama_layer(cfg)
  out = [Leaf(("embedding",), (v, d), False, ("model.embed_tokens.weight",),
              lambda a: {"model.embed_tokens.weight": contiguous(a)},
              lambda get: contiguous(get("model.embed_tokens.weight")))]
  for local, (shape, to_hf, from_hf) in layer.items():
    names = _LAYER_NAMES[local]
    if cfg.scan_layers:
      out.append(Leaf(("layers", *local), (n, *shape), True, names, to_hf, from_hf))
    else:
      for i in range(n):
        out.append(Leaf((f"layer_{i}", *local), shape, False,
                        tuple(hf_layer_name(i, x) for x in names), named_in_layer(i, to_hf),
                        got_in_layer(i, from_hf)))
  out.extend(outer_leaves(cfg))
  return out


def _llama_layer(cfg):
  """{local path in a layer: (one layer's shape, to_hf, from_hf)} of attention, norms and the
  dense MLP (the same tensor names in every family)."""
  d, h, k, hd, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff

  def qkv(name, heads):
    return (lambda a: {name: contiguous(a.reshape(d, heads * hd).T)},
            lambda get: contiguous(get(name).T.reshape(d, heads, hd)))

  return {  # local path: (one layer's shape, to_hf, from_hf)
      ("attention", "query", "kernel"): ((d, h, hd), *qkv("self_attn.q_proj.weight", h)),
      ("attention", "key", "kernel"): ((d, k, hd), *qkv("self_attn.k_proj.weight", k)),
      ("attention", "value", "kernel"): ((d, k, hd), *qkv("self_attn.v_proj.weight", k)),
      ("attention", "out", "kernel"): ((h, hd, d),
          lambda a: {"self_attn.o_proj.weight": contiguous(a.reshape(h * hd, d).T)},
          lambda get: contiguous(get("self_attn.o_proj.weight").T.reshape(h, hd, d))),
      ("attention_norm", "scale"): ((d,),
          lambda a: {"input_layernorm.weight": contiguous(a)},
          lambda get: contiguous(get("input_layernorm.weight"))),
      ("mlp", "gate_up", "kernel"): ((d, 2, f),
          lambda a: {"mlp.gate_proj.weight": contiguous(a[:, 0, :].T),
                     "mlp.up_proj.weight": contiguous(a[:, 1, :].T)},
          lambda get: contiguous(np.stack([get("mlp.gate_proj.weight").T,
                                   get("mlp.up_proj.weight").T], axis=1))),
      ("mlp", "down", "kernel"): ((f, d),
          lambda a: {"mlp.down_proj.weight": contiguous(a.T)},
          lambda get: contiguous(get("mlp.down_proj.weight").T)),
      ("mlp_norm", "scale"): ((d,),
          lambda a: {"post_attention_layernorm.weight": contiguous(a)},
          lambda get: contiguous(get("post_attention_layernorm.weight"))),
  }


_LAYER_NAMES = {
    ("attention", "query", "kernel"): ("self_attn.q_proj.weight",),
    ("attention", "key", "kernel"): ("self_attn.k_proj.weight",),
    ("attention", "value", "kernel"): ("self_attn.v_proj.weight",),
    ("attention", "out", "kernel"): ("self_attn.o_proj.weight",),
    ("attention_norm", "scale"): ("input_layernorm.weight",),
    ("mlp", "gate_up", "kernel"): ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    ("mlp", "down", "kernel"): ("mlp.down_proj.weight",),
    ("mlp_norm", "scale"): ("post_attention_layernorm.weight",),
}


def hf_shapes(cfg, biased=None):
  """{hf tensor name: shape} of the model a ModelConfig exports to."""
  if families.family(cfg) != families.LLAMA:
    return planned.hf_shapes(cfg, leaves(cfg, biased),
                             moe_state.enabled(cfg) if biased is None else biased)
  d, h, k, hd, f, v = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff,
                       cfg.vocab_size)
  shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
  for i in range(cfg.n_layers):
    for name, shape in (("self_attn.q_proj.weight", (h * hd, d)),
                        ("self_attn.k_proj.weight", (k * hd, d)),
                        ("self_attn.v_proj.weight", (k * hd, d)),
                        ("self_attn.o_proj.weight", (d, h * hd)),
                        ("mlp.gate_proj.weight", (f, d)), ("mlp.up_proj.weight", (f, d)),
                        ("mlp.down_proj.weight", (d, f)), ("input_layernorm.weight", (d,)),
                        ("post_attention_layernorm.weight", (d,))):
      shapes[hf_layer_name(i, name)] = shape
  if not cfg.tied_embeddings:
    shapes["lm_head.weight"] = (v, d)
  for leaf in mtp_leaves(cfg):
    shapes.update(leaf.hf)
  return shapes

"""Which transformers class a maxlm model is, its config.json, and its mixture-of-experts tensors.

maxlm's GQA attention is Llama's in every family but V4's (GQA, RoPE by `rotate_half` over the whole head,
no q/k norm, no biases, RMSNorm), so a class qualifies only with exactly that attention. Read in
transformers 5.24 (models/*/modeling_*.py), the classes that qualify and what each can hold:

  llama      LlamaForCausalLM: dense, every layer global (as before, layout.py).
  ministral  MinistralForCausalLM: dense with a per-layer `layer_types` pattern of
             "sliding_attention" / "full_attention"; its sliding mask keeps kv > q - W, i.e.
             i - W < j <= i, model.attention.window's meaning. (MistralForCausalLM has one window
             for all layers and warns on layer_types, so it cannot hold global_every.)
  qwen2_moe  Qwen2MoeForCausalLM: softmax top-k routing with `norm_topk_prob`, `layer_types`
             with sliding windows, and an explicit MoE placement (`mlp_only_layers` with
             decoder_sparse_step 1 lists the dense layers, so any first_dense/every rule is
             exact). Its shared expert is gated, `sigmoid(shared_expert_gate(x)) * shared(x)`:
             written with a zero gate (sigmoid(0) = 0.5 exactly) and the shared down_proj
             doubled, which is maxlm's ungated shared expert bit for bit (scaling by 2 and 0.5 is
             exact in binary floating point); a folder whose gate is not zero is refused. It has
             no selection bias: a model trained with balance=bias exports only if its bias is 0.
  glm4_moe   Glm4MoeForCausalLM: sigmoid scores, DeepSeek-V3's `e_score_correction_bias` used
             for the choice only, ungated shared experts, `first_k_dense_replace`; written with
             use_qk_norm false, partial_rotary_factor 1, one expert group, routed scale 1. It has
             no sliding layers and makes every layer after the dense prefix MoE (every = 1).

A model with DeepSeek-V4's attention (model.mqa) is DeepseekV4ForCausalLM (deepseek_v4.py holds
what that class can hold, its config and tensors).

Not chosen: Qwen3-MoE, dots1, exaone_moe, afmoe, laguna (q/k RMSNorm on every layer);
DeepSeek-V3/V3.2, glm4_moe_lite, AXK (multi-head latent attention); mixtral (no shared
experts, no per-layer pattern); granitemoe_swa, mimo_v2_flash, gpt_oss (attention sinks, extra
multipliers; mimo's sliding layers double the kv heads and it has no shared experts);
ernie4_5_moe (softmax with a correction bias, but interleaved RoPE, its own MoE layer rule and
no sliding layers); llama4 (scores scale the expert's input). So no class has a selection bias
together with sliding layers: softmax + balance=bias, and sigmoid with a window, are refused in
one line naming the key.

Expert tensors are written one per expert (`mlp.experts.E.gate_proj.weight`, ...), the layout
of the published Qwen-MoE and GLM-4.5 checkpoints, which transformers fuses when it loads.
"""

import numpy as np

from maxlm import MaxlmError
from maxlm.interop import deepseek_v4, hf_config
from maxlm.model import layers as layers_lib

LLAMA, MINISTRAL, QWEN2_MOE, GLM4_MOE = "llama", "ministral", "qwen2_moe", "glm4_moe"
DEEPSEEK_V4 = deepseek_v4.MODEL_TYPE
CLASSES = {LLAMA: "LlamaForCausalLM", MINISTRAL: "MinistralForCausalLM",
           QWEN2_MOE: "Qwen2MoeForCausalLM", GLM4_MOE: "Glm4MoeForCausalLM",
           DEEPSEEK_V4: deepseek_v4.CLASS}
BIAS_NAME = "mlp.gate.e_score_correction_bias"
# the router and its bias stay float32 whatever the export dtype: maxlm routes in float32, and
# GLM-4-MoE keeps both in float32 (_keep_in_fp32_modules_strict)
FLOAT32_SUFFIXES = (BIAS_NAME, "mlp.gate.weight")


def family(cfg):
  """The family a ModelConfig exports to; CannotExpress (one line, naming the key) when none
  holds it."""
  moe, window = cfg.moe, cfg.attention.window
  if cfg.mqa.enabled:
    deepseek_v4.check(cfg)
    return DEEPSEEK_V4
  if cfg.mhc.streams:
    raise hf_config.CannotExpress(
        f"model.mhc.streams={cfg.mhc.streams}: hyper-connections exist in transformers only "
        "inside DeepseekV4ForCausalLM, which needs DeepSeek-V4's attention (model.mqa)")
  if not moe.enabled:
    return MINISTRAL if window else LLAMA
  v4 = [key for key, used in (("score", moe.score == "sqrt_softplus"),
                              ("route_scale", moe.route_scale != 1.0),
                              ("swiglu_limit", moe.swiglu_limit != 0.0),
                              ("hash_layers", moe.hash_layers != 0)) if used]
  if v4:
    raise hf_config.CannotExpress(
        f"model.moe.{v4[0]}={getattr(moe, v4[0])}: DeepSeek-V4's routing is not in the MoE "
        "classes we export to (Qwen2-MoE, GLM-4-MoE)")
  if moe.score == "softmax":
    return QWEN2_MOE
  if window:
    raise hf_config.CannotExpress(
        f"model.attention.window={window} with model.moe.score=sigmoid: the sigmoid class "
        "(Glm4MoeForCausalLM) has no sliding layers and Qwen2MoeForCausalLM, which has them, "
        "routes by softmax; no transformers class holds both")
  if moe.every != 1:
    raise hf_config.CannotExpress(
        f"model.moe.every={moe.every} with model.moe.score=sigmoid: Glm4MoeForCausalLM makes "
        "every layer after first_k_dense_replace MoE (every=1); use score softmax "
        "(Qwen2MoeForCausalLM places MoE layers freely) or every=1")
  return GLM4_MOE


def writes_mtp(cfg):
  """Whether an export holds the MTP block's tensors (tensor_map.mtp_leaves): only for
  DeepseekV4ForCausalLM, whose loader skips `mtp.*`; another class would report them as
  unexpected weights, so its folder leaves them out and `init.from` starts that block afresh."""
  return bool(cfg.mtp.depth) and family(cfg) == DEEPSEEK_V4


def layer_types(cfg):
  return ["sliding_attention" if s.window else "full_attention" for s in layers_lib.specs(cfg)]


def moe_layers(cfg):
  return [i for i, s in enumerate(layers_lib.specs(cfg)) if s.moe]


def config_json(config, meta, vocab, special, dtype):
  """config.json of the checkpoint with metadata `meta` of a run with `config`."""
  m = config.model
  fam = family(m)
  if fam == DEEPSEEK_V4:
    return deepseek_v4.config_json(config, meta, vocab, special, dtype)
  out = hf_config.llama_config(config, meta, vocab, special, dtype)
  if fam == LLAMA:
    return out
  for key in ("pretraining_tp", "mlp_bias"):
    del out[key]
  out.update(architectures=[CLASSES[fam]], model_type=fam)
  window = {"sliding_window": m.attention.window or None, "layer_types": layer_types(m)}
  if fam == MINISTRAL:
    return {**out, **window}
  moe = m.moe
  d_ff = moe.d_ff or m.d_ff
  common = {"num_experts_per_tok": moe.top_k, "moe_intermediate_size": d_ff,
            "norm_topk_prob": bool(moe.norm_topk), "output_router_logits": False}
  if fam == QWEN2_MOE:
    dense = [i for i in range(m.n_layers) if i not in moe_layers(m)]
    return {**out, **common, **window, "num_experts": moe.experts,
            "shared_expert_intermediate_size": moe.shared_experts * d_ff,
            "decoder_sparse_step": 1, "mlp_only_layers": dense, "qkv_bias": False,
            "use_sliding_window": bool(m.attention.window), "max_window_layers": m.n_layers,
            "router_aux_loss_coef": float(moe.aux_loss)}
  return {**out, **common, "n_routed_experts": moe.experts,
          "n_shared_experts": moe.shared_experts, "first_k_dense_replace": moe.first_dense,
          "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "use_qk_norm": False,
          "partial_rotary_factor": 1.0, "num_mtp_layers": 0}


def check_folder(hf, cfg, where):
  """Raises a one-line MaxlmError unless the HF config.json dict `hf` is the class this
  ModelConfig (vocab resolved) exports to with exactly its layer pattern; returns notes."""
  fam = family(cfg)
  if fam == LLAMA:
    return hf_config.check_llama(hf, cfg, where)
  if fam == DEEPSEEK_V4:
    return deepseek_v4.check_folder(hf, cfg, where)
  kind = hf.get("model_type")
  if kind != fam:
    raise MaxlmError(f"{where} holds a {kind or 'model of unknown type'} model; this config's "
                     f"model (model.moe / model.attention) reads {CLASSES[fam]} folders")
  notes = hf_config.check_llama({**hf, "model_type": "llama",
                                 "intermediate_size": hf.get("intermediate_size", cfg.d_ff)},
                                cfg, where)
  wrong = [f"{key}={hf.get(key)!r}" for key, ok in _FIXED[fam] if hf.get(key, ok) != ok]
  if fam == GLM4_MOE and float((hf.get("rope_parameters") or {}).get(
      "partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))) != 1.0:
    wrong.append("partial_rotary_factor != 1")
  if wrong:
    raise MaxlmError(f"{where}: {', '.join(wrong)}, which the maxlm decoder does not have")
  diff = [f"{what}: {there} there, {here} here" for what, there, here in _pattern(hf, cfg, fam)
          if there != here]
  if diff:
    raise MaxlmError(f"{where} has another layer plan than this config's: {'; '.join(diff)}")
  return notes


_FIXED = {  # (key, the only value maxlm can read) per family
    MINISTRAL: (("hidden_act", "silu"),),
    QWEN2_MOE: (("hidden_act", "silu"), ("qkv_bias", False)),
    GLM4_MOE: (("hidden_act", "silu"), ("attention_bias", False), ("use_qk_norm", False),
               ("routed_scaling_factor", 1.0), ("n_group", 1), ("topk_group", 1)),
}


def _pattern(hf, cfg, fam):
  """(what, the folder's value, this config's) for everything the layer plan decides."""
  n = cfg.n_layers
  if fam == GLM4_MOE or not hf.get("layer_types") or (
      fam == QWEN2_MOE and not hf.get("use_sliding_window")):
    theirs = ["full_attention"] * n
  else:
    theirs = list(hf["layer_types"])
  window = hf.get("sliding_window") if "sliding_attention" in theirs else None
  out = [("layer_types (model.attention.global_every)", theirs, layer_types(cfg)),
         ("sliding_window (model.attention.window)", window or 0, cfg.attention.window)]
  if fam == MINISTRAL:
    return out
  moe = cfg.moe
  if fam == QWEN2_MOE:
    experts, shared = hf.get("num_experts", 0), hf.get("shared_expert_intermediate_size", 0)
    step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    placed = [i for i in range(n) if experts > 0 and i not in dense and (i + 1) % step == 0]
  else:
    experts = hf.get("n_routed_experts", 0)
    shared = hf.get("n_shared_experts", 0) * hf.get("moe_intermediate_size", 0)
    placed = list(range(hf.get("first_k_dense_replace", 0), n))
  d_ff = moe.d_ff or cfg.d_ff
  return out + [
      ("MoE layers (model.moe.first_dense / every)", placed, moe_layers(cfg)),
      ("experts (model.moe.experts)", experts, moe.experts),
      ("num_experts_per_tok (model.moe.top_k)", hf.get("num_experts_per_tok"), moe.top_k),
      ("moe_intermediate_size (model.moe.d_ff)", hf.get("moe_intermediate_size"), d_ff),
      ("shared expert width (model.moe.shared_experts x d_ff)", shared,
       moe.shared_experts * d_ff),
      ("norm_topk_prob (model.moe.norm_topk)", bool(hf.get("norm_topk_prob", False)),
       bool(moe.norm_topk))]


def _c(x):
  return np.ascontiguousarray(x)


def moe_parts(cfg, biased):
  """{local path in an MoE layer: (collection, one layer's shape, {hf suffix: shape}, to_hf,
  from_hf)}; `biased`: the model holds a balancing bias (train state "moe_bias")."""
  fam = family(cfg)
  m, d = cfg.moe, cfg.d_model
  e, f = m.experts, m.d_ff or cfg.d_ff
  s = m.shared_experts * f
  ex = "mlp.experts"

  def gate_up_to(a):
    out = {}
    for i in range(e):
      out[f"{ex}.{i}.gate_proj.weight"] = _c(a[i, :, 0, :].T)
      out[f"{ex}.{i}.up_proj.weight"] = _c(a[i, :, 1, :].T)
    return out
  parts = {
      ("moe", "router", "kernel"): ("params", (d, e), {"mlp.gate.weight": (e, d)},
                                    lambda a: {"mlp.gate.weight": _c(a.T)},
                                    lambda get: _c(get("mlp.gate.weight").T)),
      ("moe", "experts", "gate_up"): (
          "params", (e, d, 2, f),
          {f"{ex}.{i}.{p}_proj.weight": (f, d) for i in range(e) for p in ("gate", "up")},
          gate_up_to,
          lambda get: _c(np.stack([np.stack([get(f"{ex}.{i}.gate_proj.weight").T,
                                             get(f"{ex}.{i}.up_proj.weight").T], axis=1)
                                   for i in range(e)]))),
      ("moe", "experts", "down"): (
          "params", (e, f, d), {f"{ex}.{i}.down_proj.weight": (d, f) for i in range(e)},
          lambda a: {f"{ex}.{i}.down_proj.weight": _c(a[i].T) for i in range(e)},
          lambda get: _c(np.stack([get(f"{ex}.{i}.down_proj.weight").T for i in range(e)]))),
  }
  shared = "mlp.shared_expert" if fam == QWEN2_MOE else "mlp.shared_experts"
  scale = 2.0 if fam == QWEN2_MOE else 1.0  # the zero gate's sigmoid(0) = 0.5, undone exactly
  if m.shared_experts:
    parts[("moe", "shared", "gate_up", "kernel")] = (
        "params", (d, 2, s), {f"{shared}.gate_proj.weight": (s, d),
                              f"{shared}.up_proj.weight": (s, d)},
        lambda a: {f"{shared}.gate_proj.weight": _c(a[:, 0, :].T),
                   f"{shared}.up_proj.weight": _c(a[:, 1, :].T)},
        lambda get: _c(np.stack([get(f"{shared}.gate_proj.weight").T,
                                 get(f"{shared}.up_proj.weight").T], axis=1)))
    parts[("moe", "shared", "down", "kernel")] = (
        "params", (s, d), {f"{shared}.down_proj.weight": (d, s)},
        lambda a: {f"{shared}.down_proj.weight": _c(a.T * np.asarray(scale, a.dtype))},
        lambda get: _c(get(f"{shared}.down_proj.weight").T / np.float32(scale)))
  if biased:
    names = {BIAS_NAME: (e,)} if fam == GLM4_MOE else {}
    parts[("moe", "bias")] = ("moe_bias", (e,), names, _bias_to(fam),
                              lambda get: _c(get(BIAS_NAME)) if fam == GLM4_MOE
                              else np.zeros(e, np.float32))
  return parts


def _bias_to(fam):
  def to_hf(a):
    if fam == GLM4_MOE:
      return {BIAS_NAME: _c(a.astype(np.float32))}
    if np.any(a != 0):
      raise hf_config.CannotExpress(
          "the checkpoint's balancing bias (model.moe.balance=bias) is not zero, and "
          "Qwen2MoeForCausalLM (the class for model.moe.score=softmax) has no selection bias: "
          "its routing would differ; train with score sigmoid (Glm4MoeForCausalLM) or "
          "balance aux_loss to export")
    return {}
  return to_hf


def constants(cfg, biased):
  """{hf suffix: (shape, value)} of each MoE layer's tensors maxlm holds no parameter for:
  Qwen2-MoE's shared-expert gate (zero), GLM-4's correction bias (zero without a bias), and
  without shared experts, the shared expert both classes build (0 wide)."""
  fam, d = family(cfg), cfg.d_model
  out = {}
  shared = "mlp.shared_expert" if fam == QWEN2_MOE else "mlp.shared_experts"
  if not cfg.moe.shared_experts:  # both classes always build one: written 0 wide
    out = {f"{shared}.gate_proj.weight": ((0, d), 0.0), f"{shared}.up_proj.weight": ((0, d), 0.0),
           f"{shared}.down_proj.weight": ((d, 0), 0.0)}
  if fam == QWEN2_MOE:
    out["mlp.shared_expert_gate.weight"] = ((1, d), 0.0)
  if fam == GLM4_MOE and not biased:
    out[BIAS_NAME] = ((cfg.moe.experts,), 0.0)
  return out


def check_constant(name, array, value):
  """A tensor maxlm holds no parameter for must be the value maxlm's model implies (an
  array of it)."""
  if np.shape(array) == np.shape(value) and not np.any(array != value):
    return
  if name.endswith("tid2eid"):
    raise MaxlmError(f"tensor {name}: that model's hash layer sends tokens to other experts "
                     "than maxlm's fixed table (maxlm/model/moe.py hash_table) would")
  what = "gates its shared expert" if "shared" in name else "has a bias"
  raise MaxlmError(f"tensor {name} is not {np.ravel(value)[0]:g} everywhere: that model "
                   f"{what}, which this config's maxlm model cannot hold")

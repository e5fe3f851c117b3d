"""A maxlm model as a transformers Llama config, and an HF folder's config checked against one.

`llama_config` writes what `LlamaConfig` reads in transformers 4.4x-5.x: sizes, `rms_norm_eps`,
`rope_theta` and `rope_scaling` of the stage the checkpoint trained last, tied or not, the
special ids. For YaRN, transformers before 5 recomputes the factor as max_position_embeddings /
original_max_position_embeddings, so max_position_embeddings is written as exactly
factor x original_length, and a factor that does not make that a whole number is refused
(`CannotExpress`) rather than served with another factor.
"""

import math

from maxlm import MaxlmError


class CannotExpress(MaxlmError):
  """The model has a setting a transformers Llama config cannot hold."""


def trained_stage(meta, n_stages):
  """The index of the stage a checkpoint last trained in (a checkpoint at a stage boundary
  names the next stage, at its step 0)."""
  s = int(meta["stage"])
  return s - 1 if s > 0 and int(meta["stage_step"]) == 0 else min(s, n_stages - 1)


def rope_scaling(rope):
  """(rope_scaling dict or None, max_position_embeddings it implies or None)."""
  if rope.scaling == "none":
    return None, None
  if rope.scaling == "linear":
    return {"rope_type": "linear", "type": "linear", "factor": float(rope.factor)}, None
  length = rope.factor * rope.original_length
  if not float(length).is_integer():
    raise CannotExpress(
        f"rope yarn factor {rope.factor} x original_length {rope.original_length} = {length} "
        "is not a whole number of positions: transformers before 5 derives the factor from "
        "max_position_embeddings / original_max_position_embeddings, so it cannot be written "
        "faithfully; choose a factor that makes it whole")
  out = {"rope_type": "yarn", "type": "yarn", "factor": float(rope.factor),
         "original_max_position_embeddings": int(rope.original_length),
         "beta_fast": float(rope.beta_fast), "beta_slow": float(rope.beta_slow)}
  if rope.attention_factor:
    out["attention_factor"] = float(rope.attention_factor)
  return out, int(length)


def llama_config(config, meta, vocab, special, dtype):
  """config.json for the checkpoint with metadata `meta` of a run with `config`."""
  m = config.model
  s = trained_stage(meta, len(config.stages))
  rope = config.stages[s].rope
  scaling, yarn_length = rope_scaling(rope)
  longest = max(st.seq_len for st in config.stages[:s + 1])
  return {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "vocab_size": int(vocab), "hidden_size": m.d_model, "intermediate_size": m.d_ff,
      "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads,
      "num_key_value_heads": m.n_kv_heads, "head_dim": m.head_dim, "hidden_act": "silu",
      "max_position_embeddings": yarn_length or longest, "rms_norm_eps": float(m.norm_eps),
      "rope_theta": float(rope.theta), "rope_scaling": scaling,
      "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
      "pretraining_tp": 1, "tie_word_embeddings": bool(m.tied_embeddings),
      "bos_token_id": special.bos, "eos_token_id": special.eos, "pad_token_id": special.pad,
      "initializer_range": float(m.init_std), "use_cache": True, "torch_dtype": dtype,
      "maxlm": {"stage": s, "seq_len": config.stages[s].seq_len,
                "global_step": int(meta.get("global_step", 0))},
  }


def generation_config(special):
  return {"bos_token_id": special.bos, "eos_token_id": special.eos,
          "pad_token_id": special.pad, "do_sample": False}


_SIZES = (  # (Llama key, maxlm model key)
    ("hidden_size", "d_model"), ("num_hidden_layers", "n_layers"),
    ("num_attention_heads", "n_heads"), ("num_key_value_heads", "n_kv_heads"),
    ("head_dim", "head_dim"), ("intermediate_size", "d_ff"), ("vocab_size", "vocab_size"),
    ("tie_word_embeddings", "tied_embeddings"))


def check_llama(hf, cfg, where):
  """Raises a one-line MaxlmError unless the HF config.json dict `hf` is a Llama of exactly
  the shape of ModelConfig `cfg` (vocab resolved); returns notes on settings that differ but
  do not change the shapes (RoPE, norm epsilon)."""
  kind = hf.get("model_type")
  if kind != "llama" and "LlamaForCausalLM" not in (hf.get("architectures") or []):
    raise MaxlmError(f"{where} holds a {kind or 'model of unknown type'} model "
                     f"({', '.join(hf.get('architectures') or [])}); init.from reads Llama "
                     "(LlamaForCausalLM) folders")
  for key, ok in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
    if hf.get(key, ok) != ok:
      raise MaxlmError(f"{where}: {key}={hf[key]!r}, which the maxlm decoder does not have "
                       f"(it has {key}={ok!r})")
  heads = hf.get("num_attention_heads", 0)
  there = {**hf, "num_key_value_heads": hf.get("num_key_value_heads") or heads,
           "head_dim": hf.get("head_dim") or hf.get("hidden_size", 0) // max(heads, 1),
           "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False))}
  diff = [f"{hf_key} {there.get(hf_key)} there, model.{key}={getattr(cfg, key)} here"
          for hf_key, key in _SIZES if there.get(hf_key) != getattr(cfg, key)]
  if diff:
    raise MaxlmError(f"{where} is another model than this config's: {'; '.join(diff)}. Set "
                     "those model keys (model.vocab_size for the vocabulary)")
  notes = []
  if not math.isclose(float(hf.get("rms_norm_eps", cfg.norm_eps)), cfg.norm_eps):
    notes.append(f"its rms_norm_eps is {hf['rms_norm_eps']}, model.norm_eps here "
                 f"{cfg.norm_eps}")
  return notes

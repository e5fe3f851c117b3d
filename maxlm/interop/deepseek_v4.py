"""A maxlm DeepSeek-V4 model (model.mqa with model.mhc and V4's experts) as transformers'
`DeepseekV4ForCausalLM`: which model qualifies, its config.json, the tensor of every parameter,
and the checks of a folder of that class for `init.from`.

Tensors are written under the names of DeepSeek's own checkpoints (`attn.wq_a`, `ffn.experts.E.w1`,
`hc_attn_fn`, `head.weight`, ...): that is what transformers 5.24 writes from this class and what
its loader renames into the modules (its conversion mapping for deepseek_v4), so a folder we write
is read like a published V4 checkpoint. Routed experts are one tensor per expert (w1 gate, w3 up,
w2 down), which the loader fuses.

What the class cannot hold is refused in one line naming the key (`check`): it has hyper-
connections in every model, every layer's MLP is an MoE with one shared expert of the experts'
width, scores are sqrt-softplus with renormalised top-k, and there is no RoPE scaling on
window-only layers. Multi-token prediction is not in the class (its loader ignores `mtp.*`), so
the MTP module is not exported.
"""

import numpy as np

from maxlm import MaxlmError
from maxlm.interop import hf_config
from maxlm.interop.tensor_map import Leaf, contiguous
from maxlm.model import layers as layers_lib, moe

CLASS, MODEL_TYPE = "DeepseekV4ForCausalLM", "deepseek_v4"
CSA, HCA, WINDOW = ("compressed_sparse_attention", "heavily_compressed_attention",
                    "sliding_attention")
NO_CLAMP = float(np.finfo(np.float32).max)  # swiglu_limit 0 (no clamp) as a clamp that never acts


def check(cfg):
  """Raises hf_config.CannotExpress (one line, naming the key) unless DeepseekV4ForCausalLM holds
  this ModelConfig's model."""
  m = cfg.moe
  wrong = [
      ("mhc.streams", cfg.mhc.streams, "> 0: the class always has hyper-connections",
       cfg.mhc.streams > 0),
      ("moe.experts", m.experts, "> 0: every layer of the class is an MoE", m.enabled),
      ("moe.first_dense", m.first_dense, "0: every layer of the class is an MoE",
       m.first_dense == 0),
      ("moe.every", m.every, "1: every layer of the class is an MoE", m.every == 1),
      ("moe.score", m.score, "sqrt_softplus, the class's only score", m.score == "sqrt_softplus"),
      ("moe.norm_topk", m.norm_topk, "true: the class renormalises the chosen weights",
       m.norm_topk),
      ("moe.shared_experts", m.shared_experts, "1: the class has one shared expert",
       m.shared_experts == 1),
      ("tied_embeddings", cfg.tied_embeddings, "false: the class has its own head",
       not cfg.tied_embeddings)]
  for key, value, need, ok in wrong:
    if not ok:
      raise hf_config.CannotExpress(f"model.{key}={value}: {CLASS} needs {need}")


def layer_type(rate, cfg):
  return WINDOW if not rate else CSA if rate == cfg.mqa.csa_rate else HCA


def config_json(config, meta, vocab, special, dtype):
  """config.json of a checkpoint (metadata `meta`) of a run with `config`."""
  m = config.model
  s = hf_config.trained_stage(meta, len(config.stages))
  rope = config.stages[s].rope
  if rope.scaling != "none":
    raise hf_config.CannotExpress(
        f"stages.{s}.rope.scaling={rope.scaling}: {CLASS} scales no window-only layer's RoPE")
  return {
      "architectures": [CLASS], "model_type": MODEL_TYPE, **model_json(m), "vocab_size": int(vocab),
      "rope_theta": float(rope.theta), "router_aux_loss_coef": float(m.moe.aux_loss),
      "output_router_logits": False, "hidden_act": "silu",
      "max_position_embeddings": max(st.seq_len for st in config.stages[:s + 1]),
      "rms_norm_eps": float(m.norm_eps), "attention_bias": False, "mlp_bias": False,
      "attention_dropout": 0.0, "bos_token_id": special.bos, "eos_token_id": special.eos,
      "pad_token_id": special.pad, "initializer_range": float(m.init_std), "use_cache": True,
      "torch_dtype": dtype, "maxlm": {"stage": s, "seq_len": config.stages[s].seq_len,
                                      "global_step": int(meta.get("global_step", 0))},
  }


def model_json(m):
  """The config.json keys that decide the tensors and what the model computes from them."""
  check(m)
  q, e = m.mqa, m.moe
  specs = layers_lib.specs(m)
  return {
      "vocab_size": m.vocab_size, "hidden_size": m.d_model, "num_hidden_layers": m.n_layers,
      "num_attention_heads": m.n_heads, "num_key_value_heads": 1, "head_dim": m.head_dim,
      "q_lora_rank": q.q_lora, "partial_rotary_factor": q.rope_dim / m.head_dim,
      "o_groups": q.out_groups, "o_lora_rank": q.out_lora, "sliding_window": q.window,
      "layer_types": [layer_type(spec.compress, m) for spec in specs],
      "compress_rates": {CSA: q.csa_rate, HCA: q.hca_rate},
      "compress_rope_theta": float(q.compress_theta), "index_n_heads": q.index_heads,
      "index_head_dim": q.index_dim, "index_topk": q.index_top_k,
      "hc_mult": m.mhc.streams, "hc_sinkhorn_iters": m.mhc.sinkhorn_iters,
      "hc_eps": float(m.mhc.eps), "n_routed_experts": e.experts,
      "num_experts_per_tok": e.top_k, "n_shared_experts": 1,
      "moe_intermediate_size": e.d_ff or m.d_ff, "scoring_func": "sqrtsoftplus",
      "norm_topk_prob": True, "routed_scaling_factor": float(e.route_scale),
      "swiglu_limit": float(e.swiglu_limit) or NO_CLAMP,
      "mlp_layer_types": ["hash_moe" if spec.hashed else "moe" for spec in specs],
      "num_nextn_predict_layers": 0, "tie_word_embeddings": False,
  }


def _t(name, shape_out_in):
  """A kernel [in, out] as a torch Linear weight [out, in] named `name`, and back."""
  return ({name: shape_out_in}, lambda a: {name: contiguous(a.T)},
          lambda get: contiguous(get(name).T))


def _same(name, shape):
  return ({name: shape}, lambda a: {name: contiguous(a)}, lambda get: contiguous(get(name)))


def _heads_in(name, rows, heads, width):
  """A kernel [rows, heads, width] as a weight [heads * width, rows]."""
  return ({name: (heads * width, rows)},
          lambda a: {name: contiguous(a.reshape(rows, heads * width).T)},
          lambda get: contiguous(get(name).T.reshape(rows, heads, width)))


def _attention(cfg, rate):
  """{local path: (shape, {hf suffix: shape}, to_hf, from_hf)} of a layer's V4 attention."""
  d, h, k, q = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.mqa
  g, o = q.out_groups, q.out_lora
  per_group = h * k // g
  at = "attn."
  parts = {
      ("q_a", "kernel"): ((d, q.q_lora), *_t(at + "wq_a.weight", (q.q_lora, d))),
      ("q_a_norm",): ((q.q_lora,), *_same(at + "q_norm.weight", (q.q_lora,))),
      ("q_b", "kernel"): ((q.q_lora, h, k), *_heads_in(at + "wq_b.weight", q.q_lora, h, k)),
      ("kv", "kernel"): ((d, k), *_t(at + "wkv.weight", (k, d))),
      ("kv_norm",): ((k,), *_same(at + "norm.weight", (k,))),
      ("o_a",): ((g, per_group, o), {at + "wo_a.weight": (g * o, per_group)},
                 lambda a: {at + "wo_a.weight": contiguous(a.transpose(0, 2, 1).reshape(
                     g * o, per_group))},
                 lambda get: contiguous(get(at + "wo_a.weight").reshape(g, o, per_group)
                                        .transpose(0, 2, 1))),
      ("o_b", "kernel"): ((g * o, d), *_t(at + "wo_b.weight", (d, g * o))),
      ("sink",): ((h,), *_same(at + "attn_sink", (h,))),
  }
  if rate:
    overlap = rate == q.csa_rate
    parts.update(_compressor("compressor", at + "compressor.", d, k, rate, overlap))
    if overlap:
      j, c = q.index_heads, q.index_dim
      parts.update(_compressor("index_compressor", at + "indexer.compressor.", d, c, rate,
                               overlap))
      parts[("index_q", "kernel")] = ((q.q_lora, j, c),
                                      *_heads_in(at + "indexer.wq_b.weight", q.q_lora, j, c))
      parts[("index_weights", "kernel")] = ((d, j),
                                            *_t(at + "indexer.weights_proj.weight", (j, d)))
  return {("attention", *local): part for local, part in parts.items()}


def _compressor(ours, theirs, d, width, rate, overlap):
  c = width * (2 if overlap else 1)
  return {(ours, "kv", "kernel"): ((d, c), *_t(theirs + "wkv.weight", (c, d))),
          (ours, "gate", "kernel"): ((d, c), *_t(theirs + "wgate.weight", (c, d))),
          (ours, "slot_bias"): ((rate, c), *_same(theirs + "ape", (rate, c))),
          (ours, "norm"): ((width,), *_same(theirs + "norm.weight", (width,)))}


def _block(cfg):
  """{local path: (shape, {hf suffix: shape}, to_hf, from_hf)} of a layer's norms and
  hyper-connections."""
  d, n = cfg.d_model, cfg.mhc.streams
  maps = (2 + n) * n
  parts = {("attention_norm", "scale"): ((d,), *_same("attn_norm.weight", (d,))),
           ("mlp_norm", "scale"): ((d,), *_same("ffn_norm.weight", (d,)))}
  for ours, theirs in (("attention_hc", "hc_attn"), ("mlp_hc", "hc_ffn")):
    parts[(ours, "fn")] = ((maps, n * d), *_same(f"{theirs}_fn", (maps, n * d)))
    parts[(ours, "base")] = ((maps,), *_same(f"{theirs}_base", (maps,)))
    parts[(ours, "scale")] = ((3,), *_same(f"{theirs}_scale", (3,)))
  return parts


def _experts(cfg, spec, biased):
  """{local path: (collection, shape, {hf suffix: shape}, to_hf, from_hf)} of a layer's MoE."""
  m, d = cfg.moe, cfg.d_model
  e, f = m.experts, m.d_ff or cfg.d_ff
  ex = "ffn.experts"

  def gate_up_to(a):
    return {name: contiguous(a[i, :, j, :].T) for i in range(e)
            for j, name in enumerate((f"{ex}.{i}.w1.weight", f"{ex}.{i}.w3.weight"))}

  def gate_up_from(get):
    return contiguous(np.stack([np.stack([get(f"{ex}.{i}.w1.weight").T,
                                          get(f"{ex}.{i}.w3.weight").T], axis=1)
                                for i in range(e)]))
  shared = "ffn.shared_experts."
  parts = {
      ("router", "kernel"): ((d, e), *_t("ffn.gate.weight", (e, d))),
      ("experts", "gate_up"): ((e, d, 2, f), {f"{ex}.{i}.w{w}.weight": (f, d) for i in range(e)
                                              for w in (1, 3)}, gate_up_to, gate_up_from),
      ("experts", "down"): ((e, f, d), {f"{ex}.{i}.w2.weight": (d, f) for i in range(e)},
                            lambda a: {f"{ex}.{i}.w2.weight": contiguous(a[i].T)
                                       for i in range(e)},
                            lambda get: contiguous(np.stack([get(f"{ex}.{i}.w2.weight").T
                                                             for i in range(e)]))),
      ("shared", "gate_up", "kernel"): (
          (d, 2, f), {shared + "w1.weight": (f, d), shared + "w3.weight": (f, d)},
          lambda a: {shared + "w1.weight": contiguous(a[:, 0].T),
                     shared + "w3.weight": contiguous(a[:, 1].T)},
          lambda get: contiguous(np.stack([get(shared + "w1.weight").T,
                                           get(shared + "w3.weight").T], axis=1))),
      ("shared", "down", "kernel"): ((f, d), *_t(shared + "w2.weight", (d, f))),
  }
  out = {("moe", *local): ("params", *part) for local, part in parts.items()}
  if biased:  # a hash layer's bias is never used: it is not written and reads back as 0
    names = {} if spec.hashed else {"ffn.gate.bias": (e,)}
    out[("moe", "bias")] = ("moe_bias", (e,), names,
                            lambda a: {n: contiguous(a.astype(np.float32)) for n in names},
                            lambda get: (np.zeros(e, np.float32) if spec.hashed
                                         else contiguous(get("ffn.gate.bias"))))
  return out


def layer_parts(cfg, spec, biased):
  """{local path in a layer: (collection, one layer's shape, {hf suffix: shape}, to_hf,
  from_hf)}, planned.py's form."""
  parts = {local: ("params", *part) for local, part in {**_attention(cfg, spec.compress),
                                                        **_block(cfg)}.items()}
  parts.update(_experts(cfg, spec, biased))
  return parts


def constants(cfg, spec, biased):
  """{hf suffix: array} of a layer's tensors that maxlm holds no parameter for: a hash layer's
  token-to-expert table (moe.hash_table) and, without a trained bias, a learned layer's zero
  correction bias."""
  m = cfg.moe
  if spec.hashed:
    return {"ffn.gate.tid2eid": moe.hash_table(cfg.vocab_size, m.experts, m.top_k).astype(
        np.int64)}
  return {} if biased else {"ffn.gate.bias": np.zeros(m.experts, np.float32)}


def outer_leaves(cfg):
  """The stream head, the final norm and the head."""
  d, v, n = cfg.d_model, cfg.vocab_size, cfg.mhc.streams
  out = []
  for ours, theirs, shape in (("fn", "hc_fn", (n, n * d)), ("base", "hc_base", (n,)),
                              ("scale", "hc_scale", (1,))):
    name = f"model.hc_head.{theirs}"
    out.append(Leaf(("mhc_head", ours), shape, False, (name,), *_same(name, shape)[1:],
                    hf={name: shape}))
  out.append(Leaf(("final_norm", "scale"), (d,), False, ("model.norm.weight",),
                  *_same("model.norm.weight", (d,))[1:], hf={"model.norm.weight": (d,)}))
  out.append(Leaf(("head",), (d, v), False, ("head.weight",),
                  *_t("head.weight", (v, d))[1:], hf={"head.weight": (v, d)}))
  return out


def check_folder(hf, cfg, where):
  """Raises a one-line MaxlmError unless config.json `hf` is a DeepseekV4ForCausalLM of exactly
  this ModelConfig's shape (vocab resolved); returns notes on what differs without changing a
  tensor (the norm epsilon)."""
  if hf.get("model_type") != MODEL_TYPE:
    raise MaxlmError(f"{where} holds a {hf.get('model_type') or 'model of unknown type'} "
                     f"model; this config's model (model.mqa) reads {CLASS} folders")
  ours = model_json(cfg)
  diff = [f"{key} {hf.get(key)!r} there, {value!r} here ({_OURS[key]})"
          for key, value in ours.items() if key in _OURS and _norm(hf.get(key)) != _norm(value)]
  if diff:
    raise MaxlmError(f"{where} is another model than this config's: {'; '.join(diff)}")
  if float(hf.get("rms_norm_eps", cfg.norm_eps)) != cfg.norm_eps:
    return [f"its rms_norm_eps is {hf['rms_norm_eps']}, model.norm_eps here {cfg.norm_eps}"]
  return []


_OURS = {  # config.json key: the maxlm key that decides it
    "vocab_size": "model.vocab_size", "hidden_size": "model.d_model",
    "num_hidden_layers": "model.n_layers", "num_attention_heads": "model.n_heads",
    "head_dim": "model.head_dim", "q_lora_rank": "model.mqa.q_lora",
    "partial_rotary_factor": "model.mqa.rope_dim", "o_groups": "model.mqa.out_groups",
    "o_lora_rank": "model.mqa.out_lora", "sliding_window": "model.mqa.window",
    "layer_types": "model.mqa.compress", "compress_rates": "model.mqa.csa_rate / hca_rate",
    "compress_rope_theta": "model.mqa.compress_theta", "index_n_heads": "model.mqa.index_heads",
    "index_head_dim": "model.mqa.index_dim", "index_topk": "model.mqa.index_top_k",
    "hc_mult": "model.mhc.streams", "hc_sinkhorn_iters": "model.mhc.sinkhorn_iters",
    "hc_eps": "model.mhc.eps", "n_routed_experts": "model.moe.experts",
    "num_experts_per_tok": "model.moe.top_k", "n_shared_experts": "model.moe.shared_experts",
    "moe_intermediate_size": "model.moe.d_ff", "scoring_func": "model.moe.score",
    "routed_scaling_factor": "model.moe.route_scale", "swiglu_limit": "model.moe.swiglu_limit",
    "mlp_layer_types": "model.moe.hash_layers", "tie_word_embeddings": "model.tied_embeddings",
    "norm_topk_prob": "model.moe.norm_topk"}


def _norm(value):
  return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value

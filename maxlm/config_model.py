"""The model's optional families: mixture-of-experts layers (`model.moe`), local/global
attention (`model.attention`), hyper-connections (`model.mhc`), DeepSeek-V4's attention
(`model.mqa`) and multi-token prediction (`model.mtp`). Split from config.py, which holds the dense model's keys; the
layer pattern both decide is built in one place, maxlm/model/layers.py."""

import dataclasses

from maxlm.config_checks import (MAX_MODEL_DIM, MAX_SEQ_LEN, above, at_least, in_range,
                                 one_of)
from maxlm.typed_yaml import ConfigError

MOE_SCORES = ("softmax", "sigmoid", "sqrt_softplus")
MOE_BALANCE = ("bias", "aux_loss", "none")


@dataclasses.dataclass(frozen=True)
class MoeConfig:
  """Routed experts replacing the dense MLP in some layers (maxlm/model/moe.py, docs/model.md)."""
  experts: int = 0  # in [0, 4096]; routed experts per MoE layer (0: no MoE, a dense model)
  top_k: int = 2  # in [1, experts]; experts each token is routed to
  shared_experts: int = 0  # >= 0; always-on experts (one MLP of width shared_experts * d_ff)
  d_ff: int = 0  # >= 0; width of each expert's MLP (0: model.d_ff)
  every: int = 1  # >= 1; after the first `first_dense` layers, every n-th layer is MoE
  first_dense: int = 0  # >= 0, < model.n_layers; the first k layers keep a dense MLP
  # sigmoid (DeepSeek-V3, with balance bias) | softmax (Qwen-MoE, Mixtral) | sqrt_softplus
  # (DeepSeek-V4: the square root of softplus, with balance bias)
  score: str = "sigmoid"
  norm_topk: bool = True  # the k chosen experts' weights are renormalized to sum to 1
  # bias (DeepSeek-V3's auxiliary-loss-free per-expert bias, updated from each step's load
  # outside the gradient) | aux_loss (only the load-balancing loss below) | none
  balance: str = "bias"
  bias_rate: float = 1e-3  # >= 0; the bias update's step (DeepSeek-V3's gamma)
  aux_loss: float = 0.0  # >= 0; weight of the load-balancing loss (Switch / GShard), any balance
  router_z_loss: float = 0.0  # >= 0; weight of the router's log-partition (z) loss
  capacity_factor: float = 0.0  # >= 0; 0: dropless; > 0: tokens per expert capped, overflow dropped
  route_scale: float = 1.0  # > 0; the chosen experts' weights times this (DeepSeek-V4: 1.5)
  # >= 0, at most the MoE layers; the first k MoE layers choose experts by the token's id, a
  # fixed hash (DeepSeek-V4: 3), and weight them by the router's scores
  hash_layers: int = 0
  # >= 0; the experts' (and shared experts') SwiGLU gate is clamped to at most this and its up
  # projection to [-limit, limit] (DeepSeek-V4: 10); 0: no clamp
  swiglu_limit: float = 0.0

  @property
  def enabled(self):
    return self.experts > 0

  def check(self, key, n_layers):
    in_range(f"{key}.experts", self.experts, 0, 4096)
    at_least(f"{key}.shared_experts", self.shared_experts, 0)
    in_range(f"{key}.d_ff", self.d_ff, 0, MAX_MODEL_DIM)
    at_least(f"{key}.every", self.every, 1)
    at_least(f"{key}.first_dense", self.first_dense, 0)
    one_of(f"{key}.score", self.score, MOE_SCORES)
    one_of(f"{key}.balance", self.balance, MOE_BALANCE)
    for name in ("bias_rate", "aux_loss", "router_z_loss", "capacity_factor", "swiglu_limit",
                 "hash_layers"):
      at_least(f"{key}.{name}", getattr(self, name), 0)
    above(f"{key}.route_scale", self.route_scale, 0)
    if not self.enabled:
      return
    in_range(f"{key}.top_k", self.top_k, 1, self.experts)
    if self.first_dense >= n_layers:
      raise ConfigError(f"{key}.first_dense: {self.first_dense} dense layers leave no MoE layer "
                        f"in model.n_layers={n_layers}; expected < {n_layers}")
    if self.every > n_layers - self.first_dense:
      raise ConfigError(f"{key}.every: {self.every} leaves no MoE layer after first_dense="
                        f"{self.first_dense} in model.n_layers={n_layers}; expected <= "
                        f"{n_layers - self.first_dense}")
    moe_layers = (n_layers - self.first_dense) // self.every
    if self.hash_layers > moe_layers:
      raise ConfigError(f"{key}.hash_layers: {self.hash_layers} is more than the "
                        f"{moe_layers} MoE layers; expected <= {moe_layers}")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Sliding-window (local) layers interleaved with global ones (docs/model.md)."""
  # a local layer's query sees the last `window` positions of its own document, itself included
  window: int = 0  # >= 0; 0: every layer global
  # >= 0, not 1 with a window; with a window, layers n-1, 2n-1, ... are global (6: Gemma's
  # 5 local : 1 global); 0: every layer is local (Mistral)
  global_every: int = 0

  def check(self, key):
    in_range(f"{key}.window", self.window, 0, MAX_SEQ_LEN)
    at_least(f"{key}.global_every", self.global_every, 0)
    if self.window and self.global_every == 1:
      raise ConfigError(f"{key}.global_every: 1 makes every layer global, so {key}.window="
                        f"{self.window} is never used; expected 0 (every layer local) or >= 2, "
                        f"or {key}.window=0 for all-global")


@dataclasses.dataclass(frozen=True)
class MhcConfig:
  """Manifold-constrained hyper-connections: the residual as parallel streams mixed around
  every block (DeepSeek-V4; maxlm/model/mhc.py, docs/model.md)."""
  streams: int = 0  # in [0, 16]; residual streams (DeepSeek-V4: 4); 0: the plain residual
  sinkhorn_iters: int = 20  # in [1, 100]; Sinkhorn steps making the residual map doubly stochastic
  eps: float = 1e-6  # > 0; the floor added to the collapse weights and inside Sinkhorn

  def check(self, key):
    in_range(f"{key}.streams", self.streams, 0, 16)
    in_range(f"{key}.sinkhorn_iters", self.sinkhorn_iters, 1, 100)
    above(f"{key}.eps", self.eps, 0)


@dataclasses.dataclass(frozen=True)
class MtpConfig:
  """Multi-token prediction: one more block predicts the token after next (DeepSeek-V3/V4;
  maxlm/model/mtp.py, docs/model.md)."""
  depth: int = 0  # in [0, 1]; extra tokens predicted (DeepSeek-V4: 1); 0: none
  weight: float = 0.3  # >= 0; the MTP loss's weight beside the main loss (DeepSeek-V3: 0.3)

  def check(self, key):
    in_range(f"{key}.depth", self.depth, 0, 1)
    at_least(f"{key}.weight", self.weight, 0)


@dataclasses.dataclass(frozen=True)
class MqaConfig:
  """DeepSeek-V4's attention in place of GQA (maxlm/model/mqa.py, docs/model.md): one shared
  key-value head of model.head_dim, model.n_heads query heads, a sliding window, compressed
  entries per layer, a sink per head and a grouped output projection."""
  q_lora: int = 0  # >= 0; the queries' low rank (V4-Flash: 1024); 0: GQA attention, not V4's
  rope_dim: int = 64  # >= 2, even, <= model.head_dim; the rotated channels, the last of a head
  out_groups: int = 8  # >= 1, divides model.n_heads; groups of the output projection
  out_lora: int = 1024  # >= 1; each group's projection width
  window: int = 128  # >= 1; the sliding window: the last `window` positions of the document
  # each layer's compression rate: 0 (window only), csa_rate (CSA) or hca_rate (HCA); one value
  # serves every layer, else one per layer
  compress: tuple[int, ...] = (0,)
  csa_rate: int = 4  # >= 2; CSA's m: entries from overlapping windows, chosen by the indexer
  hca_rate: int = 128  # >= 2; HCA's m': entries from windows of this many tokens, all attended
  index_heads: int = 64  # >= 1; the lightning indexer's query heads (CSA)
  index_dim: int = 128  # >= rope_dim; the indexer's head width
  # >= 1; entries each query keeps in a CSA layer in a sparse stage (stages.N.sparse.mode;
  # dense and indexer_warmup stages attend every entry)
  index_top_k: int = 512
  compress_theta: float = 160000.0  # > 0; RoPE base of layers with entries (window-only: rope)

  @property
  def enabled(self):
    return self.q_lora > 0

  def rate(self, layer):
    return self.compress[0] if len(self.compress) == 1 else self.compress[layer]

  def check(self, key, n_layers, n_heads, head_dim):
    at_least(f"{key}.q_lora", self.q_lora, 0)
    if not self.enabled:
      return
    for name in ("out_groups", "out_lora", "window", "index_heads", "index_top_k"):
      at_least(f"{key}.{name}", getattr(self, name), 1)
    for name in ("csa_rate", "hca_rate"):
      at_least(f"{key}.{name}", getattr(self, name), 2)
    in_range(f"{key}.rope_dim", self.rope_dim, 2, min(head_dim, self.index_dim))
    above(f"{key}.compress_theta", self.compress_theta, 0)
    if self.rope_dim % 2:
      raise ConfigError(f"{key}.rope_dim: must be even, got {self.rope_dim}")
    if n_heads % self.out_groups:
      raise ConfigError(f"{key}.out_groups: must divide model.n_heads={n_heads}, got "
                        f"{self.out_groups}")
    if len(self.compress) not in (1, n_layers):
      raise ConfigError(f"{key}.compress: expected one rate or one per layer "
                        f"({n_layers}), got {len(self.compress)}")
    bad = [r for r in self.compress if r not in (0, self.csa_rate, self.hca_rate)]
    if bad:
      raise ConfigError(f"{key}.compress: {bad[0]} is none of 0, csa_rate={self.csa_rate}, "
                        f"hca_rate={self.hca_rate}")

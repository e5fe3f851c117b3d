"""Typed run configuration: YAML file + dotted `key=value` overrides, validated before any work.

The schema is the dataclasses below; `load(path, overrides)` returns a `Config` or raises
`ConfigError` naming the key and what is allowed. Parsing (`typed_yaml`) is generic over the
dataclass fields, so adding a field is one line here and nowhere else. The comment on a numeric
field's line states its range (every float must also be finite); `check` enforces it.
"""

import dataclasses
import difflib
import warnings

from maxlm.config_checks import MAX_BATCH, MAX_MODEL_DIM, MAX_SEQ_LEN
from maxlm.config_checks import above as _above, at_least as _at_least, in_range as _in_range
from maxlm import config_rules
from maxlm.config_grpo import GrpoConfig
from maxlm.config_model import AttentionConfig, MhcConfig, MoeConfig, MqaConfig, MtpConfig
from maxlm.config_sparse import SparseConfig
from maxlm.typed_yaml import ConfigError, apply_override, build, read_yaml, resolve_path

__all__ = ["ConfigError", "Config", "load", "from_dict", "to_dict", "resolve_path"]


@dataclasses.dataclass(frozen=True)
class FimConfig:
  rate: float = 0.0  # in [0, 1]; fraction of eligible pieces turned into fill-in-the-middle
  spm: float = 0.5  # in [0, 1]; of those, the fraction in SPM order (the rest PSM)
  sources: tuple[str, ...] = ()  # sources eligible for FIM; empty means every non-chat source

  def check(self, key):
    _in_range(f"{key}.rate", self.rate, 0, 1)
    _in_range(f"{key}.spm", self.spm, 0, 1)


@dataclasses.dataclass(frozen=True)
class DataConfig:
  dir: str = "runs/demo/data"  # the folder `maxlm prepare` wrote
  mix: dict[str, float] = dataclasses.field(default_factory=dict)  # > 0; token quota per source
  overlap: int = 32  # >= 0; tokens of a cut document carried into the next piece as context
  min_cut: float = 0.5  # in [0, 1]; a section/paragraph cut keeps at least this share of the room
  lookahead: int = 64  # >= 1; pieces per source the packer may choose from (best fit)
  shuffle_rows: int = 256  # >= 1; rows are shuffled within windows of this many rows
  block_rows: int = 4096  # >= 1, a multiple of shuffle_rows; the planner's (and snapshots') unit
  fim: FimConfig = FimConfig()
  workers: int = 0  # >= 0; Grain worker processes; batches do not depend on it
  prefetch: int = 2  # >= 1; batches each worker prepares ahead
  allow_changed: bool = False  # resume on other data than the checkpoint's (logged)
  strict: bool = False  # a source of the data dir that no stage's mix names is an error
  # [[a, b], ...], 0 <= a < b, not overlapping: global steps a..b-1 train on the batches after
  # them instead (after a loss spike; maxlm/data/skip.py, docs/troubleshooting.md)
  skip_steps: tuple[tuple[int, ...], ...] = ()
  # false: a training row's documents see each other (one segment, positions 0..L-1 across the
  # row), an ablation of the sample-level mask (docs/schedule.md); evaluation keeps the mask
  document_mask: bool = True

  def check(self, key):
    _check_mix(f"{key}.mix", self.mix)
    _at_least(f"{key}.overlap", self.overlap, 0)
    _in_range(f"{key}.min_cut", self.min_cut, 0, 1)
    _at_least(f"{key}.lookahead", self.lookahead, 1)
    _at_least(f"{key}.shuffle_rows", self.shuffle_rows, 1)
    _at_least(f"{key}.block_rows", self.block_rows, 1)
    _at_least(f"{key}.workers", self.workers, 0)
    _at_least(f"{key}.prefetch", self.prefetch, 1)
    if self.block_rows % self.shuffle_rows:
      raise ConfigError(f"{key}.block_rows: must be a multiple of {key}.shuffle_rows "
                        f"({self.shuffle_rows}), got {self.block_rows}")
    self.fim.check(f"{key}.fim")
    config_rules.check_skip_steps(f"{key}.skip_steps", self.skip_steps)


MODEL_SIZES = {  # named sizes; explicit model.* keys override them
    "tiny": dict(d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=384),
    # the CPU demo's: d_model 256 is the narrowest width at which a 2-core CPU's f32 GEMMs
    # run near their peak (34-48% MFU here against 26-35% for tiny; tools/bench_train.py)
    "demo": dict(d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=768),
    "150m": dict(d_model=768, n_layers=12, n_heads=12, n_kv_heads=4, head_dim=64, d_ff=2048),
    "1b": dict(d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64, d_ff=8192),
    "8b": dict(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, d_ff=14336),
}
# every name maxlm/model/impl.py chooses among (splash_causal, gpu_mha: kernels for benches)
ATTENTION_IMPLS = ("auto", "reference", "blockwise", "splash", "gpu", "splash_causal", "gpu_mha")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
RETRIEVAL_TASKS = ("passkey", "multikey", "vartrack")  # maxlm/eval/retrieval.py's TASKS


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  size: str = "tiny"  # a named size (table below) filling in the model keys not set
  vocab_size: int = 0  # >= 0; 0: the data dir's tokenizer decides
  d_model: int = 128  # >= 1
  n_layers: int = 2  # >= 1
  n_heads: int = 4  # >= 1
  n_kv_heads: int = 2  # >= 1, divides n_heads
  head_dim: int = 32  # >= 1, even (RoPE)
  d_ff: int = 384  # >= 1
  tied_embeddings: bool = False  # the output head reuses the embedding table
  norm_eps: float = 1e-5  # > 0; RMSNorm epsilon
  init_std: float = 0.02  # > 0; standard deviation of the initial weights
  dtype: str = "bfloat16"  # compute dtype; parameters stay float32
  remat: str = "full"  # none | full | dots | dots_no_batch: what the backward pass recomputes
  scan_layers: bool = True  # one compiled layer scanned n_layers times (faster compiles)
  loss_chunk: int = 1024  # >= 1; positions per chunk of the vocabulary projection in the loss
  z_loss: float = 0.0  # >= 0; weight of the log-partition (z) loss
  max_logit: bool = True  # report the largest attention logit (exact; an extra pass on splash only)
  moe: MoeConfig = MoeConfig()
  attention: AttentionConfig = AttentionConfig()
  mhc: MhcConfig = MhcConfig()
  mqa: MqaConfig = MqaConfig()
  mtp: MtpConfig = MtpConfig()

  def check(self, key):
    if self.size not in MODEL_SIZES:
      raise ConfigError(f"{key}.size: expected one of {', '.join(MODEL_SIZES)}, got {self.size!r}")
    for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
                 "loss_chunk"):
      _in_range(f"{key}.{name}", getattr(self, name), 1, MAX_MODEL_DIM)
    _in_range(f"{key}.vocab_size", self.vocab_size, 0, MAX_MODEL_DIM)
    _above(f"{key}.norm_eps", self.norm_eps, 0)
    _above(f"{key}.init_std", self.init_std, 0)
    _at_least(f"{key}.z_loss", self.z_loss, 0)
    if self.n_heads % self.n_kv_heads:
      raise ConfigError(f"{key}.n_kv_heads: must divide n_heads={self.n_heads}, "
                        f"got {self.n_kv_heads}")
    if self.head_dim % 2:
      raise ConfigError(f"{key}.head_dim: must be even for RoPE, got {self.head_dim}")
    if self.dtype not in ("bfloat16", "float32"):
      raise ConfigError(f"{key}.dtype: expected bfloat16 or float32, got {self.dtype!r}")
    if self.remat not in REMAT_POLICIES:
      raise ConfigError(f"{key}.remat: expected one of {', '.join(REMAT_POLICIES)}, "
                        f"got {self.remat!r}")
    self.moe.check(f"{key}.moe", self.n_layers)
    self.attention.check(f"{key}.attention")
    self.mhc.check(f"{key}.mhc")
    self.mqa.check(f"{key}.mqa", self.n_layers, self.n_heads, self.head_dim)
    self.mtp.check(f"{key}.mtp")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
  theta: float = 10_000.0  # > 0; RoPE base
  scaling: str = "none"  # none | linear | yarn
  factor: float = 1.0  # >= 1; context extension factor for linear/yarn
  original_length: int = 4096  # >= 1; the length trained at before scaling (yarn)
  beta_fast: float = 32.0  # > 0, > beta_slow; yarn: more turns in original_length: kept
  beta_slow: float = 1.0  # > 0; yarn: fewer turns in original_length: divided by factor
  attention_factor: float = 0.0  # >= 0; yarn: scale of cos/sin; 0: 0.1 ln(factor) + 1

  def check(self, key):
    if self.scaling not in ("none", "linear", "yarn"):
      raise ConfigError(f"{key}.scaling: expected none, linear or yarn, got {self.scaling!r}")
    _above(f"{key}.theta", self.theta, 0)
    _at_least(f"{key}.factor", self.factor, 1)
    _at_least(f"{key}.original_length", self.original_length, 1)
    _above(f"{key}.beta_slow", self.beta_slow, 0)
    _above(f"{key}.beta_fast", self.beta_fast, self.beta_slow)
    _at_least(f"{key}.attention_factor", self.attention_factor, 0)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  data: int = -1  # >= 1 or -1 (the devices left over; one axis at most)
  fsdp: int = 1  # >= 1 or -1
  tensor: int = 1  # >= 1 or -1
  context: int = 1  # >= 1 or -1
  expert: int = 1  # >= 1 or -1; splits the routed experts (and the batch) over its devices

  def check(self, key):
    sizes = dataclasses.asdict(self)
    for name, n in sizes.items():
      if n == 0 or n < -1:
        raise ConfigError(f"{key}.{name}: expected a positive size or -1, got {n}")
    if list(sizes.values()).count(-1) > 1:
      raise ConfigError(f"{key}: at most one axis may be -1")


@dataclasses.dataclass(frozen=True)
class DpoConfig:
  beta: float = 0.1  # > 0; DPO's inverse temperature on the log-prob ratios (maxlm/train/dpo.py)
  label_smoothing: float = 0.0  # in [0, 0.5); the assumed share of flipped preference labels

  def check(self, key):
    _above(f"{key}.beta", self.beta, 0)
    _in_range(f"{key}.label_smoothing", self.label_smoothing, 0, 0.5, high_open=True)


@dataclasses.dataclass(frozen=True)
class PasskeyEvalConfig:
  """The passkey grid at each evaluation (maxlm/eval/passkey.py; `maxlm eval --passkey`)."""
  samples: int = 0  # >= 0; prompts per (length, depth) cell (0: no grid)
  lengths: tuple[int, ...] = ()  # each >= 128; those up to the stage's L (empty: powers of 2)
  seed: int = 0  # >= 0; chooses the keys and haystacks
  tasks: tuple[str, ...] = ("passkey",)  # of passkey, multikey, vartrack (maxlm/eval/retrieval.py)
  extrapolate: bool = False  # also score prompts of twice the stage's L, in rows of 2L

  def check(self, key):
    _at_least(f"{key}.samples", self.samples, 0)
    _at_least(f"{key}.seed", self.seed, 0)
    for i, n in enumerate(self.lengths):
      _at_least(f"{key}.lengths.{i}", n, 128)
    for i, task in enumerate(self.tasks):
      if task not in RETRIEVAL_TASKS:
        raise ConfigError(f"{key}.tasks.{i}: expected one of {', '.join(RETRIEVAL_TASKS)}, "
                          f"got {task!r}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  lr: float = 3e-3  # > 0; peak learning rate
  min_lr_ratio: float = 0.1  # in [0, 1]; the schedule ends at lr * min_lr_ratio
  warmup_steps: int = 20  # >= 0
  schedule: str = "cosine"  # cosine | wsd (warmup-stable-decay)
  # wsd: the share of all steps, warmup included, spent decaying (the last
  # round(steps * decay_fraction), at least 1 and none before warmup ends, falling linearly to
  # lr * min_lr_ratio at the last step):
  decay_fraction: float = 0.2  # in [0, 1]
  b1: float = 0.9  # in [0, 1); Adam (1 divides by zero in the bias correction)
  b2: float = 0.95  # in [0, 1)
  eps: float = 1e-8  # > 0
  weight_decay: float = 0.1  # >= 0; never on norm scales
  decay_embeddings: bool = False  # whether the embedding table (and head) decay too
  clip: float = 1.0  # > 0; global gradient-norm clipping
  # adamw | muon (Muon on the layers' matrices, AdamW on embeddings, head, norms and the rest:
  # DeepSeek-V4's split, maxlm/train/muon.py)
  optimizer: str = "adamw"
  muon_momentum: float = 0.95  # in [0, 1); Muon's (Nesterov) momentum
  grad_accum: int = 1  # >= 1, divides each stage's batch; micro-batches per step
  checkpoint_every: int = 50  # >= 1 steps; stage boundaries are always saved
  keep: int = 3  # >= 1; checkpoints kept
  eval_every: int = 50  # >= 0; steps between held-out evaluations (0: none; see maxlm eval)
  eval_tokens: int = 32768  # >= 1; held-out tokens per source, the same text at every evaluation
  eval_passkey: PasskeyEvalConfig = PasskeyEvalConfig()  # logged as passkey/LENGTH/DEPTH
  async_checkpoints: bool = True  # write checkpoints in the background while training goes on
  spike_window: int = 32  # >= 0; trailing steps whose loss statistics flag a spike (0: off)
  spike_sigmas: float = 6.0  # > 0; a spike: loss > mean + spike_sigmas * std of that window
  # lm | dpo | grpo; dpo trains on preference pairs against the frozen init.from weights
  # (docs/pairs.md), grpo on sampled completions of prompts scored by a verifier (docs/rl.md)
  objective: str = "lm"
  dpo: DpoConfig = DpoConfig()
  grpo: GrpoConfig = GrpoConfig()

  def check(self, key):
    _above(f"{key}.lr", self.lr, 0)
    if self.objective not in ("lm", "dpo", "grpo"):
      raise ConfigError(f"{key}.objective: expected lm, dpo or grpo, got {self.objective!r}")
    self.dpo.check(f"{key}.dpo")
    self.grpo.check(f"{key}.grpo")
    self.eval_passkey.check(f"{key}.eval_passkey")
    _in_range(f"{key}.min_lr_ratio", self.min_lr_ratio, 0, 1)
    _in_range(f"{key}.decay_fraction", self.decay_fraction, 0, 1)
    _in_range(f"{key}.b1", self.b1, 0, 1, high_open=True)
    _in_range(f"{key}.b2", self.b2, 0, 1, high_open=True)
    _above(f"{key}.eps", self.eps, 0)
    _at_least(f"{key}.weight_decay", self.weight_decay, 0)
    _above(f"{key}.clip", self.clip, 0)
    if self.optimizer not in ("adamw", "muon"):
      raise ConfigError(f"{key}.optimizer: expected adamw or muon, got {self.optimizer!r}")
    _in_range(f"{key}.muon_momentum", self.muon_momentum, 0, 1, high_open=True)
    if self.schedule not in ("cosine", "wsd"):
      raise ConfigError(f"{key}.schedule: expected cosine or wsd, got {self.schedule!r}")
    _above(f"{key}.spike_sigmas", self.spike_sigmas, 0)
    for name in ("warmup_steps", "eval_every", "spike_window"):
      _at_least(f"{key}.{name}", getattr(self, name), 0)
    for name in ("grad_accum", "checkpoint_every", "keep", "eval_tokens"):
      _at_least(f"{key}.{name}", getattr(self, name), 1)


@dataclasses.dataclass(frozen=True)
class InitConfig:
  # a maxlm run dir (its latest checkpoint, or RUN_DIR@STEP) or a Hugging Face Llama folder
  # (safetensors); its weights start this run: parameters only, not the optimizer or the data
  # position, and a checkpoint already in run_dir wins (docs/interop.md). Empty: random;
  from_: str = ""  # YAML key `from` (a Python keyword: hence the `_` here)

  def check(self, key):
    path, at, step = self.from_.rpartition("@") if "@" in self.from_ else (self.from_, "", "")
    if at and not (path and step.isdigit()):
      raise ConfigError(f"{key}.from: expected PATH or RUN_DIR@STEP with STEP a checkpoint's "
                        f"step number, got {self.from_!r}")


YAML_NAMES = {"from_": "from"}  # fields whose YAML key is a Python keyword


def yaml_name(field_name):
  return YAML_NAMES.get(field_name, field_name)


MESH_AXES = ("data", "fsdp", "expert", "tensor", "context")
MAX_SEED = 2**32 - 1
DEFAULT_RULES = {  # logical axis -> mesh axes; activations are the act_* names
    "batch": ("data", "fsdp", "expert"), "length": ("context",), "act_embed": (),
    "act_heads": ("tensor",), "act_kv_heads": ("tensor",), "act_mlp": ("tensor",),
    "act_vocab": ("tensor",), "embed": ("fsdp",), "vocab": ("tensor",), "q_heads": ("tensor",),
    "kv_heads": ("tensor",), "mlp": ("tensor",), "gate_up": (), "head_dim": (), "layers": (),
    "norm": (), "expert": ("expert",),
}


@dataclasses.dataclass(frozen=True)
class StageConfig:
  seq_len: int  # >= 8; positions per row (L)
  batch: int  # >= 1; global rows per step
  steps: int = 0  # >= 0; optimizer steps in this stage; or set `tokens`
  tokens: int = 0  # >= 0; token budget (positions); rounded up to whole steps
  mix: dict[str, float] | None = None  # > 0; overrides data.mix for this stage
  name: str = ""  # shown in the ledger, the console and curves.png (default: the index)
  rope: RopeConfig = RopeConfig()
  attention: str = "auto"  # auto | reference | blockwise | splash | gpu (| splash_causal | gpu_mha)
  block_q: int = 512  # >= 8; attention tile sizes
  block_k: int = 512  # >= 8
  mesh: MeshConfig = MeshConfig()
  sparse: SparseConfig = SparseConfig()
  objective: str = ""  # lm | dpo | grpo: this stage's objective (default: train.objective)

  @property
  def num_steps(self):
    return self.steps or -(-self.tokens // (self.seq_len * self.batch))

  def check(self, key):
    _in_range(f"{key}.seq_len", self.seq_len, 8, MAX_SEQ_LEN)
    _in_range(f"{key}.batch", self.batch, 1, MAX_BATCH)
    _at_least(f"{key}.steps", self.steps, 0)
    _at_least(f"{key}.tokens", self.tokens, 0)
    if (self.steps > 0) == (self.tokens > 0):
      raise ConfigError(f"{key}: set exactly one of steps or tokens (> 0)")
    _check_mix(f"{key}.mix", self.mix or {})
    if self.attention not in ATTENTION_IMPLS:
      raise ConfigError(f"{key}.attention: expected one of {', '.join(ATTENTION_IMPLS)}, "
                        f"got {self.attention!r}")
    _at_least(f"{key}.block_q", self.block_q, 8)
    _at_least(f"{key}.block_k", self.block_k, 8)
    self.rope.check(f"{key}.rope")
    self.mesh.check(f"{key}.mesh")
    self.sparse.check(f"{key}.sparse")
    if self.objective not in ("", "lm", "dpo", "grpo"):
      raise ConfigError(f"{key}.objective: expected lm, dpo or grpo, got {self.objective!r}")


@dataclasses.dataclass(frozen=True)
class Config:
  stages: tuple[StageConfig, ...]
  seed: int = 0  # in [0, 2**32 - 1]; jax.random.key keeps 32 bits (larger seeds wrap)
  run_dir: str = "runs/demo"  # checkpoints, metrics and events (local or gs://)
  distributed: bool = False  # call jax.distributed.initialize() (multi-host TPU or GPU jobs)
  data: DataConfig = DataConfig()
  model: ModelConfig = ModelConfig()
  train: TrainConfig = TrainConfig()
  init: InitConfig = InitConfig()
  rules: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=lambda: dict(
      DEFAULT_RULES))

  def check(self, key=""):
    _in_range("seed", self.seed, 0, MAX_SEED)
    for name, axes in self.rules.items():
      if name not in DEFAULT_RULES:  # a typo would leave the real rule at its default
        near = difflib.get_close_matches(name, DEFAULT_RULES, n=1)
        hint = f"did you mean 'rules.{near[0]}'? " if near else ""
        raise ConfigError(f"unknown key 'rules.{name}'; {hint}the logical axes are "
                          f"{', '.join(DEFAULT_RULES)}")
      for axis in axes:
        if axis not in MESH_AXES:
          raise ConfigError(f"rules.{name}: unknown mesh axis {axis!r}; the mesh axes are "
                            f"{', '.join(MESH_AXES)}")
    if not self.stages:
      raise ConfigError("stages: at least one stage is required")
    self.data.check("data")
    self.model.check("model")
    self.train.check("train")
    self.init.check("init")
    config_rules.check_objectives_and_families(self)
    for i, stage in enumerate(self.stages):
      if stage.batch % self.train.grad_accum:
        raise ConfigError(f"stages.{i}.batch={stage.batch} is not divisible by "
                          f"train.grad_accum={self.train.grad_accum}")
    for i, stage in enumerate(self.stages):
      stage.check(f"stages.{i}")
    config_rules.check_sparse_ladder(self.stages)

  def mix_for(self, stage_index):
    return self.stages[stage_index].mix or self.data.mix

  def objective_for(self, stage_index):
    return self.stages[stage_index].objective or self.train.objective


# (section, key) -> what replaced it: keys that old configs carry and nothing reads any more
RETIRED = {("train", "eval_rows"): "train.eval_tokens replaced it"}


def load(path, overrides=()):
  """Reads a YAML config, applies `key=value` overrides and returns a validated `Config`; a
  retired key is dropped with a FutureWarning."""
  raw = read_yaml(path)
  for item in overrides:
    apply_override(raw, item)
  raw, retired = _without_retired(raw)
  for key, why in retired:
    warnings.warn(f"{key} is retired and ignored ({why}): remove it from the config",
                  FutureWarning, stacklevel=2)
  return from_dict(raw)


def _without_retired(raw):
  """(raw less the RETIRED keys, [(dotted key, what replaced it)] of those it had)."""
  dropped = []
  for (section, name), why in RETIRED.items():
    part = raw.get(section)
    if isinstance(part, dict) and name in part:
      raw = {**raw, section: {k: v for k, v in part.items() if k != name}}
      dropped.append((f"{section}.{name}", why))
  return raw, dropped


def from_dict(raw):
  """A validated `Config` from parsed data; retired keys (saved in old checkpoints) are
  dropped silently."""
  raw, _ = _without_retired(raw)
  model = raw.get("model")
  if isinstance(model, dict):  # a named size fills in what the config does not set
    size = model.get("size", ModelConfig.size)
    raw = {**raw, "model": {**MODEL_SIZES.get(size, {}), **model}}
  if isinstance(raw.get("init"), dict):
    raw = {**raw, "init": {_field_name(k): v for k, v in raw["init"].items()}}
  if isinstance(raw.get("rules"), dict):  # `rules.embed=[fsdp]` changes that rule alone
    raw = {**raw, "rules": {**DEFAULT_RULES, **raw["rules"]}}
  try:
    config = build(Config, raw)
  except ConfigError as e:
    raise ConfigError(_yaml_text(str(e))) from None
  config.check()
  return config


def _field_name(yaml_key):
  return {v: k for k, v in YAML_NAMES.items()}.get(yaml_key, yaml_key)


def _yaml_text(message):
  for field, key in YAML_NAMES.items():
    message = message.replace(f"init.{field}", f"init.{key}").replace(f" {field}", f" {key}")
  return message


def to_dict(config):
  """The resolved config as plain YAML-able data (tuples become lists)."""
  def plain(value):
    if isinstance(value, (list, tuple)):
      return [plain(v) for v in value]
    if isinstance(value, dict):
      return {k: plain(v) for k, v in value.items()}
    return value
  out = plain(dataclasses.asdict(config))
  out["init"] = {yaml_name(k): v for k, v in out["init"].items()}
  return out


def _check_mix(key, mix):
  for name, share in mix.items():
    if not share > 0:
      raise ConfigError(f"{key}.{name}: expected a quota > 0, got {share}")

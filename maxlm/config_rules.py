"""Config rules that span sections: which stage objectives, attention modes and model families
go together, and the shape of step ranges and the sparse-attention ladder. Split from config.py,
which defines the sections and checks each on its own."""

from maxlm.typed_yaml import ConfigError


def check_objectives_and_families(config):
  """The stage objectives, sparse stages and model families a config may combine."""
  sparse = [i for i, st in enumerate(config.stages) if st.sparse.mode != "dense"]
  if config.model.attention.window and sparse:
    raise ConfigError(f"stages.{sparse[0]}.sparse.mode={config.stages[sparse[0]].sparse.mode} "
                      "with model.attention.window: sparse attention has no local layers; "
                      "use one or the other")
  mqa_refusal = _mqa_refusal(config, sparse)
  if mqa_refusal:
    raise ConfigError(mqa_refusal)
  objectives = set(map(config.objective_for, range(len(config.stages))))
  moe = config.model.moe
  if objectives & {"dpo", "grpo"} and moe.experts and moe.balance == "bias":
    raise ConfigError("model.moe.balance=bias with a dpo/grpo stage: their forward passes route "
                      "without the balancing bias; post-train with balance=aux_loss or none")
  for i, stage in enumerate(config.stages):
    if moe.experts and stage.mesh.expert > 1 and moe.experts % stage.mesh.expert:
      raise ConfigError(f"stages.{i}.mesh.expert={stage.mesh.expert}: model.moe.experts="
                        f"{moe.experts} do not split over it; choose a divisor of the experts")
  if "dpo" in objectives and not config.init.from_:
    raise ConfigError("train.objective=dpo needs init.from=RUN_DIR: its weights start the run "
                      "and are the frozen reference model (docs/pairs.md)")
  if not config.data.document_mask and objectives != {"lm"}:
    raise ConfigError("data.document_mask=false with a dpo/grpo stage: a preference pair or a "
                      "rollout is its own segments; the ablation is for lm stages only")


def _mqa_refusal(config, sparse):
  """What DeepSeek-V4's attention (model.mqa) cannot be combined with yet, or None."""
  if not config.model.mqa.enabled:
    return None
  mqa = config.model.mqa
  if sparse and mqa.csa_rate not in mqa.compress:
    return (f"stages.{sparse[0]}.sparse.mode={config.stages[sparse[0]].sparse.mode} with "
            "model.mqa: only CSA layers have an indexer, and model.mqa.compress names none "
            f"(add csa_rate={mqa.csa_rate})")
  if config.model.attention.window:
    return ("model.attention.window with model.mqa: V4's attention has its own window "
            "(model.mqa.window); set model.attention.window=0")
  for i, stage in enumerate(config.stages):
    if stage.mesh.context > 1:
      return (f"stages.{i}.mesh.context={stage.mesh.context} with model.mqa: V4's attention "
              "is not split over positions yet; use mesh.context=1")
  if any(o in ("dpo", "grpo") for o in map(config.objective_for, range(len(config.stages)))):
    return ("model.mqa with a dpo/grpo stage: not built for V4's attention yet (its sampling "
            "runs a whole forward per token, with no cache of its entries)")
  return None


def check_skip_steps(key, ranges):
  for i, r in enumerate(ranges):
    if len(r) != 2 or not 0 <= r[0] < r[1]:
      raise ConfigError(f"{key}.{i}: expected [a, b] with 0 <= a < b (global steps a..b-1 "
                        f"are skipped), got {list(r)}")
  ordered = sorted(ranges)
  for (a0, b0), (a1, b1) in zip(ordered, ordered[1:]):
    if a1 < b0:
      raise ConfigError(f"{key}: ranges [{a0}, {b0}] and [{a1}, {b1}] overlap; merge them")


def check_sparse_ladder(stages):
  """Indexer parameters appear at the first non-dense stage and never go away or change."""
  first = None
  for i, stage in enumerate(stages):
    sp = stage.sparse
    if sp.mode == "dense":
      if first is not None:
        raise ConfigError(f"stages.{i}.sparse.mode: dense after stage {first}'s "
                          f"{stages[first].sparse.mode}; once the indexer exists every later "
                          "stage is indexer_warmup or sparse")
      continue
    if first is None:
      first = i
    shape = (sp.indexer_heads, sp.indexer_dim)
    there = (stages[first].sparse.indexer_heads, stages[first].sparse.indexer_dim)
    if shape != there:
      raise ConfigError(f"stages.{i}.sparse: indexer_heads/indexer_dim {shape} differ from "
                        f"stage {first}'s {there}; the indexer keeps one shape")

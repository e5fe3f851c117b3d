"""`train.grpo`: group-relative policy optimization on verifiable rewards (maxlm/train/grpo.py,
docs/rl.md). Split from config.py, which holds the pretraining keys."""

import dataclasses

from maxlm.config_checks import above, at_least, in_range, one_of
from maxlm.typed_yaml import ConfigError

LOSS_NORMS = ("token", "sequence")
VERIFIERS = ("exact", "numeric")


@dataclasses.dataclass(frozen=True)
class GrpoConfig:
  group: int = 8  # in [2, 1024]; completions sampled per prompt (G)
  max_new_tokens: int = 64  # >= 1; tokens sampled per completion at most
  temperature: float = 1.0  # > 0; sampling temperature of the rollouts
  top_p: float = 1.0  # in (0, 1]; nucleus sampling of the rollouts
  beta: float = 0.04  # >= 0; weight of the KL to the reference model (init.from), k3 estimator
  clip_eps: float = 0.2  # in (0, 1); the importance ratio is clipped to [1 - eps, 1 + eps]
  inner_steps: int = 1  # >= 1; optimizer steps on each batch of rollouts
  loss_norm: str = "token"  # token (every completion token weighs the same) | sequence
  prompts: int = 8  # >= 1; prompts per step (each sampled `group` times)
  top_k: int = 0  # >= 0; sample among the k likeliest tokens only (0: all)
  # exact | numeric (maxlm/eval/verify.py: reward 1 for a right answer, else 0) |
  # module:function, called as function(completion, gold, prompt) -> float
  verify: str = "exact"
  eval_prompts: str = ""  # held-out {"prompt", "gold"} JSON Lines scored at train.eval_every
  eval_samples: int = 4  # >= 1; completions per held-out prompt (pass@1 is their mean)

  def check(self, key):
    in_range(f"{key}.group", self.group, 2, 1024)
    at_least(f"{key}.max_new_tokens", self.max_new_tokens, 1)
    above(f"{key}.temperature", self.temperature, 0)
    above(f"{key}.top_p", self.top_p, 0)
    in_range(f"{key}.top_p", self.top_p, 0, 1)
    at_least(f"{key}.beta", self.beta, 0)
    above(f"{key}.clip_eps", self.clip_eps, 0)
    in_range(f"{key}.clip_eps", self.clip_eps, 0, 1, high_open=True)
    at_least(f"{key}.inner_steps", self.inner_steps, 1)
    one_of(f"{key}.loss_norm", self.loss_norm, LOSS_NORMS)
    at_least(f"{key}.prompts", self.prompts, 1)
    at_least(f"{key}.top_k", self.top_k, 0)
    at_least(f"{key}.eval_samples", self.eval_samples, 1)
    module, _, function = self.verify.partition(":")
    if self.verify not in VERIFIERS and not (module and function):
      raise ConfigError(f"{key}.verify: expected exact, numeric or module:function, got "
                        f"{self.verify!r}")

"""`stages.N.sparse`: DeepSeek sparse attention for one stage (maxlm/model/attention/sparse.py,
docs/schedule.md). Split from config.py, which holds the stage itself."""

import dataclasses

from maxlm.config_checks import MAX_SEQ_LEN, at_least, in_range
from maxlm.typed_yaml import ConfigError

SPARSE_MODES = ("dense", "indexer_warmup", "sparse")


@dataclasses.dataclass(frozen=True)
class SparseConfig:
  """DeepSeek sparse attention for one stage (maxlm/model/attention/sparse.py). With model.mqa
  only `mode` and `kl_weight` apply, to CSA's indexer (maxlm/model/mqa.py)."""
  mode: str = "dense"  # dense | indexer_warmup (main frozen, indexer learns) | sparse
  topk: int = 2048  # >= 1; keys each query attends to in sparse mode
  indexer_heads: int = 4  # in [1, 64]; same in every non-dense stage
  indexer_dim: int = 64  # in [2, 1024], even (RoPE); same in every non-dense stage
  kl_weight: float = 1.0  # >= 0; weight of the indexer's KL loss
  chunk: int = 0  # >= 0; queries per step of the token-level loop (0: chosen from the length)
  select: str = "block"  # block (top-k // block key blocks per query block) | token (top-k keys)
  block: int = 64  # in [8, 4096]; query and key block size of select=block
  recall_blocks: int = 4  # in [0, 4096]; query blocks per row and layer whose recall is measured

  def check(self, key):
    if self.select not in ("block", "token"):
      raise ConfigError(f"{key}.select: expected block or token, got {self.select!r}")
    in_range(f"{key}.block", self.block, 8, 4096)
    in_range(f"{key}.recall_blocks", self.recall_blocks, 0, 4096)
    if self.mode not in SPARSE_MODES:
      raise ConfigError(f"{key}.mode: expected one of {', '.join(SPARSE_MODES)}, "
                        f"got {self.mode!r}")
    in_range(f"{key}.topk", self.topk, 1, MAX_SEQ_LEN)
    in_range(f"{key}.indexer_heads", self.indexer_heads, 1, 64)
    in_range(f"{key}.indexer_dim", self.indexer_dim, 2, 1024)
    if self.indexer_dim % 2:
      raise ConfigError(f"{key}.indexer_dim: must be even for RoPE, got {self.indexer_dim}")
    at_least(f"{key}.kl_weight", self.kl_weight, 0)
    in_range(f"{key}.chunk", self.chunk, 0, MAX_SEQ_LEN)

"""`stages.N.sparse` (maxlm/config_sparse.py): the defaults pass, and each key's range and
choice is enforced with its name."""

import dataclasses

import pytest

from maxlm.config_sparse import SPARSE_MODES, SparseConfig
from maxlm.typed_yaml import ConfigError


def test_every_mode_and_selection_passes_with_the_defaults():
  for mode in SPARSE_MODES:
    for select in ("block", "token"):
      SparseConfig(mode=mode, select=select).check("stages.0.sparse")


@pytest.mark.parametrize("change, message", [
    ({"mode": "dense_ish"}, "stages.0.sparse.mode: expected one of dense, indexer_warmup, sparse"),
    ({"select": "row"}, "stages.0.sparse.select: expected block or token, got 'row'"),
    ({"block": 4}, "stages.0.sparse.block: expected an integer in [8, 4096], got 4"),
    ({"topk": 0}, "stages.0.sparse.topk: expected an integer in [1, "),
    ({"indexer_heads": 65}, "stages.0.sparse.indexer_heads: expected an integer in [1, 64]"),
    ({"indexer_dim": 63}, "stages.0.sparse.indexer_dim: must be even for RoPE, got 63"),
    ({"kl_weight": -1.0}, "stages.0.sparse.kl_weight: expected a number >= 0"),
    ({"chunk": -1}, "stages.0.sparse.chunk: expected an integer in [0, "),
])
def test_each_bad_key_is_refused_by_name(change, message):
  with pytest.raises(ConfigError) as e:
    dataclasses.replace(SparseConfig(), **change).check("stages.0.sparse")
  assert str(e.value).startswith(message)

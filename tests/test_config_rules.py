"""The config rules that span sections (maxlm/config_rules.py): skip-step ranges, the sparse
ladder, and which objectives, attention modes and model families go together."""

import types

import pytest

from maxlm import config_rules
from maxlm.config_sparse import SparseConfig
from maxlm.typed_yaml import ConfigError

import datagen


def test_skip_ranges_are_ordered_pairs_that_do_not_overlap():
  config_rules.check_skip_steps("data.skip_steps", [(10, 20), (0, 5), (20, 30)])
  with pytest.raises(ConfigError, match=r"data.skip_steps.1: expected \[a, b\] with 0 <= a < b"):
    config_rules.check_skip_steps("data.skip_steps", [(0, 5), (7, 7)])
  with pytest.raises(ConfigError, match=r"data.skip_steps.0: .*got \[-1, 3\]"):
    config_rules.check_skip_steps("data.skip_steps", [(-1, 3)])
  with pytest.raises(ConfigError, match=r"ranges \[0, 10\] and \[5, 12\] overlap"):
    config_rules.check_skip_steps("data.skip_steps", [(5, 12), (0, 10)])


def _stages(*sparse):
  return [types.SimpleNamespace(sparse=s) for s in sparse]


def test_the_sparse_ladder_never_goes_back_to_dense_nor_changes_the_indexer():
  warm, sparse = SparseConfig(mode="indexer_warmup"), SparseConfig(mode="sparse")
  config_rules.check_sparse_ladder(_stages(SparseConfig(), warm, sparse, sparse))
  with pytest.raises(ConfigError, match="stages.2.sparse.mode: dense after stage 1's "
                                        "indexer_warmup"):
    config_rules.check_sparse_ladder(_stages(SparseConfig(), warm, SparseConfig()))
  with pytest.raises(ConfigError, match=r"stages.1.sparse: indexer_heads/indexer_dim \(8, 64\) "
                                        r"differ from stage 0's \(4, 64\)"):
    config_rules.check_sparse_ladder(_stages(warm, SparseConfig(mode="sparse", indexer_heads=8)))


def test_sparse_stages_with_a_window_are_refused():
  config = datagen.make_config([{"seq_len": 64, "batch": 2, "steps": 1,
                                 "sparse": {"mode": "indexer_warmup"}}])
  config_rules.check_objectives_and_families(config)
  windowed = types.SimpleNamespace(
      stages=config.stages, objective_for=config.objective_for, init=config.init,
      model=types.SimpleNamespace(attention=types.SimpleNamespace(window=64),
                                  moe=config.model.moe))
  with pytest.raises(ConfigError, match="stages.0.sparse.mode=indexer_warmup with "
                                        "model.attention.window"):
    config_rules.check_objectives_and_families(windowed)

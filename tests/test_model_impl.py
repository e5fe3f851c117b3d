"""The one rule for which implementations a stage runs on a platform (maxlm/model/impl.py)."""

import dataclasses

import pytest

from maxlm import MaxlmError, config
from maxlm.model import impl
from maxlm.model import auto_rule


def stage(**keys):
  return config.from_dict({"model": {"size": "tiny", "vocab_size": 64},
                           "stages": [{"seq_len": 256, "batch": 1, "steps": 1, **keys}]}).stages[0]


@pytest.mark.parametrize("name, device", [("splash", "TPU"), ("gpu", "GPU")])
def test_a_stage_refuses_a_kernel_on_a_cpu_platform(name, device):
  with pytest.raises(MaxlmError, match=rf"^stages.0.attention={name} needs a {device}; this "
                                       r"machine has only a CPU \(set stages.0.attention=auto\)$"):
    impl.choose(stage(attention=name, block_q=128), "cpu", "stages.0")


@pytest.mark.parametrize("name, platform", [("splash", "tpu"), ("gpu", "gpu")])
def test_a_stage_runs_its_kernel_on_its_platform_compiled(name, platform):
  choice = impl.choose(stage(attention=name, block_q=128), platform)
  assert choice.attention == name and not choice.interpret


def test_a_kernel_on_the_other_accelerator_is_refused():
  with pytest.raises(MaxlmError, match="'splash' needs a TPU; this job runs on gpu"):
    impl.choose(stage(attention="splash"), "gpu")
  with pytest.raises(MaxlmError, match="'gpu' needs a GPU; this job runs on tpu"):
    impl.choose(stage(attention="gpu"), "tpu")


def test_tiles_are_checked_for_the_kernel_that_runs():
  with pytest.raises(MaxlmError, match=r"stages.0.block_q=24: the splash kernel's tiles must be "
                                       "multiples of 128"):
    impl.choose(stage(attention="splash", block_q=24), "tpu", "stages.0")


def test_the_configs_list_is_the_choosers():
  assert config.ATTENTION_IMPLS is impl.ATTENTION_IMPLS
  for name in config.ATTENTION_IMPLS:
    stage(attention=name)  # the config takes every name the chooser knows


@pytest.mark.parametrize("platform", ["cpu", "tpu", "gpu"])
@pytest.mark.parametrize("seq_len", [64, 128, 129, 4096, 65536, 65537])
def test_auto_picks_what_auto_rule_did(platform, seq_len):
  s = dataclasses.replace(stage(), seq_len=seq_len, block_q=128)
  choice = impl.choose(s, platform)
  assert choice.attention == auto_rule.choose(platform, seq_len)
  assert choice.grouped == {"cpu": "tiled", "tpu": "megablox", "gpu": "ragged_dot_tiles"}[platform]
  assert choice.interpret == (platform == "cpu") and choice.sparse == "dense"


def test_sparse_modes():
  sparse = lambda **k: dataclasses.replace(config.SparseConfig(), **k)
  assert impl.sparse_impl(None, False) == "dense"
  assert impl.sparse_impl(sparse(mode="indexer_warmup"), True) == "indexer_warmup"
  assert impl.sparse_impl(sparse(mode="sparse", select="block"), True) == "context"
  assert impl.sparse_impl(sparse(mode="sparse", select="block"), False) == "blocks"
  assert impl.sparse_impl(sparse(mode="sparse", select="token"), False) == "tokens"

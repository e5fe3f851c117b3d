"""What `attention=auto` runs (maxlm/model/auto_rule.py), per platform, length and
documents per row, at the edges of its thresholds."""

import pytest

from maxlm.config import ATTENTION_IMPLS as IMPLS
from maxlm.model import auto_rule


def test_cpu_takes_the_dense_reference_up_to_its_threshold_then_blockwise():
  edge = auto_rule.CPU_REFERENCE_MAX_LEN
  assert auto_rule.choose("cpu", edge) == "reference"
  assert auto_rule.choose("cpu", edge + 1) == "blockwise"
  assert auto_rule.choose("cpu") == "blockwise"  # length unknown


def test_tpu_takes_splash_up_to_its_longest_row():
  edge = auto_rule.TPU_SPLASH_MAX_LEN
  assert auto_rule.choose("tpu", edge) == auto_rule.choose("tpu") == "splash"
  assert auto_rule.choose("tpu", edge + 1) == "blockwise"


def test_gpu_takes_its_kernel_unless_a_threshold_is_set(monkeypatch):
  if auto_rule.GPU_BLOCKWISE_FROM is None:  # not measured yet: the kernel everywhere
    assert auto_rule.choose("gpu", 2**20, 1000) == "gpu"
  monkeypatch.setattr(auto_rule, "GPU_BLOCKWISE_FROM", (65536, 32))
  assert auto_rule.choose("gpu", 65536, 32) == "blockwise"
  assert auto_rule.choose("gpu", 65536, None) == "blockwise"  # unknown: many documents
  assert auto_rule.choose("gpu", 65536, 31) == "gpu"
  assert auto_rule.choose("gpu", 65535, 32) == "gpu"
  assert auto_rule.choose("gpu") == "gpu"


@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu"])
def test_the_choice_is_an_attention_impl(platform):
  for length in (None, 64, 4096, 2**20):
    assert auto_rule.choose(platform, length) in set(IMPLS) - {"auto"}

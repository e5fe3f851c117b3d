"""RoPE frequencies and attention factor against the reference YaRN (Peng et al., 2023), as
transformers' `rope_type: "yarn"` computes it: first a table from the formula written out here
element by element, then (where transformers is installed) transformers' own function."""

import math

import numpy as np
import pytest

from maxlm import config as config_lib
from maxlm.config import ConfigError, RopeConfig
from maxlm.model import rope


def reference_yarn(dim, theta, factor, original, beta_fast=32.0, beta_slow=1.0,
                   attention_factor=None):
  """The YaRN reference, one frequency at a time in plain Python floats."""
  def dim_for(turns):  # the dimension whose wavelength turns `turns` times in `original`
    return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))
  low = max(math.floor(dim_for(beta_fast)), 0)
  high = min(math.ceil(dim_for(beta_slow)), dim - 1)
  if high == low:
    high += 0.001
  out = []
  for i in range(dim // 2):
    base = 1.0 / theta ** (2 * i / dim)
    ramp = min(max((i - low) / (high - low), 0.0), 1.0)
    extrapolate = 1.0 - ramp
    out.append(base / factor * (1 - extrapolate) + base * extrapolate)
  scale = attention_factor or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
  return np.array(out), scale


CASES = [  # (head_dim, theta, factor, original_length, beta_fast, beta_slow, attention_factor)
    (128, 5e5, 4.0, 4096, 32, 1, 0),  # configs/schedule_4k_1m.yaml's three YaRN stages
    (128, 5e5, 16.0, 4096, 32, 1, 0),
    (128, 5e5, 256.0, 4096, 32, 1, 0),
    (64, 1e4, 8.0, 2048, 32, 1, 0),
    (64, 1e6, 4.0, 32768, 16, 2, 0),
    (16, 1e4, 2.5, 128, 32, 1, 1.3),
    (32, 1e4, 1.0, 4096, 32, 1, 0),  # factor 1: every frequency kept
    (8, 10.0, 4.0, 16, 32, 1, 0),  # a ramp bound clipped at 0
]


@pytest.mark.parametrize("dim, theta, factor, original, fast, slow, attn", CASES)
def test_yarn_frequencies_and_attention_factor_equal_the_reference(dim, theta, factor, original,
                                                                   fast, slow, attn):
  cfg = RopeConfig(theta=theta, scaling="yarn", factor=factor, original_length=original,
                   beta_fast=fast, beta_slow=slow, attention_factor=attn)
  want, scale = reference_yarn(dim, theta, factor, original, fast, slow, attn)
  got = rope.inverse_frequencies(dim, cfg)
  assert got.dtype == np.float32 and got.shape == (dim // 2,)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
  assert rope.attention_scale(cfg) == pytest.approx(scale, rel=1e-12)


def test_yarn_ramps_in_the_dimension_index_not_the_rotation_count():
  """The issue's case: head 128, theta 5e5, original 4096. The ramp is linear in i between the
  floored and ceiled bounds, so the share of the original frequency falls by 1/(high - low)
  per index; a ramp in the rotation count would fall geometrically there."""
  cfg = RopeConfig(theta=5e5, scaling="yarn", factor=16.0, original_length=4096)
  low, high = rope.yarn_range(128, cfg)
  assert (low, high) == (math.floor(128 * math.log(4096 / (64 * math.pi)) / (2 * math.log(5e5))),
                         math.ceil(128 * math.log(4096 / (2 * math.pi)) / (2 * math.log(5e5))))
  base = rope.inverse_frequencies(128, RopeConfig(theta=5e5)).astype(np.float64)
  got = rope.inverse_frequencies(128, cfg).astype(np.float64)
  keep = (got - base / 16) / (base - base / 16)  # share of the original frequency per index
  np.testing.assert_allclose(keep[:low + 1], 1.0, atol=1e-6)
  np.testing.assert_allclose(keep[high:], 0.0, atol=1e-6)
  np.testing.assert_allclose(np.diff(keep[low:high + 1]), -1 / (high - low), atol=1e-5)


def test_none_and_linear_are_unchanged():
  np.testing.assert_array_equal(
      rope.inverse_frequencies(64, RopeConfig(theta=1e4, scaling="linear", factor=4.0)),
      (1.0 / 1e4 ** (np.arange(0, 64, 2) / 64)).astype(np.float32))
  assert rope.attention_scale(RopeConfig(scaling="linear", factor=4.0)) == 1.0


@pytest.mark.parametrize("override, message", [
    ("beta_slow=0", r"rope.beta_slow: expected a number > 0, got 0.0"),
    ("beta_fast=1", r"rope.beta_fast: expected a number > 1.0, got 1.0"),
    ("attention_factor=-1", r"rope.attention_factor: expected a number >= 0, got -1.0"),
    ("beta_fsat=3", r"beta_fsat"),
])
def test_rope_keys_are_checked(override, message):
  raw = {"stages": [{"seq_len": 16, "batch": 1, "steps": 1}]}
  with pytest.raises(ConfigError, match=message):
    config_lib.from_dict({"stages": [{**raw["stages"][0], "rope": dict(
        [(override.split("=")[0], float(override.split("=")[1]))])}]})


@pytest.mark.parametrize("dim, theta, factor, original, fast, slow, attn", CASES)
def test_yarn_equals_transformers(dim, theta, factor, original, fast, slow, attn):
  torch = pytest.importorskip("torch", reason="torch not installed (pip install -e '.[hf]')")
  transformers = pytest.importorskip("transformers", reason="transformers not installed")
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  params = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
            "beta_fast": fast, "beta_slow": slow}
  if attn:
    params["attention_factor"] = attn
  # the keys an exported config.json carries, read by transformers 4.4x and 5.x alike
  config = transformers.LlamaConfig(hidden_size=dim * 2, num_attention_heads=2, head_dim=dim,
                                    max_position_embeddings=int(original * factor),
                                    rope_theta=theta, rope_scaling=params)
  inv, scale = ROPE_INIT_FUNCTIONS["yarn"](config, torch.device("cpu"))
  cfg = RopeConfig(theta=theta, scaling="yarn", factor=factor, original_length=original,
                   beta_fast=fast, beta_slow=slow, attention_factor=attn)
  # transformers raises theta to a power in float32, maxlm in float64 (then rounds): ulps apart
  np.testing.assert_allclose(rope.inverse_frequencies(dim, cfg), inv.numpy(), rtol=1e-6)
  assert rope.attention_scale(cfg) == pytest.approx(scale, rel=1e-12)

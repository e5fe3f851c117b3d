"""`train.grpo` (maxlm/config_grpo.py): the defaults pass, each key's range is enforced with
its name, and `verify` takes exact, numeric or module:function."""

import dataclasses

import pytest

from maxlm.config_grpo import GrpoConfig
from maxlm.typed_yaml import ConfigError


def test_the_defaults_and_a_module_function_verifier_pass():
  GrpoConfig().check("train.grpo")
  GrpoConfig(verify="mypkg.rewards:score", top_p=1.0, clip_eps=0.5, group=2).check("train.grpo")


@pytest.mark.parametrize("change, message", [
    ({"group": 1}, "train.grpo.group: expected an integer in [2, 1024], got 1"),
    ({"temperature": 0.0}, "train.grpo.temperature: expected a number > 0"),
    ({"top_p": 0.0}, "train.grpo.top_p: expected a number > 0"),
    ({"top_p": 1.5}, "train.grpo.top_p: expected a number in [0, 1]"),
    ({"clip_eps": 1.0}, r"train.grpo.clip_eps: expected a number in [0, 1)"),
    ({"loss_norm": "batch"}, "train.grpo.loss_norm: expected one of token, sequence"),
    ({"beta": -0.1}, "train.grpo.beta: expected a number >= 0"),
    ({"verify": "mypkg.rewards"}, "train.grpo.verify: expected exact, numeric or module:function"),
    ({"verify": ":score"}, "train.grpo.verify: expected exact, numeric or module:function"),
    ({"eval_samples": 0}, "train.grpo.eval_samples: expected an integer >= 1"),
])
def test_each_bad_key_is_refused_by_name(change, message):
  with pytest.raises(ConfigError) as e:
    dataclasses.replace(GrpoConfig(), **change).check("train.grpo")
  assert str(e.value).startswith(message)

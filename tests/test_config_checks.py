"""The range checks every config section uses (maxlm/config_checks.py): each refusal is one
line naming the key, what is allowed and what was given; the bounds are inclusive unless said."""

import pytest

from maxlm import config_checks as checks
from maxlm.typed_yaml import ConfigError


def test_bounds_pass_at_their_edges():
  checks.at_least("k", 0, 0)
  checks.above("k", 0.5, 0)
  checks.in_range("k", 1, 1, 4)
  checks.in_range("k", 4, 1, 4)
  checks.in_range("k", 0.99, 0, 1, high_open=True)
  checks.one_of("k", "b", ("a", "b"))


@pytest.mark.parametrize("call, message", [
    (lambda: checks.at_least("train.steps", -1, 0),
     "train.steps: expected an integer >= 0, got -1"),
    (lambda: checks.above("train.lr", 0.0, 0), "train.lr: expected a number > 0, got 0.0"),
    (lambda: checks.in_range("a.b", 5, 1, 4), "a.b: expected an integer in [1, 4], got 5"),
    (lambda: checks.in_range("a.b", 1.0, 0, 1, high_open=True),
     "a.b: expected a number in [0, 1), got 1.0"),
    (lambda: checks.one_of("a.mode", "c", ("a", "b")), "a.mode: expected one of a, b, got 'c'"),
])
def test_a_refusal_names_the_key_the_bound_and_the_value(call, message):
  with pytest.raises(ConfigError) as e:
    call()
  assert str(e.value) == message


def test_nan_passes_no_bound():
  for call in (lambda: checks.at_least("k", float("nan"), 0),
               lambda: checks.above("k", float("nan"), 0),
               lambda: checks.in_range("k", float("nan"), 0, 1)):
    with pytest.raises(ConfigError, match="got nan"):
      call()

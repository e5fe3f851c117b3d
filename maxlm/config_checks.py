"""The range checks every config section uses: one line naming the key, what is allowed and
what was given. Split from config.py so sections defined in their own modules
(config_model.py, config_grpo.py) check their keys the same way without an import cycle."""

from maxlm.typed_yaml import ConfigError

MAX_MODEL_DIM = 2**20  # any model size, vocabulary or chunk beyond this is a typo
MAX_SEQ_LEN = 2**24  # 16M positions per row (the production schedule ends at 1M)
MAX_BATCH = 2**20


def kind(value):
  return "an integer" if isinstance(value, int) else "a number"


def at_least(key, value, low):
  if not value >= low:
    raise ConfigError(f"{key}: expected {kind(value)} >= {low}, got {value}")


def above(key, value, low):
  if not value > low:
    raise ConfigError(f"{key}: expected {kind(value)} > {low}, got {value}")


def in_range(key, value, low, high, high_open=False):
  if not (low <= value < high if high_open else low <= value <= high):
    bracket = ")" if high_open else "]"
    raise ConfigError(f"{key}: expected {kind(value)} in [{low}, {high}{bracket}, got {value}")


def one_of(key, value, allowed):
  if value not in allowed:
    raise ConfigError(f"{key}: expected one of {', '.join(map(str, allowed))}, got {value!r}")

"""Typed run configuration: YAML file + dotted `key=value` overrides, validated before any work.

The schema is the dataclasses below; `load(path, overrides)` returns a `Config` or raises
`ConfigError` naming the key and what is allowed. Parsing is generic over the dataclass fields,
so adding a field is one line here and nowhere else.
"""

import dataclasses
import difflib
import pathlib
import types
import typing

import yaml

from maxlm import MaxlmError


class ConfigError(MaxlmError):
  pass


@dataclasses.dataclass(frozen=True)
class FimConfig:
  rate: float = 0.0  # fraction of eligible pieces turned into fill-in-the-middle
  spm: float = 0.5  # of those, the fraction in SPM order (the rest PSM)
  sources: tuple[str, ...] = ()  # sources eligible for FIM; empty means every non-chat source

  def check(self, key):
    _in_range(f"{key}.rate", self.rate, 0.0, 1.0)
    _in_range(f"{key}.spm", self.spm, 0.0, 1.0)


@dataclasses.dataclass(frozen=True)
class DataConfig:
  dir: str = "runs/demo/data"  # the folder `maxlm prepare` wrote
  mix: dict[str, float] = dataclasses.field(default_factory=dict)  # token quota per source
  overlap: int = 32  # tokens of a cut document carried into the next piece as context
  min_cut: float = 0.5  # a section/paragraph cut must keep at least this share of the room
  lookahead: int = 64  # pieces per source the packer may choose from (best fit)
  shuffle_rows: int = 256  # rows are shuffled within windows of this many rows
  block_rows: int = 4096  # the planner works (and snapshots) in blocks of this many rows
  fim: FimConfig = FimConfig()
  workers: int = 0  # Grain worker processes; batches do not depend on it
  prefetch: int = 2  # batches each worker prepares ahead

  def check(self, key):
    for name, share in self.mix.items():
      if not share > 0:
        raise ConfigError(f"{key}.mix.{name}: expected a quota > 0, got {share}")
    _at_least(f"{key}.overlap", self.overlap, 0)
    _in_range(f"{key}.min_cut", self.min_cut, 0.0, 1.0)
    _at_least(f"{key}.lookahead", self.lookahead, 1)
    _at_least(f"{key}.shuffle_rows", self.shuffle_rows, 1)
    _at_least(f"{key}.block_rows", self.block_rows, 1)
    _at_least(f"{key}.workers", self.workers, 0)
    _at_least(f"{key}.prefetch", self.prefetch, 1)
    if self.block_rows % self.shuffle_rows:
      raise ConfigError(f"{key}.block_rows: must be a multiple of {key}.shuffle_rows "
                        f"({self.shuffle_rows}), got {self.block_rows}")
    self.fim.check(f"{key}.fim")


@dataclasses.dataclass(frozen=True)
class StageConfig:
  seq_len: int  # positions per row (L)
  batch: int  # global rows per step
  steps: int = 0  # optimizer steps in this stage; or set `tokens`
  tokens: int = 0  # token budget (positions); rounded up to whole steps
  mix: dict[str, float] | None = None  # overrides data.mix for this stage
  name: str = ""

  @property
  def num_steps(self):
    return self.steps or -(-self.tokens // (self.seq_len * self.batch))

  def check(self, key):
    _at_least(f"{key}.seq_len", self.seq_len, 8)
    _at_least(f"{key}.batch", self.batch, 1)
    if (self.steps > 0) == (self.tokens > 0):
      raise ConfigError(f"{key}: set exactly one of steps or tokens (> 0)")
    for name, share in (self.mix or {}).items():
      if not share > 0:
        raise ConfigError(f"{key}.mix.{name}: expected a quota > 0, got {share}")


@dataclasses.dataclass(frozen=True)
class Config:
  stages: tuple[StageConfig, ...]
  seed: int = 0
  run_dir: str = "runs/demo"
  data: DataConfig = DataConfig()

  def check(self, key=""):
    if not self.stages:
      raise ConfigError("stages: at least one stage is required")
    self.data.check("data")
    for i, stage in enumerate(self.stages):
      stage.check(f"stages.{i}")

  def mix_for(self, stage_index):
    return self.stages[stage_index].mix or self.data.mix


def load(path, overrides=()):
  """Reads a YAML config, applies `key=value` overrides and returns a validated `Config`."""
  raw = read_yaml(path)
  for item in overrides:
    apply_override(raw, item)
  return from_dict(raw)


def read_yaml(path):
  path = resolve_path(path)
  try:
    raw = yaml.safe_load(path.read_text())
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None)
    where = f" line {mark.line + 1}" if mark else ""
    raise ConfigError(f"{path}{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
  if not isinstance(raw, dict):
    raise ConfigError(f"{path}: expected a mapping of keys at the top level")
  return raw


def resolve_path(path):
  """A config path, or a bare name found in ./configs or the repository's configs/."""
  candidates = [pathlib.Path(path)]
  if not str(path).endswith((".yaml", ".yml")):
    name = f"{path}.yaml"
    candidates += [pathlib.Path("configs") / name,
                   pathlib.Path(__file__).resolve().parents[1] / "configs" / name]
  for candidate in candidates:
    if candidate.is_file():
      return candidate
  raise ConfigError(f"config file not found: {path}")


def apply_override(raw, item):
  key, sep, text = item.partition("=")
  if not sep or not key:
    raise ConfigError(f"override {item!r}: expected key=value, e.g. data.overlap=64")
  try:
    value = yaml.safe_load(text) if text else ""
  except yaml.YAMLError:
    value = text
  node, parts = raw, key.split(".")
  for depth, part in enumerate(parts[:-1]):
    node = _child(node, part, ".".join(parts[:depth + 1]), create=True)
  last = parts[-1]
  if isinstance(node, list):
    node[_list_index(node, last, key)] = value
  else:
    node[last] = value


def from_dict(raw):
  config = _build(Config, raw, "")
  config.check()
  return config


def to_dict(config):
  """The resolved config as plain YAML-able data (tuples become lists)."""
  def plain(value):
    if isinstance(value, (list, tuple)):
      return [plain(v) for v in value]
    if isinstance(value, dict):
      return {k: plain(v) for k, v in value.items()}
    return value
  return plain(dataclasses.asdict(config))


def _child(node, part, key, create):
  if isinstance(node, list):
    return node[_list_index(node, part, key)]
  if not isinstance(node, dict):
    raise ConfigError(f"{key}: cannot set a sub-key of a {type(node).__name__}")
  if part not in node and create:
    node[part] = {}
  return node[part]


def _list_index(node, part, key):
  if not part.isdigit() or int(part) >= len(node):
    raise ConfigError(f"{key}: expected an index 0..{len(node) - 1}, got {part!r}")
  return int(part)


def _build(cls, raw, key):
  if not isinstance(raw, dict):
    raise ConfigError(f"{key or 'config'}: expected a mapping, got {raw!r}")
  fields = {f.name: f for f in dataclasses.fields(cls)}
  hints = typing.get_type_hints(cls)
  for name in raw:
    if name not in fields:
      full = _join(key, name)
      near = difflib.get_close_matches(str(name), fields, n=1)
      hint = f"did you mean {_join(key, near[0])!r}? " if near else ""
      raise ConfigError(f"unknown key {full!r}; {hint}allowed: {', '.join(fields)}")
  values = {}
  for name, field in fields.items():
    if name in raw:
      values[name] = _convert(hints[name], raw[name], _join(key, name))
    elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
      raise ConfigError(f"{_join(key, name)}: required key is missing")
  return cls(**values)


def _convert(hint, value, key):
  origin, args = typing.get_origin(hint), typing.get_args(hint)
  if origin in (typing.Union, types.UnionType):
    if value is None and type(None) in args:
      return None
    (hint,) = [a for a in args if a is not type(None)]
    return _convert(hint, value, key)
  if dataclasses.is_dataclass(hint):
    return _build(hint, value, key)
  if origin is tuple:
    if not isinstance(value, (list, tuple)):
      raise ConfigError(f"{key}: expected a list, got {value!r}")
    return tuple(_convert(args[0], v, f"{key}.{i}") for i, v in enumerate(value))
  if origin is dict:
    if not isinstance(value, dict):
      raise ConfigError(f"{key}: expected a mapping, got {value!r}")
    return {str(k): _convert(args[1], v, f"{key}.{k}") for k, v in value.items()}
  if hint is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if hint is int and isinstance(value, float) and value.is_integer():
    return int(value)
  if hint is str and isinstance(value, (int, float)) and not isinstance(value, bool):
    return str(value)
  if not isinstance(value, hint) or (hint is not bool and isinstance(value, bool)):
    raise ConfigError(f"{key}: expected {hint.__name__}, got {value!r}")
  return value


def _join(key, name):
  return f"{key}.{name}" if key else str(name)


def _at_least(key, value, low):
  if value < low:
    raise ConfigError(f"{key}: expected an integer >= {low}, got {value}")


def _in_range(key, value, low, high):
  if not low <= value <= high:
    raise ConfigError(f"{key}: expected a number in [{low}, {high}], got {value}")

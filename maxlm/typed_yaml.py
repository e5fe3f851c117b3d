"""Typed YAML: a mapping checked against a frozen dataclass schema, with dotted overrides.

`build(cls, raw)` converts a parsed mapping into `cls`, naming the key of any unknown field
(with the closest allowed name), wrong type or missing value; `apply_override` sets
`a.b.0.c=value` in the raw mapping first. The schema itself lives in `maxlm.config`.
"""

import dataclasses
import difflib
import pathlib
import types
import typing

import yaml

from maxlm import MaxlmError, io


class ConfigError(MaxlmError):
  pass


def read_yaml(path):
  if not io.is_local(path):  # a gs:// run_dir's config.yaml
    text = io.read_bytes(path).decode()
  else:
    path = resolve_path(path)
    text = path.read_text()
  try:
    raw = yaml.safe_load(text)
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


def build(cls, raw, key=""):
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
    return build(hint, value, key)
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

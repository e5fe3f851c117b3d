"""Typed YAML: a mapping checked against a frozen dataclass schema, with dotted overrides.

`build(cls, raw)` converts a parsed mapping into `cls`, naming the key of any unknown field
(with the closest allowed name), wrong type or missing value; `apply_override` sets
`a.b.0.c=value` in the raw mapping first. The schema itself lives in `maxlm.config`.

Files and override values are read as YAML 1.2 floats (`1e-3`, `1E5`, `-.5` are numbers, which
YAML 1.1 leaves as strings), a key given twice is an error, and every float must be finite.
A number given to a str field keeps the text it was written as (`name: 1e3` is "1e3").
"""

import dataclasses
import difflib
import math
import pathlib
import re
import types
import typing

import yaml

from maxlm import MaxlmError, io


class ConfigError(MaxlmError):
  pass


_FLOAT = "tag:yaml.org,2002:float"


class Loader(yaml.SafeLoader):
  """SafeLoader with YAML 1.2 floats: an exponent needs no dot or sign (1e-3, 1E5), and a
  leading dot may carry a sign (-.5). YAML 1.1's forms (1.5, 1_000.5, .inf, .nan) stay, but
  not its base-60 numbers (1:30)."""


Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _FLOAT]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
Loader.add_implicit_resolver(_FLOAT, re.compile(r"""^(?:
    [-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
  | [-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
  | [-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
  | [-+]?\.(?:inf|Inf|INF)
  | \.(?:nan|NaN|NAN))$""", re.X), list("-+0123456789."))


_INT = "tag:yaml.org,2002:int"
Loader.yaml_implicit_resolvers = {  # YAML 1.2 integers: not 1.1's 010 (8), 1:30 (90), 0b1
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _INT]
    for first, resolvers in Loader.yaml_implicit_resolvers.items()}
Loader.add_implicit_resolver(
    _INT, re.compile(r"^(?:[-+]?(?:0|[1-9][0-9_]*)|0x[0-9a-fA-F]+|0o[0-7]+)$"),
    list("-+0123456789"))


class _Float(float):
  """A float that remembers how it was written (for str fields)."""


class _Int(int):
  """An int that remembers how it was written (for str fields)."""


def _as_written(kind, construct):
  def constructor(loader, node):
    value = kind(construct(loader, node))
    value.text = node.value
    return value
  return constructor


Loader.add_constructor(_FLOAT, _as_written(_Float, yaml.SafeLoader.construct_yaml_float))
Loader.add_constructor("tag:yaml.org,2002:int",
                       _as_written(_Int, yaml.SafeLoader.construct_yaml_int))


def parse(text):
  """(value, duplicate): the YAML document in `text`, and the first key given twice in one
  mapping as (dotted key, first line, second line), or None."""
  loader = Loader(text)
  try:
    node = loader.get_single_node()
    duplicate = _duplicate(node, "", set()) if node is not None else None
    return (loader.construct_document(node) if node is not None else None), duplicate
  finally:
    loader.dispose()


def _duplicate(node, key, seen):
  if id(node) in seen:  # an alias met again
    return None
  seen.add(id(node))
  if isinstance(node, yaml.MappingNode):
    lines = {}
    for k, v in node.value:
      name = _join(key, k.value) if isinstance(k, yaml.ScalarNode) else None
      if name is not None and k.value != "<<":
        if name in lines:
          return name, lines[name], k.start_mark.line + 1
        lines[name] = k.start_mark.line + 1
      found = _duplicate(v, name or key, seen)
      if found:
        return found
  elif isinstance(node, yaml.SequenceNode):
    for i, v in enumerate(node.value):
      found = _duplicate(v, _join(key, i), seen)
      if found:
        return found
  return None


def read_yaml(path):
  if not io.is_local(path):  # a gs:// run_dir's config.yaml
    data = io.read_bytes(path)
  else:
    path = resolve_path(path)
    try:
      data = path.read_bytes()
    except OSError as e:
      raise ConfigError(f"{path}: cannot be read ({e.strerror})") from None
  try:
    text = data.decode("utf-8-sig")
  except UnicodeDecodeError as e:
    raise ConfigError(f"{path}: not a UTF-8 text file (byte {e.start}); a config is YAML "
                      "text") from None
  try:
    raw, duplicate = parse(text)
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None)
    where = f" line {mark.line + 1}" if mark else ""
    raise ConfigError(f"{path}{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
  if duplicate:
    name, first, second = duplicate
    raise ConfigError(f"{path}: duplicate key {name!r} at lines {first} and {second}; "
                      "give each key once")
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
    value, duplicate = parse(text) if text else ("", None)
  except yaml.YAMLError:
    value, duplicate = text, None
  if duplicate:
    raise ConfigError(f"override {item!r}: duplicate key {_join(key, duplicate[0])!r}; "
                      "give each key once")
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
  _check_colons(key or "config", raw)
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
    _check_colons(key, value)
    return {_text(k): _convert(args[1], v, f"{key}.{_text(k)}") for k, v in value.items()}
  number = isinstance(value, (int, float)) and not isinstance(value, bool)
  if hint is float and number:
    try:
      value = float(value)
    except OverflowError:  # an int literal beyond a float's range
      value = math.inf
    if not math.isfinite(value):
      raise ConfigError(f"{key}: expected a finite number, got {value}")
    return value
  if hint is int and isinstance(value, float) and value.is_integer():
    return int(value)
  if hint is str and number:
    return _text(value)
  if not isinstance(value, hint) or (hint is not bool and isinstance(value, bool)):
    raise ConfigError(f"{key}: expected {hint.__name__}, got {_plain(value)!r}")
  return _plain(value)


def _check_colons(key, mapping):
  """`{web:0.5}` is YAML for the key 'web:0.5' with no value: said so, with the fix."""
  for k, v in mapping.items():
    name, colon, rest = _text(k).partition(":")
    if v is None and colon:
      raise ConfigError(f"{key}: {_text(k)!r} reads as one key without a value; YAML needs a "
                        f"space after the colon: {{{name}: {rest}}}")


def _text(value):
  """A value as its YAML text: a number as written (1e3, not 1000.0)."""
  return getattr(value, "text", None) or str(value)


def _plain(value):
  """int/float for the loader's _Int/_Float, so results dump as plain YAML."""
  if isinstance(value, _Int):
    return int(value)
  if isinstance(value, _Float):
    return float(value)
  return value


def _join(key, name):
  return f"{key}.{name}" if key else str(name)

"""The structure drawn from the imports: no module imports itself through others (a circle),
and each room imports only the floors below it, so the folders show the layering:

  maxlm/*.py (config, io, outputs, signals)  <  data/  <  model/  <  parallel/  <  eval/
  <  ckpt/  <  interop/  <  train/  <  the commands (cli*.py, demo.py), sweep/

Imports inside functions count too (they hid circles before). ckpt/ (the checkpoint format)
sits below interop/ and train/ because both read checkpoints: a run resuming, `maxlm export`
and init.from; train/ reads init.from's weights through interop/.
"""

import ast
import collections
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
FLOORS = ["data", "model", "parallel", "eval", "ckpt", "interop", "train"]  # bottom to top
COMMANDS = {"cli", "cli_data", "cli_run", "cli_memory", "demo"}


def _modules():
  out = {}
  for path in sorted((ROOT / "maxlm").rglob("*.py")):
    parts = path.relative_to(ROOT).with_suffix("").parts
    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return out


def _imports(modules):
  """{module: modules of maxlm it imports}, `from maxlm.a import b` naming the module a.b
  when b is one."""
  def owner(name):
    while name and name not in modules:
      name = name.rpartition(".")[0]
    return name
  edges = collections.defaultdict(set)
  for name, path in modules.items():
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                          + ([base] if base else []))
        targets = [f"{base}.{a.name}" for a in node.names]
      else:
        continue
      for target in targets:
        if target.startswith("maxlm"):
          edges[name].add(owner(target))
    edges[name].discard(name)
    edges[name].discard("")
  return edges


def _room(module):
  parts = module.split(".")
  if len(parts) == 1 or (len(parts) == 2 and parts[1] not in FLOORS + ["sweep"]):
    return "commands" if parts[-1] in COMMANDS else "base"
  return parts[1]


def _cycles(edges):
  """Strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in edges.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      group = []
      while not group or group[-1] != v:
        group.append(stack.pop())
        on.discard(group[-1])
      if len(group) > 1:
        found.append(sorted(group))
  for v in list(edges):
    if v not in index:
      visit(v)
  return found


def _upward(edges):
  rank = {"base": 0, **{room: i + 1 for i, room in enumerate(FLOORS)}}
  bad = []
  for a, targets in edges.items():
    for b in targets:
      ra, rb = _room(a), _room(b)
      if ra in rank and rb != ra and rank.get(rb, len(rank)) > rank[ra]:
        bad.append(f"{a} -> {b}")
  return sorted(bad)


def test_no_import_circle():
  assert _cycles(_imports(_modules())) == []


def test_no_room_imports_a_floor_above_it():
  assert _upward(_imports(_modules())) == []


def test_the_checks_see_a_circle_and_an_upward_arrow():
  edges = {"maxlm.model.a": {"maxlm.model.b"}, "maxlm.model.b": {"maxlm.model.a"},
           "maxlm.eval.c": {"maxlm.train.loop"}, "maxlm.data.d": {"maxlm.io"}}
  assert _cycles(edges) == [["maxlm.model.a", "maxlm.model.b"]]
  assert _upward(edges) == ["maxlm.eval.c -> maxlm.train.loop"]

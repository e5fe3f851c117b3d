"""docs/config.md, generated from the config dataclasses in `maxlm.config`.

Every field of every section becomes a table row: its key, its type (as annotated), its default
and its meaning, which is the comment on the field's line(s) in config.py (the range first, by
convention, then what it does), plus any comment lines right above it. Named model sizes come
from `MODEL_SIZES`. Nothing is listed by hand, so a new field appears once the page is
regenerated, and tests/test_config_doc.py fails while docs/config.md is stale:

  python -m maxlm.config_doc            # rewrite docs/config.md
  python -m maxlm.config_doc --check    # exit 1 if it is stale

Why not docstrings or `dataclasses.field(metadata=...)`: the range comment on each line is what
config.py already carries and what its reviewers read, so the page reads the same text.
"""

import ast
import dataclasses
import inspect
import io as io_lib
import os
import re
import sys
import tokenize
import typing

from maxlm import config as config_lib

DOC_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                        "config.md")

INTRO = """\
# Config reference

<!-- Generated from maxlm/config.py by `python -m maxlm.config_doc`; do not edit by hand.
     tests/test_config_doc.py fails when this page is stale. -->

A run is configured by one YAML file (`configs/`) plus dotted `key=value` overrides on the
command line, e.g. `maxlm train configs/demo.yaml train.lr=1e-3 stages.0.batch=8`. Every key
below is checked before any work: an unknown key, a value of the wrong type or one out of its
range is a one-line error naming the key (exit code 2). Ranges are inclusive unless written
`[a, b)`; every float must be finite.

## The defaults are for accelerators; demo.yaml is for a CPU

A key a config leaves out takes the default in this page. The defaults aim at a GPU or TPU
run, and `configs/demo.yaml` overrides the ones that are slow on a 2-core CPU:

| key | default | demo.yaml | why |
|---|---|---|---|
| `model.dtype` | `bfloat16` | `float32` | accelerators multiply bf16 at full rate; most CPUs have no fast bf16 matmul, so XLA converts the operands |
| `model.remat` | `full` | `none` | recomputing each layer in the backward pass saves accelerator memory at ~1/3 more compute; the demo model fits in memory without it |
| `stages.N.block_q`, `block_k` | `512` | `128` | 512-position attention tiles feed an accelerator's matrix units; on the CPU 128 is fastest (`tools/bench_train.py`) |
| `model.loss_chunk` | `1024` | `256` | positions per chunk of the vocabulary projection: the demo's stages are 128 to 1024 long |
| `model.size` | `tiny` | `demo` | the demo's width runs the CPU's matmuls near peak (see `MODEL_SIZES` in `maxlm/config.py`) |

So deleting a line from demo.yaml is not neutral: with these defaults back, the demo model's
train step at L = 1024 (batch 2) took 1.29x as long on a 2-core CPU, 0.222 s against 0.171 s
(`python tools/bench_demo_defaults.py`, both measured in one run). A run writes the config it
resolved, every default filled in, to `RUN_DIR/config.yaml`.
"""

BLURBS = {  # a few words after a section's key in its heading; sections are found by walking
    "": "Top level",  # the dataclasses, so a new one needs no entry here
    "data": "the token store and the data plan", "data.fim": "fill-in-the-middle",
    "model": "the network", "train": "optimizer, checkpoints, evaluation",
    "stages.N": "the length schedule, one entry per stage", "stages.N.rope": "RoPE scaling",
    "stages.N.mesh": "device mesh axis sizes", "init": "starting from other weights",
}


def sections(cls=config_lib.Config, prefix=""):
  """[(YAML prefix, dataclass)] of every section, depth first; a tuple of dataclasses (the
  stages) is a section keyed `name.N`."""
  out = [(prefix, cls)]
  hints = typing.get_type_hints(cls)
  for field in dataclasses.fields(cls):
    hint = hints[field.name]
    args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
      out += sections(hint, f"{prefix}{field.name}.")
    elif typing.get_origin(hint) is tuple and args and dataclasses.is_dataclass(args[0]):
      out += sections(args[0], f"{prefix}{field.name}.N.")
  return out


def field_comments(cls):
  """{field name: comment text} from the class's source: comments on the field's lines, after
  any full-line comments right above it."""
  source = inspect.getsource(cls)
  lines = source.splitlines()
  comments = {}
  for tok in tokenize.generate_tokens(io_lib.StringIO(source).readline):
    if tok.type == tokenize.COMMENT:
      comments[tok.start[0]] = tok.string.lstrip("#").strip()
  out = {}
  for node in ast.parse(source).body[0].body:
    if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
      continue
    above, line = [], node.lineno - 1
    while line >= 1 and lines[line - 1].strip().startswith("#"):
      above.insert(0, comments[line])
      line -= 1
    own = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
    out[node.target.id] = " ".join(above + own)
  return out


def _type(hint):
  """The YAML-facing type: "section", "list of sections", or the annotation (tuples as
  lists, since YAML has no tuples)."""
  args = typing.get_args(hint)
  if dataclasses.is_dataclass(hint):
    return "section"
  if typing.get_origin(hint) is tuple and args and dataclasses.is_dataclass(args[0]):
    return "list of sections"
  text = hint.__name__ if isinstance(hint, type) and not args else str(hint)
  text = text.replace("typing.", "")
  while True:  # tuple[X, ...] -> list[X], innermost first (X may hold brackets)
    new = re.sub(r"tuple\[([^\[\]]*(?:\[[^\[\]]*\])?[^\[\]]*), \.\.\.\]", r"list[\1]", text)
    if new == text:
      return text
    text = new


def _default(field):
  if field.default is not dataclasses.MISSING:
    value = field.default
  elif field.default_factory is not dataclasses.MISSING:
    value = field.default_factory()
  else:
    return "required"
  if dataclasses.is_dataclass(value):
    return "(section below)"
  return f"`{_yaml(value)}`"


def _yaml(value):
  if isinstance(value, bool):
    return "true" if value else "false"
  if value is None:
    return "null"
  if isinstance(value, str):
    return value if value else '""'
  if isinstance(value, (tuple, list)):
    return "[" + ", ".join(_yaml(v) for v in value) + "]"
  if isinstance(value, dict):
    return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
  return repr(value)


def _cell(text):
  return text.replace("|", "\\|")


def section(prefix, cls):
  comments = field_comments(cls)
  key = prefix.rstrip(".")
  blurb = BLURBS.get(key, "")
  heading = blurb if not key else f"`{key}`" + (f": {blurb}" if blurb else "")
  rows = [f"## {heading}", "", "| key | type | default | range and meaning |", "|---|---|---|---|"]
  hints = typing.get_type_hints(cls)
  for field in dataclasses.fields(cls):
    kind = _type(hints[field.name])
    if kind == "section":
      meaning = f"see `{prefix}{field.name}` below"
    elif kind == "list of sections":
      meaning = f"see `{prefix}{field.name}.N` below"
    else:
      meaning = comments.get(field.name, "")
    default = _default(field)
    if field.name == "rules":  # a long mapping: listed in its own section
      default, meaning = "(section below)", meaning or "logical axis -> mesh axes"
    name = config_lib.yaml_name(field.name)
    rows.append(f"| `{prefix}{name}` | `{_cell(kind)}` | {_cell(default)} | "
                f"{_cell(meaning)} |")
  return "\n".join(rows)


def sizes_section():
  keys = list(next(iter(config_lib.MODEL_SIZES.values())))
  rows = ["## Named model sizes (`model.size`)", "",
          "A size fills in the model keys a config does not set; keys set explicitly win.", "",
          "| size | " + " | ".join(f"`{k}`" for k in keys) + " |",
          "|---|" + "---|" * len(keys)]
  for name, dims in config_lib.MODEL_SIZES.items():
    rows.append(f"| `{name}` | " + " | ".join(str(dims.get(k, "")) for k in keys) + " |")
  return "\n".join(rows)


def rules_section():
  rows = ["## `rules`: logical axes to mesh axes", "",
          f"Mesh axes: {', '.join(f'`{a}`' for a in config_lib.MESH_AXES)}. A logical axis of a "
          "parameter or activation (`act_*`) is split over the mesh axes listed; `[]` "
          "replicates it. Set one with e.g. `rules.mlp=[tensor]`.", "",
          "| logical axis | default mesh axes |", "|---|---|"]
  for name, axes in config_lib.DEFAULT_RULES.items():
    rows.append(f"| `{name}` | `{_yaml(list(axes))}` |")
  return "\n".join(rows)


def choices_section():
  return "\n".join([
      "## Choices", "",
      f"- `model.remat`: {', '.join(f'`{p}`' for p in config_lib.REMAT_POLICIES)}",
      f"- `stages.N.attention`: {', '.join(f'`{a}`' for a in config_lib.ATTENTION_IMPLS)}"])


def retired_section():
  rows = ["## Retired keys", "",
          "Old configs that set one still load: it is ignored, with a warning.", ""]
  rows += [f"- `{part}.{name}`: {why}" for (part, name), why in config_lib.RETIRED.items()]
  return "\n".join(rows)


def render():
  parts = [INTRO.rstrip("\n")]
  parts += [section(prefix, cls) for prefix, cls in sections()]
  parts += [sizes_section(), choices_section(), rules_section(), retired_section()]
  return "\n\n".join(parts) + "\n"


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  text = render()
  if argv == ["--check"]:
    with open(DOC_PATH) as f:
      if f.read() != text:
        print(f"{DOC_PATH} is stale: run python -m maxlm.config_doc", file=sys.stderr)
        return 1
    return 0
  if argv:
    print("usage: python -m maxlm.config_doc [--check]", file=sys.stderr)
    return 2
  with open(DOC_PATH, "w") as f:
    f.write(text)
  print(f"wrote {DOC_PATH}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

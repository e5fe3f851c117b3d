"""docs/config.md is generated from maxlm/config.py and must match it."""

import dataclasses
import re
import typing

from maxlm import config as config_lib, config_doc


def test_config_md_is_current():
  with open(config_doc.DOC_PATH) as f:
    assert f.read() == config_doc.render(), (
        "docs/config.md is stale: run `python -m maxlm.config_doc`")
  assert config_doc.main(["--check"]) == 0


def test_every_key_is_documented_with_a_meaning():
  text = config_doc.render()
  keys = []
  for prefix, cls in config_doc.sections():
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
      keys.append(prefix + config_lib.yaml_name(field.name))
      row = re.search(rf"^\| `{re.escape(keys[-1])}` \| .*$", text, re.M)
      assert row, f"{prefix}{field.name} is missing from docs/config.md"
      meaning = row.group(0).rstrip(" |").rsplit(" | ", 1)[1]
      assert meaning.strip(), (f"{prefix}{field.name} has no comment in maxlm/config.py saying "
                               f"what it is ({hints[field.name]})")
  for key in ("stages.N.rope.scaling", "data.fim.rate", "train.eval_tokens", "model.remat"):
    assert key in keys
  assert all(f"| `{size}` |" in text for size in config_lib.MODEL_SIZES)


def test_comments_and_defaults_come_from_the_source():
  comments = config_doc.field_comments(config_lib.DataConfig)
  assert comments["overlap"].startswith(">= 0; tokens of a cut document")
  text = config_doc.render()
  assert "| `model.dtype` | `str` | `bfloat16` |" in text
  assert "| `stages.N.seq_len` | `int` | required |" in text
  assert "| `data.fim.sources` | `list[str]` | `[]` |" in text

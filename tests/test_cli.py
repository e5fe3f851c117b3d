import json
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml

from maxlm import cli

import datagen
from datagen import QUALITY_OFF


def maxlm(*args):
  return subprocess.run([sys.executable, "-m", "maxlm.cli", *map(str, args)], capture_output=True,
                        text=True)


@pytest.fixture(scope="module")
def cfg_path(tmp_path_factory):
  root = tmp_path_factory.mktemp("cli")
  lengths = np.random.default_rng(0).integers(1, 150, 120)
  data_dir = datagen.write_data_dir(root / "data", datagen.make_docs(
      lengths, ["a" if i % 2 else "b" for i in range(len(lengths))]))
  path = root / "cfg.yaml"
  path.write_text(yaml.safe_dump({
      "data": {"dir": data_dir, "mix": {"a": 1, "b": 1}, "overlap": 4, "shuffle_rows": 2,
               "block_rows": 8},
      "stages": [{"seq_len": 32, "batch": 4, "steps": 6}, {"seq_len": 64, "batch": 2, "steps": 4}]}))
  return path


def test_ledger_json_totals_match_batches(cfg_path, tmp_path):
  proc = maxlm("ledger", cfg_path, "--json")
  assert proc.returncode == 0, proc.stderr
  led = json.loads(proc.stdout)
  out = tmp_path / "b.npz"
  assert maxlm("batches", cfg_path, "--stage", 1, "--step", 0, "--count", 4, "--out",
               out).returncode == 0
  with np.load(out) as z:
    assert z["inputs"].shape == (4, 2, 64) and z["inputs"].dtype == np.int32
    st = led["stages"][1]
    assert sum(e["loss"] for e in st["sources"].values()) == z["loss_mask"].sum()
    assert st["padding"] == (z["segment_ids"] == 0).sum()
    prov = json.loads(str(z["provenance"]))
    assert len(prov) == 4 and len(prov[0]) == 2
    assert set(prov[0][0][0]) == {"source", "doc_id", "start", "end", "context", "fim"}
  table = maxlm("ledger", cfg_path)
  assert "(padding)" in table.stdout and table.returncode == 0
  assert "attention per stage (docs/schedule.md): 0 dense; 1 dense" in table.stdout
  warm = maxlm("ledger", cfg_path, "stages.1.sparse.mode=indexer_warmup", "--json")
  assert warm.returncode == 0, warm.stderr
  modes = [st["attention"] for st in json.loads(warm.stdout)["stages"]]
  assert modes == ["dense", "dense, indexer 4x64 warming up (main model frozen)"]
  left = maxlm("ledger", cfg_path, "data.mix={a: 1}", "stages.1.mix={a: 1}", "--json")
  assert json.loads(left.stdout)["not_trained"] == ["b"]
  assert "warning: no stage's mix names source 'b'" in maxlm("ledger", cfg_path,
                                                             "data.mix={a: 1}").stdout
  assert json.loads(maxlm("ledger", cfg_path, "stages.1.mix={a: 1}", "--json").stdout)[
      "not_trained"] == []  # stage 0 trains on b


def test_batches_host_slices_and_errors(cfg_path, tmp_path):
  whole, half = tmp_path / "w.npz", tmp_path / "h.npz"
  assert maxlm("batches", cfg_path, "--step", 2, "--count", 2, "--out", whole).returncode == 0
  assert maxlm("batches", cfg_path, "--step", 2, "--count", 2, "--hosts", 2, "--host-index", 1,
               "--out", half).returncode == 0
  with np.load(whole) as w, np.load(half) as h:
    assert np.array_equal(w["inputs"][:, 2:], h["inputs"])
  bad = maxlm("batches", cfg_path, "--step", 99, "--out", whole)
  assert bad.returncode == 2 and "stage 0 has steps 0..5" in bad.stderr
  bad = maxlm("batches", cfg_path, "--hosts", 3, "--out", whole)
  assert bad.returncode == 2 and "not divisible by 3 hosts" in bad.stderr
  bad = maxlm("ledger", cfg_path, "data.mix.c=1")
  assert bad.returncode == 2 and "unknown source 'c'" in bad.stderr
  bad = maxlm("ledger", cfg_path, "data.dir=/nonexistent")
  assert bad.returncode == 2 and "run `maxlm prepare" in bad.stderr


def test_show_batch_writes_png(cfg_path, tmp_path):
  out = tmp_path / "row.png"
  proc = maxlm("show-batch", cfg_path, "--stage", 1, "--out", out)
  assert proc.returncode == 0, proc.stderr
  assert out.read_bytes()[:4] == b"\x89PNG"


def test_prepare_cli(tmp_path):
  src = tmp_path / "in.jsonl"
  src.write_text("\n".join(json.dumps({"id": f"d{i}", "text": f"Document {i} says hello. " * 20})
                           for i in range(30)) + "\n{broken\n")
  proc = maxlm("prepare", src, "--out", tmp_path / "data", "--vocab-size", 320, *QUALITY_OFF)
  assert proc.returncode == 0, proc.stderr
  assert "malformed_json': 1" in proc.stdout
  manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
  assert manifest["sources"]["in"]["documents"] == 30


def _subcommands():
  import argparse
  from maxlm import cli
  ap = cli._parser()
  sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
  return sub.choices


def test_every_option_has_help_and_shows_its_default():
  import argparse
  for name, parser in _subcommands().items():
    assert parser.description, f"maxlm {name} has no description"
    assert "usage: maxlm " + name in parser.format_help()  # a stray % in a help would raise
    formatter = parser._get_formatter()
    for action in parser._actions:
      if isinstance(action, argparse._HelpAction):
        continue
      what = f"maxlm {name} {'/'.join(action.option_strings) or action.dest}"
      assert action.help, f"{what}: no help text"
      if action.option_strings and action.default not in (None, False, [], argparse.SUPPRESS):
        assert "default" in formatter._get_help_string(action) % {"default": action.default}, (
            f"{what}: --help does not show its default {action.default!r}")
  shown = maxlm("prepare", "--help").stdout
  assert "(default: 8192)" in shown and "(default: 0.01)" in shown


def test_readme_lists_every_command_and_option():
  """Each subcommand has a `maxlm NAME` line in README.md's command list (continuations
  joined) naming every one of its long options."""
  import pathlib
  import re
  text = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
  block = re.search(r"^## Commands\n+```bash\n(.*?)^```", text, re.S | re.M).group(1)
  entries = {}
  for line in block.replace("\\\n", " ").splitlines():
    words = line.split()
    if words[:1] == ["maxlm"]:
      entries[words[1]] = entries.get(words[1], "") + " " + line.split("  #")[0]
  for name, parser in _subcommands().items():
    assert name in entries, f"README.md's command list has no `maxlm {name}` line"
    for action in parser._actions:
      for option in action.option_strings:
        if option.startswith("--") and option != "--help":
          assert re.search(rf"{re.escape(option)}\b", entries[name]), (
              f"README.md's `maxlm {name}` line does not mention {option}")


def test_the_compile_cache_is_bounded_and_locked_for_processes_sharing_it(tmp_path):
  code = ("from maxlm import cli; cli.enable_compile_cache(); import jax; "
          "print(jax.config.jax_compilation_cache_dir, jax.config.jax_compilation_cache_max_size)")
  env = {**os.environ, "MAXLM_COMPILE_CACHE": str(tmp_path / "cache")}
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       check=True).stdout.split()
  assert out == [str(tmp_path / "cache"), str(cli.COMPILE_CACHE_BYTES)]  # a bound: a file lock
  env["MAXLM_COMPILE_CACHE"] = "off"
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       check=True).stdout.split()
  assert out[0] == "None"

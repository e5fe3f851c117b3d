"""`maxlm config DATA_DIR` (maxlm/data/starter.py): a starting config that trains on every source of
the data, FIM on code, stages sized to the data; and its refusals."""

import json

import numpy as np
import pytest
import yaml

from maxlm import config as config_lib
from maxlm.data import starter

import datagen
import realtext
import smallrun


@pytest.fixture(scope="module")
def own_data(tmp_path_factory):
  """A user's own files, prepared with the default quality steps: Python source as JSON Lines
  named by `path` (code by the path's suffix) and hard-wrapped docs as .txt files (prose)."""
  root = tmp_path_factory.mktemp("own")
  (root / "docs").mkdir()
  for name, text in realtext.pydoc_topics(30):
    (root / "docs" / f"{name}.txt").write_text(text)
  with open(root / "pysrc.jsonl", "w") as f:
    for i, text in enumerate(realtext.python_sources(30)):
      f.write(json.dumps({"path": f"lib/m{i}.py", "text": text}) + "\n")
  proc = smallrun.maxlm("prepare", root / "docs", root / "pysrc.jsonl", "--out", root / "data",
                        "--vocab-size", 600, "--workers", 1)
  assert proc.returncode == 0, proc.stderr
  return root / "data"


def test_every_source_is_mixed_by_tokens_and_fim_goes_to_code(own_data, tmp_path, here):
  out = tmp_path / "mine.yaml"
  proc = here("config", own_data, "--out", out, "--seq-len", "128,512", "--epochs", "0.5")
  assert proc.returncode == 0, proc.stderr
  cfg = config_lib.load(str(out))
  manifest = json.loads((own_data / "manifest.json").read_text())
  train = {n: s["tokens"] - s["heldout_tokens"] for n, s in manifest["sources"].items()}
  assert set(cfg.data.mix) == set(train) == {"docs", "pysrc"}
  for name, share in cfg.data.mix.items():
    assert abs(share - train[name] / sum(train.values())) < 1e-3
  assert cfg.data.fim.sources == ("pysrc",) and cfg.data.fim.rate > 0
  assert [s.seq_len for s in cfg.stages] == [128, 512]
  assert [s.seq_len * s.batch for s in cfg.stages] == [4096, 4096]
  budget = sum(s.tokens for s in cfg.stages)
  assert abs(budget - 0.5 * sum(train.values())) <= 2 * 4096
  assert cfg.run_dir == f"runs/{own_data.parent.name}"
  led = here("ledger", out, "--json")
  assert led.returncode == 0, led.stderr
  led = json.loads(led.stdout)
  assert led["not_trained"] == [] and set(led["stages"][0]["sources"]) == {"docs", "pysrc"}
  again = here("config", own_data, "--out", out)
  assert again.returncode == 2 and "exists; pass --overwrite" in again.stderr
  equal = here("config", own_data, "--mix", "equal")
  assert yaml.safe_load(equal.stdout)["data"]["mix"] == {"docs": 1.0, "pysrc": 1.0}


def test_odd_source_names_read_back_and_code_needs_the_funnel(tmp_path, monkeypatch):
  names = ["yes", "two words", "123", "emoji😀", "null"]
  lengths = np.full(40, 30)
  monkeypatch.chdir(tmp_path)
  data_dir = datagen.write_data_dir(tmp_path / "runs" / "line\nbreak", datagen.make_docs(
      lengths, [names[i % 5] for i in range(40)]))
  text = starter.text(data_dir, starter.Options(seq_lens=(128,)))
  cfg = config_lib.from_dict(yaml.safe_load(text))
  assert sorted(cfg.data.mix) == sorted(names) and cfg.data.dir == data_dir
  assert cfg.run_dir == "runs/line\nbreak-run"  # runs/NAME would be the data dir itself
  assert cfg.data.fim.rate == 0  # no funnel counted kinds: no source is known to be code
  assert "no fill-in-the-middle" in text


def test_refusals_are_one_line(demo_data, tmp_path, here):
  for args, words in ((["--seq-len", "100"], "multiple of 128"),
                      (["--seq-len", "1024,256"], "growing lengths"),
                      (["--seq-len", "lots"], "expected integers separated by commas"),
                      (["--epochs", "0"], "--epochs must be a number in (0, 1e6)"),
                      (["--epochs", "inf"], "--epochs must be a number in (0, 1e6)"),
                      (["--run-dir", str(demo_data / "run")], "inside the data dir"),
                      (["--out", str(tmp_path / "c.txt")], "ending in .yaml"),
                      (["--out", str(demo_data / "c.yaml")], "inside the data dir")):
    proc = here("config", demo_data, *args)
    assert proc.returncode == 2 and words in proc.stderr, (args, proc.stderr)
    assert proc.stderr.count("\n") == 1
  missing = here("config", tmp_path / "nowhere")
  assert missing.returncode == 2 and "maxlm prepare" in missing.stderr

"""Which files `maxlm prepare` reads: folders become sources, --as-text reads files it would
skip, and skipped files are listed by name (manifest and printout)."""

import json
import os
import subprocess
import sys

import pytest

from maxlm import MaxlmError
from maxlm.data import documents, prepare, store, walk

from datagen import QUALITY_OFF

import numpy as np

_WORDS = ["".join(np.random.default_rng(i).choice(list("abcdefghijklmnopqrstuvwxyz"), 2 + i % 7))
          for i in range(400)]
LICENSE = " ".join(_WORDS) + ". Permission is hereby granted, free of charge."


@pytest.fixture
def corpus(tmp_path):
  root = tmp_path / "corpus"
  (root / "licenses" / "old").mkdir(parents=True)
  (root / "notes").mkdir()
  for name in ("MIT", "Apache-2.0", "BSD.html"):
    (root / "licenses" / name).write_text(f"{name}: {LICENSE}")
  (root / "licenses" / "old" / "GPL-2").write_text(f"GPL-2: {LICENSE}")
  (root / "notes" / "a.md").write_text("# Notes\n\n" + "Some prose about packing. " * 20 + " ".join(_WORDS[::-1]))
  (root / "notes" / "page.1").write_text(".TH PAGE 1\n" + "A man page in roff text. " * 20)
  (root / "notes" / "blob.bin").write_bytes(bytes(range(256)) * 4)
  return root


def _prepare(corpus, out, **kw):
  return prepare.prepare([str(corpus / "licenses"), str(corpus / "notes")], str(out),
                         prepare.Options(vocab_size=320, val_fraction=0.0, workers=1,
                                         progress=False, **kw))


def test_skipped_files_are_listed_by_name(corpus, tmp_path):
  manifest = _prepare(corpus, tmp_path / "data")
  assert manifest["sources"]["notes"]["documents"] == 1  # a.md only
  assert "licenses" not in manifest["sources"]  # nothing in it has a suffix prepare reads
  assert manifest["skipped_files"] == {"(none)": 2, ".0": 1, ".html": 1, ".1": 1, ".bin": 1}
  examples = manifest["skipped_file_examples"]
  assert examples["(none)"] == [str(corpus / "licenses" / "MIT"),
                                str(corpus / "licenses" / "old" / "GPL-2")]
  assert examples[".bin"] == [str(corpus / "notes" / "blob.bin")]
  assert manifest["as_text"] == []


def test_as_text_reads_matching_files_into_their_folder_source(corpus, tmp_path):
  manifest = _prepare(corpus, tmp_path / "data", as_text=["licenses/*", "*.1"])
  assert manifest["sources"]["licenses"]["documents"] == 4  # subfolders join their input's source
  assert manifest["sources"]["notes"]["documents"] == 2  # a.md and page.1
  assert manifest["skipped_files"] == {".bin": 1} and manifest["as_text"] == ["licenses/*", "*.1"]
  ids = set(store.load_doc_ids(str(tmp_path / "data")))
  assert str(corpus / "licenses" / "old" / "GPL-2") in ids
  everything = _prepare(corpus, tmp_path / "all", as_text=["*"])
  assert everything["skipped_files"] == {}  # the binary file is read, and rejected as such
  assert everything["rejected"]["non_utf8"] == 1


def test_text_glob_matches_the_name_or_the_end_of_the_path():
  match = documents.text_glob
  assert match("/x/licenses/MIT", ["MIT"]) and match("/x/licenses/MIT", ["licenses/*"])
  assert match("/x/licenses/old/GPL-2", ["licenses/*"])  # * crosses folders, like a path tail
  assert not match("/x/notes/MIT", ["licenses/*"]) and not match("/x/a/LICENSE-2", ["license*"])
  assert match("/x/a/LICENSE-2", ["LICENSE*"]) and match("/x/a/page.1", ["*.1"])


def test_prepare_prints_skipped_names_and_the_flag(corpus, tmp_path):
  proc = subprocess.run([sys.executable, "-m", "maxlm.cli", "prepare", str(corpus / "licenses"),
                         str(corpus / "notes"), "--out", str(tmp_path / "data"),
                         "--vocab-size", "320", *QUALITY_OFF], capture_output=True, text=True)
  assert proc.returncode == 0, proc.stderr
  assert f"not read (.0, 1): {corpus / 'licenses' / 'Apache-2.0'}\n" in proc.stdout
  assert f"not read ((none), 2): {corpus / 'licenses' / 'MIT'}, " in proc.stdout
  assert "--as-text GLOB reads matching files as text" in proc.stdout
  manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
  assert manifest["skipped_files"][".html"] == 1


def test_only_unreadable_kinds_is_an_error_naming_them(corpus, tmp_path):
  with pytest.raises(MaxlmError, match=r"skipped files: \{.*'\(none\)': 2.*\}\); --as-text GLOB"):
    prepare.prepare([str(corpus / "licenses")], str(tmp_path / "data"),
                    prepare.Options(vocab_size=320, progress=False))


def test_cluster_records_carry_the_as_text_globs(corpus, tmp_path):
  from maxlm.data import quality
  from maxlm.data.quality import engine
  config = quality.load(None, ["lang=[any]", "filters=False"])
  inputs, globs = [str(corpus / "licenses"), str(corpus / "notes")], ["licenses/*", "*.1"]
  local = _prepare(corpus, tmp_path / "local", as_text=globs, quality=config)
  work = str(tmp_path / "work")
  for rank in (1, 0):
    list(engine.inspect_shard(inputs, quality.Inspector(config), work, rank=rank, world_size=2,
                              as_text=tuple(globs)))
  merged = _prepare(corpus, tmp_path / "merged", as_text=globs, quality=config,
                    engine="datatrove", tasks=2, inspect_dir=work)
  assert merged["fingerprint"] == local["fingerprint"]
  assert merged["sources"] == local["sources"] and "licenses" in merged["sources"]
  with pytest.raises(MaxlmError, match=r"other quality settings \(or --as-text\)"):
    _prepare(corpus, tmp_path / "without", quality=config, engine="datatrove", tasks=2,
             inspect_dir=work)


def test_datatrove_tasks_read_the_as_text_files_too(corpus, tmp_path):
  pytest.importorskip("datatrove.executor", reason="datatrove (the cluster extra) is not "
                      "installed")
  from maxlm.data import quality
  config = quality.load(None, ["lang=[any]", "filters=False"])
  globs = ["licenses/*", "*.1"]
  local = _prepare(corpus, tmp_path / "local", as_text=globs, quality=config)
  tasks = _prepare(corpus, tmp_path / "tasks", as_text=globs, quality=config,
                   engine="datatrove", tasks=2)
  assert tasks["fingerprint"] == local["fingerprint"]


def test_iter_files_order_sources_and_skip_counts(tmp_path):
  """walk.iter_files directly: name order depth first, each file once, every skip counted."""
  root = tmp_path / "corpus"
  for rel in ("b.txt", "a/z.md", "a/y.txt", "a/notes.bin", ".hidden/x.txt", ".git/HEAD.txt",
              "README"):
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text("text\n")
  (root / "a" / "loop").symlink_to(root / "a")
  (root / "again.txt").symlink_to(root / "b.txt")
  (root / "gone.txt").symlink_to(root / "missing.txt")
  single = tmp_path / "one.dat"
  single.write_text("text\n")
  report = documents.Report(verbose=True)
  kind_of = lambda path: "text" if path.endswith((".txt", ".md")) else None
  got = [(os.path.relpath(p, tmp_path), shown == p, source)
         for p, shown, source in walk.iter_files([root, single, root / "b.txt"], report, kind_of)]
  # again.txt (a link to b.txt) comes first in name order, so b.txt is the one already seen
  assert got == [("corpus/a/y.txt", True, "corpus"), ("corpus/a/z.md", True, "corpus"),
                 ("corpus/again.txt", True, "corpus"), ("one.dat", True, "one")]
  assert {r: n for r, n in report.skipped.items() if n} == {
      "vcs": 1, "hidden": 1, "symlink_loop": 1, "already_seen": 2, "dangling_link": 1}
  assert dict(report.skipped_files) == {".bin": 1, "(none)": 1}
  with pytest.raises(MaxlmError, match="input not found: .*nothing"):
    walk.check_inputs([root, tmp_path / "nothing"])

"""Data dirs are written whole or not at all, carry a file list and fingerprint, and are refused
when their files do not match it (local folders and object stores alike)."""

import hashlib
import json
import subprocess
import sys

import pytest

from maxlm import MaxlmError, io
from maxlm.data import datadir, index_files, loader, prepare, store, tokenizer

import datagen
from datagen import QUALITY_OFF


def write_corpus(path, word, n=12):
  path.write_text("\n".join(json.dumps({"id": f"{word}-{i}", "text": f"The {word} number {i}. " * 6})
                            for i in range(n)) + "\n")
  return str(path)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  path = tmp_path_factory.mktemp("tok") / "t.model"
  path.write_bytes(tokenizer.train([f"The old new word number {i}. " * 4 for i in range(50)], 300,
                                   num_threads=1))
  return str(path)


def run(inputs, out, tok, **kw):
  return prepare.prepare(inputs, str(out),
                         prepare.Options(tokenizer_file=tok, workers=1, progress=False, **kw))


def first_text(data_dir, tok):
  sp = tokenizer.load(open(tok, "rb").read())
  return sp.decode(store.TokenStore(str(data_dir)).document(0).tolist())


def open_data(data_dir):
  return loader.Data(datagen.make_config([{"seq_len": 32, "batch": 2, "steps": 2}],
                                         {"dir": str(data_dir)}))


def test_failed_overwrite_leaves_the_old_data_dir_intact(tmp_path, tok, monkeypatch):
  out = tmp_path / "data"
  run([write_corpus(tmp_path / "old.jsonl", "old")], out, tok)
  before = {p.name: p.read_bytes() for p in out.iterdir()}
  new = write_corpus(tmp_path / "new.jsonl", "new", 30)

  def fail(self):  # the token shards are written by now; the index is not
    raise OSError("disk full")
  monkeypatch.setattr(store.DocIndex, "arrays", fail)
  with pytest.raises(OSError, match="disk full"):
    run([new], out, tok, overwrite=True)
  assert {p.name: p.read_bytes() for p in out.iterdir()} == before
  assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "new.jsonl", "old.jsonl"]
  assert open_data(out).manifest["files"]
  assert first_text(out, tok).startswith("The old number 0.")

  monkeypatch.undo()
  manifest = run([new], out, tok, overwrite=True)
  assert manifest["sources"]["new"]["documents"] == 30
  assert first_text(out, tok).startswith("The new number 0.")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "new.jsonl", "old.jsonl"]


def test_existing_out_needs_overwrite_and_must_be_a_data_dir(tmp_path, tok):
  src = write_corpus(tmp_path / "a.jsonl", "old")
  out = tmp_path / "data"
  run([src], out, tok)
  with pytest.raises(MaxlmError, match="already holds files; pass --overwrite"):
    run([src], out, tok)
  folder = tmp_path / "mine"
  folder.mkdir()
  (folder / "thesis.tex").write_text("precious")
  with pytest.raises(MaxlmError, match="'thesis.tex'.*not part of a data dir"):
    run([src], folder, tok, overwrite=True)
  assert (folder / "thesis.tex").read_text() == "precious"
  (tmp_path / "empty").mkdir()
  run([src], tmp_path / "empty", tok)  # an empty folder is fine without --overwrite


def test_stale_partial_sibling_is_removed_and_said(tmp_path, tok, capsys):
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  stale = tmp_path / f"data.partial-{dead.pid}"
  (stale / "sub").mkdir(parents=True)
  (stale / "tokens-00000.bin").write_bytes(b"x" * 8)
  live = tmp_path / "data.partial-1"  # pid 1 is alive: another prepare's, left alone
  live.mkdir()
  run([write_corpus(tmp_path / "a.jsonl", "old")], tmp_path / "data", tok)
  assert not stale.exists() and live.exists()
  assert f"removed {stale}" in capsys.readouterr().out


def test_manifest_lists_files_and_fingerprint_names_the_data(tmp_path, tok):
  src = write_corpus(tmp_path / "a.jsonl", "old")
  m1 = run([src], tmp_path / "d1", tok)
  m2 = run([src], tmp_path / "d2", tok)
  names = sorted(p.name for p in (tmp_path / "d1").iterdir())
  assert sorted(m1["files"]) == [n for n in names if n != "manifest.json"]
  pairs = []
  for name, entry in sorted(m1["files"].items()):
    data = (tmp_path / "d1" / name).read_bytes()
    blocks = ({"block_bytes": datadir.BLOCK_BYTES,
               "xxh3_64_blocks": datadir.block_digests(data)} if name.startswith("tokens-") else {})
    assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), **blocks}
    pairs.append(f"{name}\0{entry['sha256']}\n")
  assert store.fingerprint(m1) == hashlib.sha256("".join(pairs).encode()).hexdigest()
  assert store.fingerprint(m1) == store.fingerprint(m2)
  assert json.loads((tmp_path / "d1" / "manifest.json").read_text()) == m1
  m3 = run([write_corpus(tmp_path / "b.jsonl", "new")], tmp_path / "d3", tok)
  assert store.fingerprint(m3) != store.fingerprint(m1)
  assert store.fingerprint({"sources": {}}) is None


@pytest.mark.parametrize("root", ["local", "memory://bucket/dd"])
def test_open_refuses_files_that_do_not_match_the_manifest(tmp_path, root):
  root = str(tmp_path / "d") if root == "local" else root
  docs = datagen.make_docs([40, 7, 90], seed=1)
  datagen.write_data_dir(root, docs)
  assert open_data(root).manifest["fingerprint"]
  shard = io.join(root, "tokens-00000.bin")
  good = io.read_bytes(shard)
  io.write_bytes(shard, good[:-4])
  with pytest.raises(MaxlmError, match=r"tokens-00000.bin has 544 bytes, expected 548; "
                                       r"re-run maxlm prepare"):
    open_data(root)
  io.write_bytes(shard, good + b"\0" * 4)
  with pytest.raises(MaxlmError, match=r"tokens-00000.bin has (552|more than 548) bytes, "
                                       "expected 548"):
    open_data(root)
  io.write_bytes(shard, good)
  io.delete(io.join(root, "doc_ids.bin"))
  with pytest.raises(MaxlmError, match=r"doc_ids.bin is missing, expected \d+ bytes"):
    open_data(root)
  io.delete(io.join(root, "manifest.json"))
  with pytest.raises(MaxlmError, match="has no manifest.json.*--overwrite"):
    open_data(root)


def test_open_refuses_a_manifest_without_a_file_list(tmp_path):
  root = datagen.write_data_dir(tmp_path / "d", datagen.make_docs([10]))
  path = tmp_path / "d" / "manifest.json"
  manifest = json.loads(path.read_text())
  del manifest["files"], manifest["fingerprint"]
  path.write_text(json.dumps(manifest))
  with pytest.raises(MaxlmError, match="lists no files .*older maxlm prepare"):
    open_data(root)
  path.write_text("{trunc")
  with pytest.raises(MaxlmError, match="manifest.json is not valid JSON"):
    open_data(root)


def test_object_store_overwrite_replaces_files_and_a_failure_is_refused(tmp_path, tok,
                                                                        monkeypatch):
  out = "memory://bucket/prep"
  src = write_corpus(tmp_path / "a.jsonl", "old", 40)
  monkeypatch.setattr(store, "SHARD_TOKENS", 64)  # several shards
  many = run([src], out, tok)
  assert "tokens-00002.bin" in many["files"]
  monkeypatch.undo()
  with pytest.raises(MaxlmError, match="already holds files"):
    run([src], out, tok)
  one = run([write_corpus(tmp_path / "b.jsonl", "new")], out, tok, overwrite=True)
  assert sorted(one["files"]) == sorted(
      ["doc_ids.bin", "index.json", "removed.jsonl", "tokenizer.model", "tokens-00000.bin"]
      + [index_files.file_name(f)
         for f in index_files.FIELDS + index_files.OPTIONAL + (index_files.ID_PTR,)])
  assert not io.exists(io.join(out, "tokens-00002.bin"))
  assert open_data(out).manifest == one
  monkeypatch.setattr(store.DocIndex, "arrays", lambda self: 1 / 0)
  with pytest.raises(ZeroDivisionError):
    run([src], out, tok, overwrite=True)
  with pytest.raises(MaxlmError, match="has no manifest.json"):
    open_data(out)


def test_one_prepare_per_out_at_a_time(tmp_path):
  from maxlm.data import datadir
  first = datadir.Staging(str(tmp_path / "out"))
  with pytest.raises(MaxlmError, match=r"another maxlm prepare \(pid \d+\) is writing --out"):
    datadir.Staging(str(tmp_path / "out"))
  first.abort()
  datadir.Staging(str(tmp_path / "out")).abort()  # released: the next one may start


def test_check_data_finds_a_same_size_change_the_open_check_cannot(tmp_path):
  root = str(tmp_path / "d")
  datagen.write_data_dir(root, datagen.make_docs([40, 7, 90], seed=1))
  maxlm = [sys.executable, "-m", "maxlm.cli", "check-data", root]
  ok = subprocess.run(maxlm, capture_output=True, text=True)
  n = len(json.loads((tmp_path / "d" / "manifest.json").read_text())["files"])
  assert ok.returncode == 0 and f"all {n} files match manifest.json" in ok.stdout, ok.stderr
  shard = tmp_path / "d" / "tokens-00000.bin"
  data = bytearray(shard.read_bytes())
  data[100] ^= 0xFF
  shard.write_bytes(bytes(data))
  open_data(root)  # the cheap check at open passes: same size
  bad = subprocess.run(maxlm, capture_output=True, text=True)
  assert bad.returncode == 2 and bad.stderr.count("\n") == 1
  assert (f"1 of {n} files differ from their SHA-256 in manifest.json (tokens-00000.bin)"
          in bad.stderr)


def test_prepare_from_the_command_line_prints_no_traceback(tmp_path, tok):
  corpus = write_corpus(tmp_path / "c.jsonl", "plain", n=40)
  for _ in range(3):  # worker shutdown used to print KeyboardInterrupt tracebacks at random
    proc = subprocess.run([sys.executable, "-m", "maxlm.cli", "prepare", corpus, *QUALITY_OFF,
                           "--out",
                           str(tmp_path / "out"), "--tokenizer", tok, "--overwrite"],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr


def test_write_errors_are_the_operating_systems_words():
  text = ('OUT_OF_RANGE: Failed writing: "/x/tokens-00000.bin.__lock": Failed to write 10 bytes '
          "to file 6: No space left on device [os_error_code='28']")
  assert io.describe_error(ValueError(text)) == "No space left on device (errno 28)"


def _flip(path, at):
  data = bytearray(path.read_bytes())
  data[at] ^= 1
  path.write_bytes(bytes(data))


def test_a_changed_shard_byte_stops_the_first_read_of_its_block(tmp_path, monkeypatch):
  """A token shard edited after prepare (same size, so `verify` passes) is refused by the
  store the first time a process reads the changed block, naming the shard and the block;
  the other blocks read on. Data dirs from before block digests check the file's SHA-256."""
  import pickle
  import numpy as np
  monkeypatch.setattr(datadir, "BLOCK_BYTES", 1024)
  lengths = [100] * 40  # 16,000 bytes of tokens: blocks 0..15
  out = datagen.write_data_dir(tmp_path / "d", datagen.make_docs(lengths))
  manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
  entry = manifest["files"]["tokens-00000.bin"]
  assert entry["block_bytes"] == 1024 and len(entry["xxh3_64_blocks"]) == 16
  shard = tmp_path / "d" / "tokens-00000.bin"
  _flip(shard, 5 * 1024 + 7)  # block 5 (bytes 5120..6144): documents 12 to 15
  store.load_manifest(out)  # sizes still agree: opening does not notice
  reader = store.TokenStore(out)
  for doc in (0, 11, 16, 39):
    assert len(reader.document(doc)) == 100
  for fresh in (reader, pickle.loads(pickle.dumps(reader))):  # a Grain worker checks too
    with pytest.raises(MaxlmError, match=r"tokens-00000.bin block 5 \(bytes 5,120..6,144\) "
                                         r"does not match its XXH3-64 in manifest.json"):
      fresh.document(13)
  entry.pop("xxh3_64_blocks")  # as an older prepare wrote it (the fingerprint is unchanged)
  (tmp_path / "d" / "manifest.json").write_text(json.dumps(manifest))
  with pytest.raises(MaxlmError, match=r"tokens-00000.bin block 0 .* its SHA-256"):
    store.TokenStore(out).document(0)
  _flip(shard, 5 * 1024 + 7)  # back as prepared: every read passes, each block hashed once
  reader = store.TokenStore(out)
  assert np.array_equal(reader.read(13, 0, 100), datagen.make_docs(lengths)[13][1])
  assert reader._checked == {0}

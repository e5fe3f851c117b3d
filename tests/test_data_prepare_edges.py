"""Hostile inputs to `maxlm prepare`: each is counted by reason or is one clear error."""

import builtins
import json
import os
import random
import subprocess
import sys

import pytest

from maxlm import MaxlmError
from maxlm.data import prepare, store, tokenizer

from datagen import QUALITY_OFF

PANGRAM = "The quick brown fox jumps over the lazy dog; 0123456789 times. "


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  path = tmp_path_factory.mktemp("tok") / "t.model"
  path.write_bytes(tokenizer.train([f"{PANGRAM}{i} " * 3 for i in range(50)], 350, num_threads=1))
  return str(path)


def run(inputs, out, tok=None, **kw):
  kw.setdefault("vocab_size", 350)
  return prepare.prepare([str(i) for i in inputs], str(out),
                         prepare.Options(tokenizer_file=tok, workers=1, progress=False, **kw))


def documents(manifest):
  return sum(s["documents"] for s in manifest["sources"].values())


def good_lines(n, word="doc"):
  return [json.dumps({"id": f"{word}-{i}", "text": f"{PANGRAM}{word} {i}. " * 4}) for i in range(n)]


@pytest.mark.parametrize("trained", [True, False])
def test_lone_surrogates_are_rejected_as_bad_unicode(tmp_path, tok, trained):
  src = tmp_path / "u.jsonl"
  src.write_text("\n".join(good_lines(20) + [
      r'{"text": "abc \ud800 def"}',
      r'{"id": "x\udfff", "text": "fine text"}',
      r'{"source": "s\ud800", "text": "fine text"}',
      r'{"messages": [{"role": "user", "content": "hi \udc00"}, '
      r'{"role": "assistant", "content": "ok"}]}']))
  manifest = run([src], tmp_path / "out", None if trained else tok)
  assert manifest["rejected"]["bad_unicode"] == 4
  assert documents(manifest) == 20
  assert f"{src}:21" in manifest["rejected_examples"]["bad_unicode"]


def test_deeply_nested_folders_are_walked(tmp_path, tok):
  deep = tmp_path / "in"
  deep.mkdir()
  for _ in range(1200):  # one level at a time: os.makedirs itself recurses
    deep = deep / "d"
    deep.mkdir()
  (deep / "leaf.txt").write_text(PANGRAM * 3)
  try:
    manifest = run([tmp_path / "in"], tmp_path / "out", tok)
  finally:  # bottom up: shutil.rmtree (pytest's cleanup) itself recurses
    (deep / "leaf.txt").unlink()
    while deep != tmp_path:
      deep.rmdir()
      deep = deep.parent
  assert documents(manifest) == 1


def test_hidden_vcs_links_and_special_files_are_counted_by_reason(tmp_path, tok):
  root, outside = tmp_path / "in", tmp_path / "outside"
  (root / "sub").mkdir(parents=True)
  (root / ".git").mkdir()
  (root / ".git" / "HEAD.txt").write_text(PANGRAM)
  outside.mkdir()
  for path in (root / "a.txt", root / "sub" / "x.txt", outside / "b.txt", outside / "c.txt"):
    path.write_text(PANGRAM + path.name)
  (root / ".hidden.txt").write_text(PANGRAM)
  os.symlink(root, root / "loop")
  os.symlink("..", root / "sub" / "up")
  os.symlink(tmp_path / "nowhere", root / "dangling.txt")
  os.symlink(outside, root / "linked")
  os.symlink(outside / "c.txt", root / "file_link.txt")
  os.symlink(root / "sub", root / "again")  # walked first ("again" < "sub"); then sub is seen
  os.mkfifo(root / "pipe.txt")
  manifest = run([root], tmp_path / "out", tok)
  assert manifest["skipped"] == {"hidden": 1, "vcs": 1, "symlink_loop": 2, "dangling_link": 1,
                                 "special_file": 1, "already_seen": 2, "unreadable": 0}
  assert manifest["skipped_examples"]["dangling_link"] == [str(root / "dangling.txt")]
  assert manifest["skipped_examples"]["vcs"] == [str(root / ".git")]
  ids = store.load_doc_ids(str(tmp_path / "out"))
  assert sorted(os.path.basename(i) for i in ids) == ["a.txt", "b.txt", "file_link.txt",
                                                      "x.txt"]


def test_examples_are_a_few_unless_verbose(tmp_path, tok):
  (tmp_path / "in").mkdir()
  (tmp_path / "in" / "a.txt").write_text(PANGRAM)
  for i in range(8):
    (tmp_path / "in" / f".h{i}").write_text("x")
  few = run([tmp_path / "in"], tmp_path / "o1", tok)
  every = run([tmp_path / "in"], tmp_path / "o2", tok, verbose=True)
  assert few["skipped"]["hidden"] == every["skipped"]["hidden"] == 8
  assert len(few["skipped_examples"]["hidden"]) == 5
  assert len(every["skipped_examples"]["hidden"]) == 8


def test_unreadable_files_and_folders_are_counted(tmp_path, tok, monkeypatch):
  root = tmp_path / "in"
  (root / "locked").mkdir(parents=True)
  (root / "locked" / "inner.txt").write_text(PANGRAM)
  (root / "ok.txt").write_text(PANGRAM)
  (root / "secret.txt").write_text(PANGRAM)
  os.chmod(root / "locked", 0)
  os.chmod(root / "secret.txt", 0)
  real_scandir, real_open = os.scandir, builtins.open

  def scandir(path="."):  # root ignores chmod: make it bite
    if os.fspath(path) == str(root / "locked"):
      raise PermissionError(13, "Permission denied", os.fspath(path))
    return real_scandir(path)

  def fake_open(path, *args, **kw):
    if isinstance(path, (str, os.PathLike)) and os.fspath(path) == str(root / "secret.txt"):
      raise PermissionError(13, "Permission denied", os.fspath(path))
    return real_open(path, *args, **kw)
  monkeypatch.setattr(os, "scandir", scandir)
  monkeypatch.setattr(builtins, "open", fake_open)
  try:
    manifest = run([root], tmp_path / "out", tok)
  finally:
    os.chmod(root / "locked", 0o755)
  assert manifest["skipped"]["unreadable"] == 2
  assert sorted(manifest["skipped_examples"]["unreadable"]) == [str(root / "locked"),
                                                                str(root / "secret.txt")]
  assert documents(manifest) == 1


def test_out_is_checked_before_any_tokenizing(tmp_path, tok, monkeypatch):
  src = tmp_path / "a.jsonl"
  src.write_text("\n".join(good_lines(3)))
  monkeypatch.setattr(prepare, "iter_documents", lambda *a: pytest.fail("tokenized first"))
  (tmp_path / "file").write_text("x")
  with pytest.raises(MaxlmError, match=r"--out .*/file is a file, not a folder"):
    run([src], tmp_path / "file", tok)
  with pytest.raises(MaxlmError, match=r"cannot write --out .*/file/data: .*/file is a file"):
    run([src], tmp_path / "file" / "data", tok)
  with pytest.raises(MaxlmError, match=r"cannot write --out http://127.0.0.1:9/data: .*writ"):
    run([src], "http://127.0.0.1:9/data", tok)
  with pytest.raises(MaxlmError, match=r"--tokenizer .*/nope.model: not found"):
    run([src], tmp_path / "o", str(tmp_path / "nope.model"))
  with pytest.raises(MaxlmError, match=r"--tokenizer .*/file is not a SentencePiece model"):
    run([src], tmp_path / "o", str(tmp_path / "file"))
  with pytest.raises(MaxlmError, match="input not found"):
    run([tmp_path / "missing"], tmp_path / "o", tok)
  assert not (tmp_path / "o").exists()


def test_vocab_hints_give_the_size_that_fits(tmp_path):
  small = tmp_path / "small.jsonl"
  small.write_text("\n".join(good_lines(5)))
  with pytest.raises(MaxlmError, match=r"supports at most --vocab-size (\d+) \(asked for 5000\)"
                     ) as err:
    run([small], tmp_path / "o1", vocab_size=5000)
  most = int(err.value.args[0].split("at most --vocab-size ")[1].split()[0])
  assert run([small], tmp_path / "o1", vocab_size=most)["vocab_size"] == most

  rng = random.Random(0)
  chars = [chr(0x4E00 + i) for i in range(700)]
  wide = tmp_path / "wide.jsonl"
  wide.write_text("\n".join(json.dumps({"text": "".join(rng.choice(chars) for _ in range(80))},
                                       ensure_ascii=False) for _ in range(200)))
  with pytest.raises(MaxlmError, match=r"needs --vocab-size >= (\d+) .*\(asked for 400\)") as err:
    run([wide], tmp_path / "o2", vocab_size=400)
  assert "smaller" not in str(err.value)
  least = int(err.value.args[0].split(">= ")[1].split()[0])
  assert least > 700
  assert run([wide], tmp_path / "o2", vocab_size=least)["vocab_size"] == least


def test_duplicate_ids_are_renamed_and_counted(tmp_path, tok):
  a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
  same = [json.dumps({"id": "same", "text": PANGRAM * 2})] * 3
  a.write_text("\n".join(same + good_lines(30)))
  b.write_text("\n".join([json.dumps({"id": "same", "text": PANGRAM}),
                          json.dumps({"id": "same#2", "text": PANGRAM})]))
  manifest = run([a, b], tmp_path / "out", tok, val_fraction=0.5)
  assert manifest["renamed_ids"] == 4
  assert manifest["renamed_id_examples"][0] == f"'same' at {a}:2 -> 'same#2'"
  ids = store.load_doc_ids(str(tmp_path / "out"))
  assert len(set(ids)) == len(ids) == 35
  assert [i for i in ids if i.startswith("same")] == ["same", "same#2", "same#3", "same#4",
                                                     "same#2#2"]
  split = store.load_index(str(tmp_path / "out")).split
  assert len({int(split[ids.index(i)]) for i in ("same", "same#2", "same#3")}) == 1
  assert len(set(split[3:33].tolist())) == 2  # the others are split both ways


def test_cli_prints_reasons_names_and_one_line_errors(tmp_path, tok):
  root = tmp_path / "in"
  root.mkdir()
  (root / "a.txt").write_text(PANGRAM * 2)
  (root / ".hidden").write_text("x")
  os.symlink(tmp_path / "gone", root / "dangling")
  (root / b"caf\xe9.txt".decode(errors="surrogateescape")).write_text(PANGRAM)
  out = tmp_path / "data"
  cli = lambda *a: subprocess.run([sys.executable, "-m", "maxlm.cli", "prepare", *QUALITY_OFF,
                                   *map(str, a)],
                                  capture_output=True, text=True)
  proc = cli(root, "--out", out, "--tokenizer", tok, "--verbose")
  assert proc.returncode == 0, proc.stderr
  assert "'hidden': 1" in proc.stdout and "'dangling_link': 1" in proc.stdout
  assert f"dangling_link: {root / 'dangling'}" in proc.stdout
  assert any(i.endswith("caf\\xe9.txt") for i in store.load_doc_ids(str(out)))
  proc = cli(root, "--out", out, "--tokenizer", tok)
  assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1
  assert "already holds files; pass --overwrite" in proc.stderr
  assert cli(root, "--out", out, "--tokenizer", tok, "--overwrite").returncode == 0


def test_deep_json_and_unusable_ids_and_sources_are_rejected_per_reason(tmp_path, tok):
  src = tmp_path / "in.jsonl"
  src.write_text("\n".join(good_lines(10) + [
      "[" * 5000 + "]" * 5000,  # nested past the parser's limit: one line, not an abort
      '{"text": ' + "[" * 3000 + "]" * 3000 + "}",
      json.dumps({"source": 5, "text": PANGRAM}),
      json.dumps({"source": ["a"], "text": PANGRAM}),
      json.dumps({"source": True, "text": PANGRAM}),
      json.dumps({"id": {"x": 1}, "text": PANGRAM}),
      json.dumps({"id": 7, "text": PANGRAM * 2})]))  # a numbered record is fine
  listed = tmp_path / "rejected.jsonl"
  manifest = run([src], tmp_path / "out", tok, rejected=str(listed),
                 quality=prepare.quality_lib.OFF)
  counts = {k: v for k, v in manifest["rejected"].items() if v}
  assert counts == {"too_deep": 2, "bad_source": 3, "bad_id": 1}
  assert list(manifest["sources"]) == ["in"] and documents(manifest) == 11
  assert "7" in store.load_doc_ids(str(tmp_path / "out"))
  rows = [json.loads(line) for line in listed.read_text().splitlines()]
  assert sorted(r["rule"] for r in rows) == ["bad_id"] + ["bad_source"] * 3 + ["too_deep"] * 2


def test_a_full_disk_under_rejected_is_one_line_and_leaves_the_old_list(tmp_path, tok,
                                                                        monkeypatch):
  import errno
  from maxlm.data.quality import funnel
  src = tmp_path / "in.jsonl"
  src.write_text("\n".join(good_lines(10) + ["not json"] * 5))
  listed = tmp_path / "rejected.jsonl"
  listed.write_text("the list of an earlier run\n")

  class FullDisk:  # a file system that takes one line, then is full
    def __init__(self, path, mode):
      self.file, self.lines = open(path, mode), 0

    def write(self, text):
      self.lines += 1
      if self.lines > 1:
        raise OSError(errno.ENOSPC, "No space left on device")
      return self.file.write(text)

    def close(self):
      self.file.close()

  monkeypatch.setattr(funnel, "open", FullDisk, raising=False)
  with pytest.raises(MaxlmError) as e:
    run([src], tmp_path / "out", tok, rejected=str(listed), quality=prepare.quality_lib.OFF)
  assert f"--rejected {listed}" in str(e.value) and "No space left" in str(e.value)
  assert len(str(e.value).splitlines()) == 1
  assert listed.read_text() == "the list of an earlier run\n"
  assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "rejected.jsonl"]  # no litter, no --out


def test_workers_are_capped_by_cores_and_memory_with_a_note(monkeypatch):
  from maxlm.data import workers
  notes = []
  monkeypatch.setattr(workers, "cores", lambda: 4)
  monkeypatch.setattr(workers, "available_bytes", lambda: 64 * workers.WORKER_BYTES)
  assert workers.count(10**9, notes.append) == 4 and "capped at 4 (4 cores)" in notes[-1]
  assert workers.count(3, notes.append) == 3 and workers.count(None, notes.append) == 4
  assert len(notes) == 1
  monkeypatch.setattr(workers, "available_bytes", lambda: 2 * workers.WORKER_BYTES + 1)
  assert workers.count(4, notes.append) == 2 and "GiB available" in notes[-1]
  monkeypatch.setattr(workers, "available_bytes", lambda: 0)
  assert workers.count(None, notes.append) == 1


_POOL_SCRIPT = """
import os, signal, sys
from maxlm.data import datadir, workers
staging = datadir.Staging(sys.argv[1])  # its --out lock: in workers.lock_files (outlock.py)
with workers.pool(2) as pool:
  ignored = pool.apply(signal.getsignal, (signal.SIGINT,)) == signal.SIG_IGN
  print(ignored, *[w.pid for w in pool._pool], flush=True)
  sys.stdin.read()
"""


def test_a_killed_prepare_leaves_no_worker_and_no_lock_held(tmp_path):
  import signal
  import time
  proc = subprocess.Popen([sys.executable, "-c", _POOL_SCRIPT, str(tmp_path / "out")],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
  ignored, *pids = proc.stdout.readline().split()
  assert ignored == "True" and len(pids) == 2  # a worker ignores Ctrl-C: the parent stops it
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  from maxlm.data import datadir
  datadir.Staging(tmp_path / "out").abort()  # the lock is free at once: no worker holds it

  def alive(pid):
    try:
      with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0] not in "ZX"
    except FileNotFoundError:
      return False
  give_up = time.monotonic() + 60  # the orphans' SIGTERM is the kernel's, at the parent's death
  while any(map(alive, pids)) and time.monotonic() < give_up:
    time.sleep(0.05)
  assert not any(map(alive, pids))


def test_a_full_disk_under_the_kept_documents_is_one_line_and_leaves_nothing(tmp_path, tok,
                                                                            monkeypatch):
  import errno
  from maxlm.data.quality import select
  src = tmp_path / "in.jsonl"
  src.write_text("\n".join(good_lines(10)))
  real_fdopen = os.fdopen

  class FullDisk:
    def __init__(self, fd, mode):
      self.file = real_fdopen(fd, mode)

    def write(self, text):
      raise OSError(errno.ENOSPC, "No space left on device")

    def __enter__(self):
      return self

    def __exit__(self, *exc):
      self.file.close()

  monkeypatch.setattr(select.os, "fdopen", FullDisk)
  with pytest.raises(MaxlmError) as e:
    run([src], tmp_path / "out", tok, quality=prepare.quality_lib.OFF)
  assert "cannot write the kept documents" in str(e.value) and "No space left" in str(e.value)
  assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


def test_rejected_onto_a_device_is_written_as_it_is_never_replaced(tmp_path):
  import stat
  from maxlm.data.quality import funnel
  listed = funnel.Rejected(os.devnull)  # as --rejected /dev/stdout: no file renamed onto it
  listed.write({"id": "a", "source": "s"}, "input", "empty")
  listed.close()
  assert stat.S_ISCHR(os.stat(os.devnull).st_mode)
  assert not [n for n in os.listdir(os.path.dirname(os.devnull)) if n.startswith("null.")]


def test_a_number_python_cannot_read_is_one_rejected_line_and_a_bom_is_read(tmp_path, tok):
  src = tmp_path / "in.jsonl"
  src.write_text("\ufeff" + "\n".join(good_lines(5) + [
      '{"text": "x y z", "n": ' + "9" * 5000 + "}",  # over Python's 4300-digit limit
      '{"text": "' + PANGRAM + '", "id": ' + "9" * 4000 + "}"]))
  manifest = run([src], tmp_path / "out", tok, quality=prepare.quality_lib.OFF)
  assert {k: v for k, v in manifest["rejected"].items() if v} == {"malformed_json": 1}
  assert documents(manifest) == 6 and "doc-0" in store.load_doc_ids(str(tmp_path / "out"))

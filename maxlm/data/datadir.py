"""A data dir as one unit: written whole or not at all, listed with sizes and hashes, checked
when opened.

`Staging` is where `maxlm prepare` writes. Before any tokenizing it checks `--out`: not a file,
writable (a write probe on object stores), and empty unless `overwrite` is given, and then only
holding data dir files, so `--overwrite` never deletes someone's folder.

- Local: files go to a sibling folder `OUT.partial-<pid>`, renamed to OUT only once complete; an
  old OUT is moved aside to `OUT.old-<pid>` first and deleted after, so a failure at any point
  leaves the old data dir as it was. A sibling left by a killed prepare (its pid is gone) is
  removed by the next prepare into OUT, which says so.
- Object stores (gs://; tests use memory://) have no rename: files are written in place and
  `manifest.json` last. When replacing, the old manifest is deleted before the first new file
  lands and old files the new manifest does not name are deleted after it, so a failed overwrite
  leaves a dir that `verify` refuses, never one that mixes old and new files.

The manifest's `files` maps each file's name to {"bytes", "sha256"} (hashed from the bytes as
they are written, never re-read) and `fingerprint` is the sha256 of the lines "NAME\\0SHA256\\n"
in name order: equal fingerprints mean equal data. `verify` runs whenever a data dir is opened
and checks only that every listed file exists with its listed size (a stat, or two one-byte
ranged reads on an object store), never re-hashing shards. A token shard's entry also lists
`xxh3_64_blocks`, the XXH3-64 of each `block_bytes` (64 MiB) of it: `store.TokenStore` checks a block the first
time its process reads from it, so a byte changed after prepare (same size) stops training with
one line naming the shard and block, for one hash pass over the data (tools/bench_shard_digest.py
measures it against the loader).
"""

import hashlib
import json
import os
import pathlib
import re
import shutil

import xxhash

from maxlm import MaxlmError, io
from maxlm.data import outlock

MANIFEST = "manifest.json"
BLOCK_BYTES = 64 * 2**20  # a token shard's digest block (store.TokenStore checks each once)
_SHARD = re.compile(r"tokens-\d{5}\.bin")
_PROBE = ".maxlm-write-probe"
_OURS = re.compile(r"tokens-\d{5}\.bin|index\.npz|doc_ids\.json|tokenizer\.model|manifest\.json|"
                   r"index\.json|index-\w+\.npy|doc_ids\.bin|removed\.jsonl|" + re.escape(_PROBE))
_RERUN = "re-run maxlm prepare INPUT... --out {} --overwrite"


def fingerprint_of(files):
  digest = hashlib.sha256()
  for name in sorted(files):
    digest.update(f"{name}\0{files[name]['sha256']}\n".encode())
  return digest.hexdigest()


class Staging:
  """Checks `out` (before any work), takes the files of a new data dir and puts them in place."""

  def __init__(self, out, overwrite=False, log=print):
    self.out, self.overwrite, self.log = str(out).rstrip("/") or "/", overwrite, log
    self.local = io.is_local(self.out)
    self.files, self.old = {}, []
    self._manifest_dropped = False
    self.lock = None
    if self.local:
      self._check_local()
    else:
      self._check_remote()

  def _check_local(self):
    out = pathlib.Path(os.path.realpath(self.out))
    if out.exists() and not out.is_dir():
      raise MaxlmError(f"--out {self.out} is a file, not a folder; give a folder for the data dir")
    above = out.parent
    while not above.exists() and above != above.parent:
      above = above.parent
    if not above.is_dir():
      raise MaxlmError(f"cannot write --out {self.out}: {above} is a file, not a folder")
    self.lock = outlock.OutLock(out, self.out)
    self._clean_stale(out)
    try:
      if out.is_dir():
        self.old = os.listdir(out)
        self._check_replaceable()
      out.parent.mkdir(parents=True, exist_ok=True)
      self.final, self.dir = out, out.parent / f"{out.name}.partial-{os.getpid()}"
      shutil.rmtree(self.dir, ignore_errors=True)
      self.dir.mkdir()
    except OSError as e:
      raise MaxlmError(f"cannot write --out {self.out}: {e.strerror or e}") from None

  def release(self):
    """Drops the --out lock (a local data dir's; see outlock.py)."""
    if self.lock is not None:
      self.lock.release()

  def _clean_stale(self, out):
    pattern = re.compile(re.escape(out.name) + r"\.(partial|old)-(\d+)")
    for path in sorted(out.parent.glob(f"{_glob_escape(out.name)}.*-*")):
      m = pattern.fullmatch(path.name)
      if not m or (io.process_alive(int(m[2])) and int(m[2]) != os.getpid()):
        continue
      if m[1] == "old" and not out.exists():  # killed between the two renames: put it back
        os.rename(path, out)
        self.log(f"restored {out} from {path}, left by an interrupted maxlm prepare")
      else:
        shutil.rmtree(path, ignore_errors=True)
        self.log(f"removed {path}, left by an interrupted maxlm prepare")

  def _check_remote(self):
    self.dir = self.out
    try:
      io.write_bytes(io.join(self.out, _PROBE), b"")
      io.delete(io.join(self.out, _PROBE))
      keys = io._open(self.out).list().result()
    except Exception as e:  # TensorStore reports failures as ValueError, NotImplementedError...
      first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
      raise MaxlmError(f"cannot write --out {self.out}: {first}") from None
    self.old = [k.decode(errors="backslashreplace") for k in keys if k != _PROBE.encode()]
    self._check_replaceable()

  def _check_replaceable(self):
    if not self.old:
      return
    if not self.overwrite:
      raise MaxlmError(f"--out {self.out} already holds files; pass --overwrite to replace them "
                       "(the old data dir stays usable until the new one is complete)")
    foreign = sorted(n for n in self.old if not _OURS.fullmatch(n))
    if foreign:
      raise MaxlmError(f"--out {self.out} holds {foreign[0]!r}, which is not part of a data dir; "
                       "refusing to replace it: choose a new or empty folder")

  def write(self, name, data):
    """Writes one file of the new data dir and records its size and sha256 (and a token
    shard's block digests)."""
    if not self.local and self.old and not self._manifest_dropped:
      io.delete(io.join(self.dir, MANIFEST))
      self._manifest_dropped = True
    self._put(name, data)
    self.files[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if _SHARD.fullmatch(name):
      self.files[name].update(block_bytes=BLOCK_BYTES, xxh3_64_blocks=block_digests(data))

  def _put(self, name, data):
    """Writes one file; a failure (a full disk) is one line naming --out, the file and the
    operating system's words, and what is left: a local data dir appears only once complete
    (its partial folder is removed by `abort`), and an object store's holds no manifest.json
    until then, so no later command reads a half-written data dir as a good one."""
    try:
      io.write_bytes(io.join(self.dir, name), data)
    except io.WriteError as e:
      full = e.reason.endswith(("(errno 28)", "(errno 122)"))  # ENOSPC, EDQUOT
      fix = "free space there or choose another folder" if full else "choose another folder"
      raise MaxlmError(f"cannot write --out {self.out}: {name}: {e.reason}; {self._left()}: "
                       f"{fix}") from None

  def _left(self):
    """What a failed write leaves at --out, in words."""
    if not self.local:
      return "it holds no manifest.json, so no command will read it as a data dir"
    return "nothing was put in its place" + (" (the old data dir is as it was)" if self.old
                                             else "")

  def commit(self, manifest):
    """Adds `files` and `fingerprint`, writes manifest.json last and puts the dir in place."""
    manifest = {**manifest, "files": dict(sorted(self.files.items())),
                "fingerprint": fingerprint_of(self.files)}
    self._put(MANIFEST, json.dumps(manifest, indent=1).encode())
    if self.local:
      self._swap()
      self.release()
    else:
      for name in self.old:
        if name not in self.files and name != MANIFEST:
          io.delete(io.join(self.out, name))
    return manifest

  def _swap(self):
    if not self.final.exists():
      os.rename(self.dir, self.final)
      return
    aside = self.final.parent / f"{self.final.name}.old-{os.getpid()}"
    os.rename(self.final, aside)
    try:
      os.rename(self.dir, self.final)
    except OSError:
      os.rename(aside, self.final)
      raise
    shutil.rmtree(aside, ignore_errors=True)

  def abort(self):
    """Removes what a failed prepare wrote (an old local data dir is untouched)."""
    if self.local:
      if hasattr(self, "dir"):
        shutil.rmtree(self.dir, ignore_errors=True)
      self.release()
      return
    for name in self.files:
      io.delete(io.join(self.dir, name))


def block_digests(data, block_bytes=None):
  """XXH3-64 (hex) of each `block_bytes` of `data` (the last block may be shorter)."""
  block_bytes = block_bytes or BLOCK_BYTES
  view = memoryview(data).cast("B")
  return [xxhash.xxh3_64_hexdigest(view[a:a + block_bytes])
          for a in range(0, len(view), block_bytes)] or [xxhash.xxh3_64_hexdigest(b"")]


def _glob_escape(name):
  return re.sub(r"([*?[])", r"[\1]", name)


def verify(data_dir, manifest):
  """Refuses a data dir whose files are missing or not the size its manifest lists."""
  files = manifest.get("files")
  if not isinstance(files, dict) or not files:
    raise MaxlmError(f"data.dir {data_dir!r}: manifest.json lists no files (made by an older "
                     f"maxlm prepare or by hand); {_RERUN.format(data_dir)}")
  if manifest.get("fingerprint") != fingerprint_of(files):
    raise MaxlmError(f"data.dir {data_dir!r}: manifest.json's fingerprint does not match its "
                     f"file list (edited by hand?); {_RERUN.format(data_dir)}")
  for name, found in _sizes(data_dir, files).items():
    want = files[name]["bytes"]
    if found is None:
      raise MaxlmError(f"data.dir {data_dir!r}: {name} is missing, expected {want} bytes; "
                       f"{_RERUN.format(data_dir)}")
    if found != want:
      raise MaxlmError(f"data.dir {data_dir!r}: {name} has {found} bytes, expected {want}; "
                       f"{_RERUN.format(data_dir)}")


def verify_contents(data_dir, manifest):
  """Re-hashes every file the manifest lists (slow: reads the whole data dir); returns the
  names whose SHA-256 differs, after the cheap checks of `verify`."""
  verify(data_dir, manifest)
  bad = []
  for name, want in sorted(manifest["files"].items()):
    if hashlib.sha256(io.read_bytes(io.join(data_dir, name))).hexdigest() != want["sha256"]:
      bad.append(name)
  return bad


def _sizes(data_dir, files):
  """{name: size, or None if missing, or 'fewer than N'/'more than N' where only that is known}."""
  if io.is_local(data_dir):
    sizes = {}
    for name in files:
      try:
        sizes[name] = os.stat(os.path.join(data_dir, name)).st_size
      except FileNotFoundError:
        sizes[name] = None
    return sizes
  store = io._open(str(data_dir).rstrip("/"))
  # Byte [n-1, n) exists iff size >= n; byte [n, n+1) exists iff size > n. All reads at once.
  reads = {name: (store.read(name, byte_range=slice(max(f["bytes"] - 1, 0), f["bytes"]))
                  if f["bytes"] else store.read(name),
                  store.read(name, byte_range=slice(f["bytes"], f["bytes"] + 1)))
           for name, f in files.items()}
  return {name: _size_from(low, high, files[name]["bytes"]) for name, (low, high) in reads.items()}


def _size_from(low, high, want):
  try:
    if low.result().state != "value":
      return None
  except ValueError as e:  # out of range: shorter than listed
    m = re.search(r"value of size (\d+)", str(e))
    return int(m[1]) if m else f"fewer than {want}"
  try:
    return "more than " + str(want) if high.result().state == "value" else None
  except ValueError:
    return want

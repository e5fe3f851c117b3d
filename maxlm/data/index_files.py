"""The doc index on disk as memory-mappable files, and the document-id string table.

A data dir's index is one `.npy` file per per-document array (`index-length.npy`, ...), plus
`index.json` (format version, document count, source names) and the document ids as a string
table: `doc_ids.bin` (the UTF-8 ids back to back) with `index-doc_id_ptr.npy` (n + 1 offsets).
Local files are opened with `np.load(mmap_mode="r")`: nothing is read until touched, the pages
are the OS page cache's, so every process on a host (Grain workers included) shares one copy,
and a pickled index carries only its file names (store.DocIndex).

Besides what prepare always recorded, three arrays exist so that nothing has to scan the
corpus to plan: `index-chat.npy` (is_chat per document), `index-pool_docs.npy` (the training
documents, grouped by source, ascending within each) with `index-pool_ptr.npy` (where each
source's group starts) and `index-pool_tokens.npy` (each source's training tokens).
`pool_docs` is 4 bytes per document (uint32 below 2^32 documents): 4 GB at 10^9, which is why
it is a file to map, never an array a process builds for itself.

gs:// (any object store): the index files are copied to a local cache the first time they are
opened (ranged reads of 64 MiB, each file's sha256 checked against the manifest) and mapped
from there: `$MAXLM_CACHE` (default ~/.cache/maxlm)/index/<fingerprint>/. The cache holds the
whole index (~45 bytes per document, plus the ids) and never token shards, which are read in
ranges as before. Why whole files: every array is read at random positions by the planner or
the assembler, and a host's share of rows touches documents all over the corpus.

Why .npy files rather than one .npz (the old `index.npz`): a zip member cannot be mapped.
"""

import hashlib
import io as _io
import json
import os
import pathlib

import numpy as np

from maxlm import MaxlmError, io

FORMAT = 2
META = "index.json"
IDS = "doc_ids.bin"
ID_PTR = "doc_id_ptr"
FIELDS = ("shard", "offset", "length", "source", "split", "nbytes", "bound_ptr", "bound_pos",
          "bound_level", "nolos_ptr", "nolos_start", "nolos_end", "lang_score", "chat",
          "pool_docs", "pool_ptr", "pool_tokens")
# Written by every prepare since preference pairs (pairs.py); absent in older data dirs, whose
# documents are then none of them pairs.
OPTIONAL = ("pair",)
_CHUNK = 64 << 20


def file_name(field):
  return f"index-{field}.npy"


def npy_bytes(array):
  buf = _io.BytesIO()
  np.lib.format.write_array(buf, np.ascontiguousarray(array), allow_pickle=False)
  return buf.getvalue()


def write(staging, arrays, sources, doc_ids):
  """Writes the index files through a datadir.Staging. arrays: FIELDS -> numpy arrays."""
  for field in FIELDS + OPTIONAL:
    staging.write(file_name(field), npy_bytes(arrays[field]))
  encoded = [i.encode("utf-8", "surrogatepass") for i in doc_ids]
  ptr = np.zeros(len(encoded) + 1, np.int64)
  np.cumsum([len(b) for b in encoded], out=ptr[1:])
  staging.write(file_name(ID_PTR), npy_bytes(ptr))
  staging.write(IDS, b"".join(encoded))
  meta = {"format": FORMAT, "documents": len(doc_ids), "sources": list(sources)}
  staging.write(META, json.dumps(meta).encode())


def pools(source, split, length, n_sources, train):
  """(pool_docs, pool_ptr, pool_tokens): the training documents grouped by source."""
  mine = np.flatnonzero(split == train)
  order = np.argsort(source[mine], kind="stable")
  docs = mine[order]
  counts = np.bincount(source[docs], minlength=n_sources)
  ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
  tokens = np.bincount(source[docs], weights=length[docs], minlength=n_sources)
  dtype = np.uint32 if len(source) < 2**32 else np.int64
  return docs.astype(dtype), ptr, np.round(tokens).astype(np.int64)


def is_current(data_dir):
  return io.exists(io.join(data_dir, META))


def read_meta(data_dir):
  meta = json.loads(io.read_bytes(io.join(data_dir, META)))
  if meta.get("format") != FORMAT:
    raise MaxlmError(f"data.dir {data_dir!r}: its index has format {meta.get('format')}, this "
                     f"maxlm reads format {FORMAT}; re-run maxlm prepare INPUT... --out "
                     f"{data_dir} --overwrite")
  return meta


def open_arrays(data_dir, fields=FIELDS):
  """{field: read-only memory map} of a data dir's index files (remote ones via the cache)."""
  manifest = _manifest(data_dir)
  if fields == FIELDS:
    fields += tuple(f for f in OPTIONAL if (
        os.path.exists(os.path.join(str(data_dir), file_name(f))) if manifest is None
        else file_name(f) in manifest.get("files", {})))
  return {f: np.load(local_path(data_dir, file_name(f), manifest), mmap_mode="r") for f in fields}


def _manifest(data_dir):
  """The manifest of a remote data dir, read once per open (the sizes and hashes of what to
  cache; opening the data dir has checked it against the files)."""
  if io.is_local(data_dir):
    return None
  from maxlm.data import datadir
  return json.loads(io.read_bytes(io.join(data_dir, datadir.MANIFEST)))


def local_path(data_dir, name, manifest=None):
  """A local path holding the data dir's file `name` (the file itself when local)."""
  if io.is_local(data_dir):
    return os.path.join(str(data_dir), name)
  manifest = manifest or _manifest(data_dir)
  if name not in manifest.get("files", {}):
    raise MaxlmError(f"data.dir {data_dir!r}: manifest.json does not list {name}; re-run maxlm "
                     f"prepare INPUT... --out {data_dir} --overwrite")
  want = manifest["files"][name]
  folder = cache_root() / "index" / manifest["fingerprint"][:32]
  path = folder / name
  if path.exists() and path.stat().st_size == want["bytes"]:
    return str(path)
  folder.mkdir(parents=True, exist_ok=True)
  part = folder / f".{name}.{os.getpid()}.part"
  digest, src = hashlib.sha256(), io.join(data_dir, name)
  with open(part, "wb") as f:
    for a in range(0, want["bytes"], _CHUNK):
      data = io.read_range(src, a, min(a + _CHUNK, want["bytes"]))
      digest.update(data)
      f.write(data)
  if digest.hexdigest() != want["sha256"]:
    part.unlink()
    raise MaxlmError(f"data.dir {data_dir!r}: {name} does not match its sha256 in the manifest "
                     f"(changed while being read?); re-run maxlm prepare INPUT... --out "
                     f"{data_dir} --overwrite")
  os.replace(part, path)  # whole or absent: a concurrent reader sees the old name or none
  return str(path)


def cache_root():
  return pathlib.Path(os.environ.get("MAXLM_CACHE") or pathlib.Path.home() / ".cache" / "maxlm")


class DocIds:
  """The document ids as a read-only sequence over the memory-mapped string table."""

  def __init__(self, data_dir):
    self.data_dir = str(data_dir)
    self._open()

  def _open(self):
    manifest = _manifest(self.data_dir)
    self.ptr = np.load(local_path(self.data_dir, file_name(ID_PTR), manifest), mmap_mode="r")
    path = local_path(self.data_dir, IDS, manifest)
    self.data = (np.memmap(path, np.uint8, "r") if os.path.getsize(path)
                 else np.zeros(0, np.uint8))

  def __getstate__(self):
    return {"data_dir": self.data_dir}

  def __setstate__(self, state):
    self.data_dir = state["data_dir"]
    self._open()

  def __len__(self):
    return len(self.ptr) - 1

  def __getitem__(self, i):
    if isinstance(i, slice):
      return [self[j] for j in range(*i.indices(len(self)))]
    i = int(i)
    if i < 0:
      i += len(self)
    if not 0 <= i < len(self):
      raise IndexError(f"document {i} is outside 0..{len(self) - 1}")
    return bytes(self.data[self.ptr[i]:self.ptr[i + 1]]).decode("utf-8", "surrogatepass")

  def __iter__(self):
    return (self[i] for i in range(len(self)))

  def __eq__(self, other):
    return list(self) == list(other)

  def index(self, doc_id):
    """The document number of an id (a scan: for tools and tests, not for hot paths)."""
    for i, x in enumerate(self):
      if x == doc_id:
        return i
    raise ValueError(f"{doc_id!r} is not a document id of {self.data_dir}")

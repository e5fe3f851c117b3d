"""The token store and doc index that `maxlm prepare` writes and everything else reads.

Layout of a data dir (local or gs://):
  tokens-00000.bin ...  raw little-endian int32 token ids, documents back to back in shards
  index-*.npy, index.json
                        per document: shard, offset, length, source, split, utf8 bytes; section
                        boundaries and no-loss (chat prompt) intervals as CSR arrays; the
                        training documents grouped by source; memory-mapped (index_files.py)
  doc_ids.bin           the document ids, verbatim, as a string table (index_files.DocIds)
  tokenizer.model       the SentencePiece model
  removed.jsonl         every document prepare did not keep: {id, source, step, rule} (or
                        "where" for an input reject), as --rejected lists them; `maxlm docs`
  manifest.json         per-source and per-reject-reason counts, tokenizer facts, and `files`:
                        every other file's size and sha256, with their `fingerprint`; written
                        last, and checked against the files whenever the dir is opened (see
                        datadir.py, which also owns writing the dir whole or not at all)

Why raw shards rather than ArrayRecord or zarr: any `[doc, start:end)` is one contiguous byte
range, so a local read is a memmap slice (~3 us, measured 200M tok/s) and a remote read is one
ranged GET through TensorStore; zarr via TensorStore measured ~25 us per read (20M tok/s), too
slow to beat in-memory packing, and ArrayRecord returns whole records.

Data dirs from before the memory-mapped index (`index.npz` and `doc_ids.json`) still open: their
index is read whole into memory, as it always was, which is fine at the sizes such dirs have;
`maxlm prepare` writes the mapped format.
"""

import dataclasses
import hashlib
import io as _io
import json

import numpy as np
import xxhash

from maxlm import MaxlmError, io
from maxlm.data import datadir, index_files

TRAIN, VAL = 0, 1
REMOVED = "removed.jsonl"
SHARD_TOKENS = 1 << 26


def shard_name(i):
  return f"tokens-{i:05d}.bin"


class StoreWriter:
  """Appends documents to shards and writes a shard (through a datadir.Staging) once full."""

  def __init__(self, staging, shard_tokens=None):
    self.staging, self.shard_tokens = staging, shard_tokens or SHARD_TOKENS
    self.shard, self.parts, self.filled = 0, [], 0

  def add(self, tokens):
    if self.filled and self.filled + len(tokens) > self.shard_tokens:
      self._flush()
    where = (self.shard, self.filled)
    self.parts.append(np.asarray(tokens, "<i4"))
    self.filled += len(tokens)
    return where

  def close(self):
    if self.parts or self.shard == 0:
      self._flush()
    return self.shard

  def _flush(self):
    data = np.concatenate(self.parts) if self.parts else np.zeros(0, "<i4")
    self.staging.write(shard_name(self.shard), data.tobytes())
    self.shard, self.parts, self.filled = self.shard + 1, [], 0


@dataclasses.dataclass(eq=False)
class DocIndex:
  """Per-document arrays; `sources[source[i]]` names document i's pool. Opened from a data dir
  (`load_index`), the arrays are read-only memory maps and the index pickles as its data dir's
  name; built in memory (tests, old data dirs), the derived arrays are computed here."""
  shard: np.ndarray
  offset: np.ndarray
  length: np.ndarray
  source: np.ndarray
  split: np.ndarray
  nbytes: np.ndarray
  bound_ptr: np.ndarray
  bound_pos: np.ndarray
  bound_level: np.ndarray
  nolos_ptr: np.ndarray
  nolos_start: np.ndarray
  nolos_end: np.ndarray
  sources: list
  lang_score: np.ndarray | None = None  # the language ID probability (NaN: not identified)
  chat: np.ndarray | None = None  # is_chat
  pool_docs: np.ndarray | None = None  # training documents grouped by source (index_files.py)
  pool_ptr: np.ndarray | None = None
  pool_tokens: np.ndarray | None = None
  pair: np.ndarray | None = None  # [n, 2]: a preference pair's (prompt, chosen) tokens (pairs.py)
  data_dir: str | None = None  # set when memory-mapped from a data dir

  def __post_init__(self):
    self.sources = [str(s) for s in self.sources]
    if self.chat is None:
      self.chat = np.diff(self.nolos_ptr) > 0
    if self.pair is None:
      self.pair = np.zeros((len(self.length), 2), np.int32)
    if self.pool_docs is None:
      self.pool_docs, self.pool_ptr, self.pool_tokens = index_files.pools(
          np.asarray(self.source), np.asarray(self.split), np.asarray(self.length),
          len(self.sources), TRAIN)

  def __len__(self):
    return len(self.length)

  def __getstate__(self):
    if self.data_dir is not None:
      return {"data_dir": self.data_dir}
    return dict(self.__dict__)

  def __setstate__(self, state):
    if set(state) == {"data_dir"}:
      state = vars(_mapped(state["data_dir"]))
    self.__dict__.update(state)

  @property
  def is_chat(self):
    return self.chat

  def pair_of(self, doc):
    """(prompt tokens, chosen tokens) of a preference pair; (0, 0) for any other document."""
    p, c = self.pair[doc]
    return int(p), int(c)

  def pool(self, source):
    """Source `source`'s training documents, ascending (a view: no copy)."""
    return self.pool_docs[self.pool_ptr[source]:self.pool_ptr[source + 1]]

  def bounds(self, doc):
    a, b = self.bound_ptr[doc], self.bound_ptr[doc + 1]
    return self.bound_pos[a:b], self.bound_level[a:b]

  def no_loss(self, doc):
    """[(start, end)] token ranges of a chat document whose targets carry no loss."""
    a, b = self.nolos_ptr[doc], self.nolos_ptr[doc + 1]
    return list(zip(self.nolos_start[a:b].tolist(), self.nolos_end[a:b].tolist()))

  def arrays(self):
    """{field: array} of everything index_files writes."""
    return {f: getattr(self, f) for f in index_files.FIELDS + index_files.OPTIONAL}

  @classmethod
  def from_bytes(cls, data):
    """An `index.npz` as written by maxlm prepare before the mapped format."""
    with np.load(_io.BytesIO(data)) as z:
      fields = {k: z[k] for k in z.files}
    fields["sources"] = [str(s) for s in fields["sources"]]
    return cls(**fields)


def _mapped(data_dir):
  meta = index_files.read_meta(data_dir)
  return DocIndex(**index_files.open_arrays(data_dir), sources=meta["sources"],
                  data_dir=str(data_dir))


def _no_data(data_dir):
  return MaxlmError(f"data.dir {data_dir!r} holds no prepared data (no index.json); run "
                    f"`maxlm prepare INPUT... --out {data_dir}` first, or `maxlm demo` for "
                    "the demo's")


def _old_format(data_dir):
  return io.exists(io.join(data_dir, "index.npz"))


def load_index(data_dir):
  """The data dir's index: memory-mapped, or read whole from an older prepare's index.npz."""
  if index_files.is_current(data_dir):
    return _mapped(data_dir)
  if not _old_format(data_dir):
    raise _no_data(data_dir)
  return DocIndex.from_bytes(io.read_bytes(io.join(data_dir, "index.npz")))


def load_manifest(data_dir):
  """The manifest, once the files it lists are all there with their sizes (cheap: no hashing)."""
  path = io.join(data_dir, datadir.MANIFEST)
  if not io.exists(path):
    if not index_files.is_current(data_dir) and not _old_format(data_dir):
      raise _no_data(data_dir)
    raise MaxlmError(f"data.dir {data_dir!r} has no manifest.json, so its files may be from an "
                     f"unfinished maxlm prepare; re-run maxlm prepare INPUT... --out {data_dir} "
                     "--overwrite")
  try:
    manifest = json.loads(io.read_bytes(path))
  except ValueError:
    raise MaxlmError(f"data.dir {data_dir!r}: manifest.json is not valid JSON; re-run maxlm "
                     f"prepare INPUT... --out {data_dir} --overwrite") from None
  if not isinstance(manifest, dict):
    raise MaxlmError(f"data.dir {data_dir!r}: manifest.json is not a JSON object; re-run maxlm "
                     f"prepare INPUT... --out {data_dir} --overwrite")
  datadir.verify(data_dir, manifest)
  return manifest


def fingerprint(manifest):
  """The sha256 naming a data dir's exact contents (see datadir.py); None for older dirs."""
  return manifest.get("fingerprint")


def load_doc_ids(data_dir):
  """The document ids, a sequence indexed by document (memory-mapped; a list for older dirs)."""
  if index_files.is_current(data_dir):
    return index_files.DocIds(data_dir)
  return json.loads(io.read_bytes(io.join(data_dir, "doc_ids.json")))


class TokenStore:
  """Random access to `[doc, start:end)` token ranges; pickles cheaply for Grain workers.

  Every block of a shard is checked against the manifest (`xxh3_64_blocks`, or the whole
  file's sha256 for data dirs written before block digests) the first time this process reads
  from it; a mismatch is one MaxlmError naming the shard and block."""

  def __init__(self, data_dir, index=None):
    self.data_dir = str(data_dir)
    self.index = index if index is not None else load_index(self.data_dir)
    self._maps, self._checks, self._checked = {}, None, set()

  def __getstate__(self):  # each process checks the blocks it reads itself
    return {"data_dir": self.data_dir, "index": self.index, "_maps": {}, "_checks": None,
            "_checked": set()}

  def read(self, doc, start, end):
    shard = int(self.index.shard[doc])
    base = int(self.index.offset[doc])
    if shard not in self._checked:
      self._check(shard, 4 * (base + start), 4 * (base + end))
    if io.is_local(self.data_dir):
      return self._map(shard)[base + start:base + end]
    data = io.read_range(io.join(self.data_dir, shard_name(shard)), 4 * (base + start),
                         4 * (base + end))
    return np.frombuffer(data, "<i4")

  def document(self, doc):
    return self.read(doc, 0, int(self.index.length[doc]))

  def _map(self, shard):
    if shard not in self._maps:
      self._maps[shard] = np.memmap(io.join(self.data_dir, shard_name(shard)), "<i4", "r")
    return self._maps[shard]

  def _check(self, shard, a, b):
    """Checks the unchecked blocks holding bytes [a, b) of the shard; once all are, the shard
    joins `_checked` and reads skip this."""
    if self._checks is None:
      self._checks = _shard_checks(self.data_dir)
    check = self._checks.get(shard)
    if check is None:  # not listed (an in-memory index in tests): nothing to check against
      self._checked.add(shard)
      return
    for block in range(a // check.block_bytes, max(a, b - 1) // check.block_bytes + 1):
      if block in check.done:
        continue
      lo, hi = block * check.block_bytes, min((block + 1) * check.block_bytes, check.size)
      if check.digest(self._bytes(shard, lo, hi)) != check.digests[block]:
        raise MaxlmError(f"data.dir {self.data_dir!r}: {shard_name(shard)} block {block} (bytes "
                         f"{lo:,}..{hi:,}) does not match its {check.kind} in manifest.json: "
                         "the file changed after maxlm prepare; re-run maxlm prepare INPUT... "
                         f"--out {self.data_dir} --overwrite (maxlm check-data lists every "
                         "changed file)")
      check.done.add(block)
    if len(check.done) == len(check.digests):
      self._checked.add(shard)

  def _bytes(self, shard, lo, hi):
    if io.is_local(self.data_dir):
      return self._map(shard).view(np.uint8)[lo:hi]
    return io.read_range(io.join(self.data_dir, shard_name(shard)), lo, hi)


@dataclasses.dataclass
class _ShardCheck:
  size: int
  block_bytes: int
  digests: list
  kind: str
  digest: object  # bytes-like -> hex digest
  done: set = dataclasses.field(default_factory=set)


def _shard_checks(data_dir):
  """{shard: _ShardCheck} from the manifest (read once per process)."""
  path = io.join(data_dir, datadir.MANIFEST)
  files = json.loads(io.read_bytes(path)).get("files", {}) if io.exists(path) else {}
  checks = {}
  for name, entry in files.items():
    if not (name.startswith("tokens-") and name.endswith(".bin")):
      continue
    size = int(entry["bytes"])
    if entry.get("xxh3_64_blocks"):
      checks[int(name[7:12])] = _ShardCheck(size, int(entry.get("block_bytes", datadir.BLOCK_BYTES)),
                                            entry["xxh3_64_blocks"], "XXH3-64",
                                            xxhash.xxh3_64_hexdigest)
    else:  # written before block digests: the whole file is one block
      checks[int(name[7:12])] = _ShardCheck(size, max(size, 1), [entry["sha256"]], "SHA-256",
                                            lambda b: hashlib.sha256(b).hexdigest())
  return checks

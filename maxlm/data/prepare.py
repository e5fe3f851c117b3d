"""`maxlm prepare`: raw documents -> tokenizer, token store, doc index, manifest.

Reads JSON Lines (`text` or chat `messages`, optional `id` and `source`), plain text, markdown
and code files, and folders of them. Every rejected document is counted by reason, and every
skipped file by suffix; nothing raises on bad input. Tokenization runs on all cores: each
document is split at its section boundaries and the blocks are encoded separately, so the
boundaries are exact token offsets.
"""

import collections
import hashlib
import json
import multiprocessing
import os
import pathlib

import numpy as np
import tqdm

from maxlm import MaxlmError, io
from maxlm.data import sections, store, tokenizer

TEXT_SUFFIXES = frozenset(".txt .md .markdown .rst .text".split())
JSONL_SUFFIXES = frozenset((".jsonl",))
REASONS = ("non_utf8", "empty", "malformed_json", "missing_text", "bad_messages")
_EXAMPLES = 5


class Report:
  """Counts of rejected documents per reason (with a few examples) and skipped files."""

  def __init__(self):
    self.rejected = collections.Counter({r: 0 for r in REASONS})
    self.examples = collections.defaultdict(list)
    self.skipped_files = collections.Counter()

  def reject(self, reason, where):
    self.rejected[reason] += 1
    if len(self.examples[reason]) < _EXAMPLES:
      self.examples[reason].append(where)


def iter_files(inputs, report):
  """(path, default source) for every readable file under the inputs, in a stable order."""
  for given in inputs:
    root = pathlib.Path(given)
    if not root.exists():
      raise MaxlmError(f"input not found: {given}")
    if root.is_file():
      yield root, root.stem
      continue
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
      if any(part.startswith(".") for part in path.relative_to(root).parts):
        continue
      if _kind(path) is None:
        report.skipped_files[path.suffix or "(none)"] += 1
        continue
      yield path, root.name


def _kind(path):
  suffix = path.suffix.lower()
  if suffix in JSONL_SUFFIXES:
    return "jsonl"
  if suffix in sections.CODE_SUFFIXES:
    return "code"
  if suffix in TEXT_SUFFIXES or path.name in ("METADATA", "README", "LICENSE"):
    return "prose"
  return None


def iter_documents(inputs, report):
  """Yields dicts {source, id, kind, text | messages} and counts what it rejects."""
  for path, source in iter_files(inputs, report):
    kind = _kind(path) or "prose"
    data = path.read_bytes()
    if kind != "jsonl":
      text = _decode(data, str(path), report)
      if text is not None and _nonblank(text, str(path), report):
        yield {"source": source, "id": str(path), "kind": kind, "text": text}
      continue
    for number, line in enumerate(data.split(b"\n"), 1):
      if line.strip():
        doc = _parse_line(line, f"{path}:{number}", report)
        if doc is not None:
          doc.setdefault("source", path.stem)
          doc.setdefault("id", f"{path.name}:{number}")
          yield doc


def _decode(data, where, report):
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError:
    report.reject("non_utf8", where)
    return None


def _nonblank(text, where, report):
  if text.strip():
    return True
  report.reject("empty", where)
  return False


def _parse_line(line, where, report):
  text = _decode(line, where, report)
  if text is None:
    return None
  try:
    record = json.loads(text)
  except json.JSONDecodeError:
    report.reject("malformed_json", where)
    return None
  if not isinstance(record, dict):
    report.reject("malformed_json", where)
    return None
  doc = {k: str(record[k]) for k in ("id", "source") if record.get(k) not in (None, "")}
  if "messages" in record and "text" not in record:
    messages = record["messages"]
    if not (isinstance(messages, list) and messages and all(
        isinstance(m, dict) and m.get("role") in tokenizer.ROLES
        and isinstance(m.get("content"), str) for m in messages)):
      report.reject("bad_messages", where)
      return None
    if not any(m["content"].strip() for m in messages):
      report.reject("empty", where)
      return None
    return {**doc, "kind": "chat", "messages": messages}
  if not isinstance(record.get("text"), str):
    report.reject("missing_text", where)
    return None
  if not _nonblank(record["text"], where, report):
    return None
  kind = "code" if pathlib.PurePath(doc.get("id", "")).suffix in sections.CODE_SUFFIXES else "prose"
  return {**doc, "kind": kind, "text": record["text"]}


def training_sentences(docs, max_chars=40_000_000):
  """Paragraph-sized strings for the tokenizer trainer, from the first `max_chars` of text."""
  seen = 0
  for doc in docs:
    texts = [m["content"] for m in doc["messages"]] if doc["kind"] == "chat" else [doc["text"]]
    for text in texts:
      for block, _ in sections.split(text, "code" if doc["kind"] == "code" else "prose"):
        for piece in (block[i:i + 8000] for i in range(0, len(block), 8000)):
          if piece.strip():
            yield piece
            seen += len(piece)
      if seen >= max_chars:
        return


_SP = None


def _init_worker(model_proto):
  global _SP
  _SP = tokenizer.load(model_proto)


def encode_document(doc):
  """(source, id, tokens, bound_pos, bound_level, no-loss intervals, utf8 bytes)."""
  return (doc["source"], doc["id"], *_encode(doc))


def _encode(doc):
  if doc["kind"] == "chat":
    return _encode_chat(doc["messages"])
  blocks = sections.split(doc["text"], doc["kind"])
  ids = _SP.encode([b for b, _ in blocks])
  lengths = np.cumsum([len(x) for x in ids])
  keep = [i for i in range(1, len(blocks)) if blocks[i][1] and 0 < lengths[i - 1]]
  pos = np.array([lengths[i - 1] for i in keep], np.int32)
  level = np.array([blocks[i][1] for i in keep], np.int8)
  tokens = np.fromiter((t for x in ids for t in x), np.int32, int(lengths[-1]))
  return tokens, pos, level, np.zeros((0, 2), np.int32), len(doc["text"].encode())


def _encode_chat(messages):
  """Role header and non-assistant turns are no-loss; assistant content and its end count."""
  parts, no_loss, bounds, n = [], [], [], 0
  for m in messages:
    header = [_SP.piece_to_id(f"<|{m['role']}|>")] + _SP.encode("\n")
    body = _SP.encode(m["content"]) + [_SP.piece_to_id(tokenizer.CHAT_END)]
    if n:
      bounds.append(n)
    loss_from = n + len(header) if m["role"] == "assistant" else n + len(header) + len(body)
    no_loss.append((n, loss_from))
    parts += header + body
    n += len(header) + len(body)
  no_loss = [(a, b) for a, b in no_loss if b > a]
  nbytes = sum(len(m["content"].encode()) for m in messages)
  return (np.array(parts, np.int32), np.array(bounds, np.int32),
          np.full(len(bounds), sections.SECTION, np.int8),
          np.array(no_loss, np.int32).reshape(-1, 2), nbytes)


def heldout(source, doc_id, fraction):
  digest = hashlib.blake2b(f"{source}\0{doc_id}".encode(), digest_size=8).digest()
  return int.from_bytes(digest, "little") / 2**64 < fraction


def prepare(inputs, out_dir, vocab_size=8192, tokenizer_file=None, val_fraction=0.01,
            workers=None, progress=True):
  """Runs the whole preparation and returns the manifest dict."""
  report = Report()
  if tokenizer_file:
    model_proto = pathlib.Path(tokenizer_file).read_bytes()
  else:
    first_pass, seen = Report(), []
    docs = (seen.append(1) or d for d in iter_documents(inputs, first_pass))
    try:
      model_proto = tokenizer.train(training_sentences(docs), vocab_size,
                                    num_threads=os.cpu_count() or 1)
    except RuntimeError as e:
      if not seen:
        raise _no_documents(inputs, first_pass) from None
      raise MaxlmError(f"tokenizer training failed: {str(e).splitlines()[-1]} "
                       f"(a smaller --vocab-size may fit this corpus)") from None
  sp = tokenizer.load(model_proto)
  special = tokenizer.special_ids(sp)

  writer = DataDirWriter(out_dir)
  with multiprocessing.get_context("fork").Pool(workers or os.cpu_count(), _init_worker,
                                                (model_proto,)) as pool:
    encoded = pool.imap(encode_document, iter_documents(inputs, report), chunksize=16)
    for record in tqdm.tqdm(encoded, desc="tokenize", unit="doc", disable=not progress):
      writer.add(*record)
  if not writer.doc_ids:
    raise _no_documents(inputs, report)
  return writer.finish(report, special, sp.vocab_size(), model_proto, val_fraction)


def _no_documents(inputs, report):
  return MaxlmError(f"no usable documents in {', '.join(map(str, inputs))} "
                    f"(rejected: {dict(+report.rejected) or 'none'}; "
                    f"skipped files: {dict(report.skipped_files) or 'none'})")


class DataDirWriter:
  """Accumulates tokenized documents and writes the store, index, ids and manifest."""

  def __init__(self, out_dir):
    self.out_dir = out_dir
    self.tokens = store.StoreWriter(out_dir)
    self.cols = collections.defaultdict(list)
    self.bounds, self.no_loss, self.doc_ids, self.sources = [], [], [], {}

  def add(self, source, doc_id, tokens, bound_pos=(), bound_level=(), no_loss=(), nbytes=0):
    shard, offset = self.tokens.add(tokens)
    for name, value in (("shard", shard), ("offset", offset), ("length", len(tokens)),
                        ("source", self.sources.setdefault(source, len(self.sources))),
                        ("nbytes", nbytes), ("id", doc_id)):
      self.cols[name].append(value)
    self.bounds.append((np.asarray(bound_pos, np.int32), np.asarray(bound_level, np.int8)))
    self.no_loss.append(np.asarray(no_loss, np.int32).reshape(-1, 2))
    self.doc_ids.append(doc_id)

  def finish(self, report, special, vocab_size, model_proto=None, val_fraction=0.01):
    self.tokens.close()
    source = np.array(self.cols["source"], np.int32)
    split = np.array([store.VAL if heldout(s, i, val_fraction) else store.TRAIN
                      for s, i in zip(self.cols["source"], self.doc_ids)], np.uint8)
    for s in range(len(self.sources)):
      members = np.flatnonzero(source == s)
      if len(members) >= 2 and not (split[members] == store.VAL).any():
        split[members[-1]] = store.VAL  # every source with 2+ documents holds one out
      if len(members) and (split[members] == store.VAL).all():
        split[members[0]] = store.TRAIN
    index = store.DocIndex(
        shard=np.array(self.cols["shard"], np.int32),
        offset=np.array(self.cols["offset"], np.int64),
        length=np.array(self.cols["length"], np.int32), source=source, split=split,
        nbytes=np.array(self.cols["nbytes"], np.int64),
        bound_ptr=_ptr([len(p) for p, _ in self.bounds]),
        bound_pos=_cat([p for p, _ in self.bounds], np.int32),
        bound_level=_cat([lvl for _, lvl in self.bounds], np.int8),
        nolos_ptr=_ptr([len(x) for x in self.no_loss]),
        nolos_start=_cat([x[:, 0] for x in self.no_loss], np.int32),
        nolos_end=_cat([x[:, 1] for x in self.no_loss], np.int32),
        sources=list(self.sources))
    manifest = _manifest(index, report, special, vocab_size)
    join = lambda name: io.join(self.out_dir, name)
    io.write_bytes(join("index.npz"), index.to_bytes())
    io.write_bytes(join("doc_ids.json"), json.dumps(self.doc_ids).encode())
    if model_proto is not None:
      io.write_bytes(join("tokenizer.model"), model_proto)
    io.write_bytes(join("manifest.json"), json.dumps(manifest, indent=1).encode())
    return manifest


def _ptr(counts):
  return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)


def _cat(arrays, dtype):
  return np.concatenate(arrays).astype(dtype) if arrays else np.zeros(0, dtype)


def _manifest(index, report, special, vocab_size):
  per_source = {}
  for s, name in enumerate(index.sources):
    mine = index.source == s
    val = mine & (index.split == store.VAL)
    per_source[name] = {
        "documents": int(mine.sum()), "tokens": int(index.length[mine].sum()),
        "heldout_documents": int(val.sum()), "heldout_tokens": int(index.length[val].sum()),
        "chat_documents": int((mine & index.is_chat).sum())}
  return {
      "sources": per_source,
      "rejected": dict(report.rejected),
      "rejected_examples": dict(report.examples),
      "skipped_files": dict(report.skipped_files),
      "vocab_size": vocab_size,
      "special_ids": dict(vars(special)),
      "tokenizer": "tokenizer.model",
  }

"""Raw files -> document dicts for `maxlm prepare`, counting what is rejected and why.

Reads JSON Lines (`text` or chat `messages`, optional `id` and `source`), plain text, markdown
and code files, and files matching an `as_text` glob as plain text, from the files walk.py
yields. Each document gets a `kind` and `kind_from` (quality/kinds.py: a record's `kind`, a
path-like field with a code suffix, a programming `lang`, the file's suffix; else `web` for a
JSON Lines text record, to be refined by the quality steps' content check). Each rejected
document is counted in a `Report` by reason (non_utf8, empty, malformed_json, too_deep (JSON
nested deeper than the parser goes), bad_source (a `source` that is not a string, or is
whitespace only), bad_id (an `id` neither a string nor an integer), missing_text, bad_messages,
bad_unicode) with a few examples (all with --verbose), and passed to its `listener` (prepare's
--rejected list); the Report also holds walk.py's skipped counts and renamed ids. A file whose
stem would name its records' source but is blank ('   .jsonl') is refused in one line
(walk.source_name), as is a blank --as-text glob.

Two choices on bad input:
- Text, an id or a source holding a lone UTF-16 surrogate (JSON such as "\\ud800", which is
  not valid Unicode and cannot be encoded) drops the document, counted as `bad_unicode`; it is
  not repaired, since any repair changes the text silently.
- A document id seen before (in any file) is renamed: the second "x" becomes "x#2", the third
  "x#3" (skipping names already taken), counted in the manifest's `renamed_ids` with examples
  naming where. The held-out split is keyed on the original id (`split_id`), so copies of a
  document in one source stay on the same side of the split. No document is dropped for its id.
"""

import collections
import fnmatch
import json
import os

import numpy as np
import xxhash

from maxlm import MaxlmError
from maxlm.data import pairs, sections, tokenizer, walk
from maxlm.data.quality import kinds

TEXT_SUFFIXES = frozenset(".txt .md .markdown .rst .text".split())
JSONL_SUFFIXES = frozenset((".jsonl",))
REASONS = ("non_utf8", "empty", "malformed_json", "too_deep", "bad_source", "bad_id",
           "missing_text", "bad_messages", "bad_unicode")
_EXAMPLES = 5
_FIELDS_SHOWN = 8
ID_FIELDS = ("path", "filename", "url")  # a record without an `id` is named by the first


class Report:
  """Counts of rejected documents and skipped files per reason, renamed ids, with examples (a
  few, or all with `verbose`)."""

  def __init__(self, verbose=False, as_text=()):
    self.limit = None if verbose else _EXAMPLES
    self.as_text = tuple(map(_glob, as_text))  # globs of other files to read as text
    self.funnel = self.quality = None  # set when the quality steps ran
    self.rejected = collections.Counter({r: 0 for r in REASONS})
    self.examples = collections.defaultdict(list)
    self.skipped = collections.Counter({r: 0 for r in walk.SKIP_REASONS})
    self.skipped_examples = collections.defaultdict(list)
    self.skipped_files = collections.Counter()
    self.skipped_file_examples = collections.defaultdict(list)
    self.renamed, self.renamed_examples = 0, []
    self.pair_rejected = collections.Counter({r: 0 for r in pairs.REASONS})  # pairs.py
    self.pair_examples = collections.defaultdict(list)
    self.prompt_rejected = collections.Counter({r: 0 for r in pairs.REASONS[:2]})
    self.truncated_pairs = 0
    self.listener = None  # called (reason, where) for each rejected document (--rejected)

  def _note(self, examples, where):
    if self.limit is None or len(examples) < self.limit:
      examples.append(where)

  def reject(self, reason, where):
    self.rejected[reason] += 1
    self._note(self.examples[reason], where)
    if self.listener is not None:
      self.listener(reason, where)

  def reject_pair(self, reason, where, prompt=False, listen=True):
    (self.prompt_rejected if prompt else self.pair_rejected)[reason] += 1
    self._note(self.pair_examples[reason], where)
    if listen and self.listener is not None:
      self.listener(reason, where)

  def skip(self, reason, where):
    self.skipped[reason] += 1
    self._note(self.skipped_examples[reason], where)

  def skip_file(self, suffix, where):
    self.skipped_files[suffix] += 1
    self._note(self.skipped_file_examples[suffix], where)

  def rename(self, what):
    self.renamed += 1
    self._note(self.renamed_examples, what)


def _glob(given):
  if not given.strip():
    raise MaxlmError(f"--as-text {given!r} is blank; give a glob such as 'LICENSE*' or '*.1'")
  return given


def _kind(path, as_text=()):
  name = os.path.basename(path)
  suffix = os.path.splitext(name)[1].lower()
  if suffix in JSONL_SUFFIXES:
    return "jsonl"
  if suffix in sections.CODE_SUFFIXES:
    return "code"
  if suffix in TEXT_SUFFIXES or name in ("METADATA", "README", "LICENSE"):
    return "prose"
  if as_text and text_glob(path, as_text):
    return "prose"
  return None


def text_glob(path, globs):
  """Whether a glob matches the file's name or the end of its path: `LICENSE*`, `*.1`,
  `licenses/*` (for any folder named licenses), `*` (everything)."""
  parts = walk.display(path).replace(os.sep, "/").split("/")
  tails = ["/".join(parts[i:]) for i in range(len(parts) - 1, -1, -1)]
  return any(fnmatch.fnmatchcase(tail, glob) for glob in globs for tail in tails)


def iter_documents(inputs, report):
  """Yields dicts {source, id, where, kind, text | messages} and counts what it rejects."""
  def kind_of(path):
    return _kind(path, report.as_text)
  for path, shown, source in walk.iter_files(inputs, report, kind_of):
    kind = kind_of(path) or "prose"
    if kind == "jsonl":
      yield from _jsonl_documents(path, shown, report)
      continue
    data = walk.read(path, shown, report)
    if data is None:
      continue
    text = _decode(data, shown, report)
    if text is not None and _nonblank(text, shown, report):
      yield {"source": source, "id": shown, "where": shown, "kind": kind, "kind_from": "suffix",
             "text": text}


def _jsonl_documents(path, shown, report):
  """A JSON Lines file's documents, read a line at a time (memory stays one line)."""
  name = os.path.basename(shown)
  for number, line in enumerate(walk.read_lines(path, shown, report), 1):
    if line.strip():
      doc = _parse_line(line, f"{shown}:{number}", report)
      if doc is not None:
        if "source" not in doc:
          doc["source"] = walk.source_name(os.path.splitext(name)[0], shown)
        doc.setdefault("id", f"{name}:{number}")
        yield {**doc, "where": f"{shown}:{number}"}


def unique_ids(docs, report):
  """Renames a repeated id "x" to "x#2", "x#3"... (counted); `split_id` keeps the original.
  The ids seen are kept as 64-bit hashes in a numpy table (~32 bytes a document, not the ~240
  of a Python set of strings), so a corpus of any size fits."""
  seen, next_n = _IdSet(), {}
  for doc in docs:
    doc_id = doc["id"]
    if doc_id in seen:
      n = next_n.get(doc_id, 2)
      while f"{doc_id}#{n}" in seen:
        n += 1
      next_n[doc_id] = n + 1
      doc = {**doc, "id": f"{doc_id}#{n}", "split_id": doc_id}
      report.rename(f"{doc_id!r} at {doc['where']} -> {doc['id']!r}")
    seen.add(doc["id"])
    yield doc


class _IdSet:
  """A set of strings as their XXH3-64 hashes (a collision renames an id it need not have)."""

  def __init__(self):
    from maxlm.data.quality.minhash import KeyTable
    self.table = KeyTable()

  @staticmethod
  def _key(text):
    return np.array([xxhash.xxh3_64_intdigest(text.encode("utf-8", "surrogatepass")) | 1],
                    np.uint64)

  def __contains__(self, text):
    return int(self.table.get(self._key(text))[0]) >= 0

  def add(self, text):
    self.table.put(self._key(text), 0)


def _encodable(*texts):
  try:
    for text in texts:
      text.encode("utf-8")
  except UnicodeEncodeError:
    return False
  return True


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


def _id_and_source(record, where, report):
  """{id, source} given by the record (a missing or empty one is left to the defaults; an id
  missing is taken from a `path`, `filename` or `url` string when there is one), or
  None when one is unusable: a source must be a string (a number or a list would silently
  become a source name) and not whitespace only ("   " would name a source no one can tell
  apart or pass to --lang SOURCE=), an id a string or an integer (records are often numbered)."""
  doc = {}
  for key, reason, ok in (("source", "bad_source", (str,)), ("id", "bad_id", (str, int))):
    value = record.get(key)
    if value is None or value == "":
      continue
    if not isinstance(value, ok) or isinstance(value, bool) or (key == "source"
                                                                 and not value.strip()):
      report.reject(reason, where)
      return None
    doc[key] = str(value)
  if "id" not in doc:
    named = next((record[k] for k in ID_FIELDS if isinstance(record.get(k), str)
                  and record[k].strip()), None)
    if named is not None:
      doc["id"] = named
  return doc


def _parse_line(line, where, report):
  text = _decode(line, where, report)
  if text is None:
    return None
  try:
    record = json.loads(text[1:] if text.startswith("\ufeff") else text)  # a BOM: Windows tools
  except ValueError:  # not JSON, or a number of over 4300 digits (Python's limit to read one)
    report.reject("malformed_json", where)
    return None
  except RecursionError:  # valid JSON nested deeper than the parser goes (~1000 levels)
    report.reject("too_deep", where)
    return None
  if not isinstance(record, dict):
    report.reject("malformed_json", where)
    return None
  doc = _id_and_source(record, where, report)
  if doc is None:
    return None
  if not _encodable(*doc.values()):
    report.reject("bad_unicode", where)
    return None
  if pairs.is_pair(record) or pairs.is_prompt(record):
    kind = "pair" if pairs.is_pair(record) else "prompt"
    fields, reason = (pairs.parse_pair if kind == "pair" else pairs.parse_prompt)(record)
    if fields is None:
      report.reject_pair(reason, where, prompt=kind == "prompt")
      return None
    if not _encodable(*(pairs.texts(fields) if kind == "pair" else
                        [pairs.prompt_text(fields["prompt"]), fields["gold"]])):
      report.reject("bad_unicode", where)
      return None
    return {**doc, **fields}
  if "messages" in record and "text" not in record:
    messages = record["messages"]
    if not (isinstance(messages, list) and messages and all(
        isinstance(m, dict) and m.get("role") in tokenizer.ROLES
        and isinstance(m.get("content"), str) for m in messages)):
      report.reject("bad_messages", where)
      return None
    if not _encodable(*(m["content"] for m in messages)):
      report.reject("bad_unicode", where)
      return None
    if not any(m["content"].strip() for m in messages):
      report.reject("empty", where)
      return None
    return {**doc, "kind": "chat", "messages": messages}
  if not isinstance(record.get("text"), str):
    fields = ", ".join(map(repr, sorted(record)[:_FIELDS_SHOWN])) or "none"
    report.reject("missing_text", f"{where} (a `text` string or chat `messages` needed; its "
                                  f"fields: {fields})")
    return None
  if not _encodable(record["text"]):
    report.reject("bad_unicode", where)
    return None
  if not _nonblank(record["text"], where, report):
    return None
  kind, kind_from = kinds.of_record(record)
  return {**doc, "kind": kind or "web", "kind_from": kind_from or "default",
          "text": record["text"]}

"""`maxlm prepare`: raw documents -> tokenizer, token store, doc index, manifest.

The files to read and what is skipped are walk.py's; turning them into documents and what is
rejected (with the two choices on bad input: a lone surrogate drops the document as
`bad_unicode`, a repeated id is renamed "x#2" and counted) is documents.py's; writing the data
dir whole or not at all is datadir.py's. Bad input never raises: it is counted by reason. An
input, `--out` or `--tokenizer` that cannot be used is one clear error, before any tokenizing.
Tokenization runs on all cores: each document is split at its section boundaries and the blocks
are encoded separately, so the boundaries are exact token offsets.
"""

import collections
import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import tempfile
import typing

import numpy as np
import tqdm

from maxlm import MaxlmError
from maxlm.data import (datadir, index_files, pairs, quality as quality_lib, sections, store,
                        tokenizer, walk, workers as workers_lib)
from maxlm.data.quality import engine as quality_engine, funnel as funnel_lib, select
from maxlm.data.documents import REASONS, Report, iter_documents, unique_ids  # noqa: F401


def training_sentences(docs, max_chars=40_000_000):
  """Paragraph-sized strings for the tokenizer trainer, from the first `max_chars` of text."""
  seen = 0
  for doc in docs:
    texts = ([m["content"] for m in doc["messages"]] if doc["kind"] == "chat" else
             pairs.texts(doc) if doc["kind"] == "pair" else
             [pairs.prompt_text(doc["prompt"])] if doc["kind"] == "prompt" else [doc["text"]])
    for text in texts:
      for block, _ in sections.split(text, "code" if doc["kind"] == "code" else "prose"):
        for piece in (block[i:i + 8000] for i in range(0, len(block), 8000)):
          if piece.strip():
            yield piece
            seen += len(piece)
      if seen >= max_chars:
        return


PROMPTS = "prompts.jsonl"  # the RL prompts {id, source, prompt, gold} (pairs.py)
_worker = None  # this tokenize worker's _WorkerState, set by _init_worker as the pool starts it


class _WorkerState(typing.NamedTuple):
  sp: object  # the SentencePiece processor
  max_pair_len: int


def _init_worker(model_proto, max_pair_len):
  global _worker
  _worker = _WorkerState(tokenizer.load(model_proto), int(max_pair_len))


class Encoded(typing.NamedTuple):
  """One input document after a worker: `kind` says which other fields hold it.

  document: `record`, DataDirWriter.add's arguments (source, id, tokens, bound_pos,
  bound_level, no-loss intervals, utf8 bytes, split id, language probability); pair: `record`
  too, with `pair` (prompt, chosen lengths) and `truncated` (whether the prompt was cut);
  prompt: `prompt`, the RL prompt's {id, source, prompt, gold}; rejected_pair: `reason`, and
  `doc` (its source, id, where and utf8 bytes: {source, id, where, nbytes})."""
  kind: str  # document | pair | prompt | rejected_pair
  record: tuple = ()
  pair: tuple = (0, 0)
  truncated: bool = False
  prompt: dict | None = None
  reason: str = ""
  doc: dict | None = None


def encode_document(doc):
  """The Encoded form of one document, in a worker started by _init_worker."""
  if doc["kind"] == "prompt":
    return Encoded("prompt", prompt={"id": doc["id"], "source": doc["source"],
                                     "prompt": doc["prompt"], "gold": doc["gold"]})
  if doc["kind"] == "pair":
    tokens, pc, truncated = pairs.encode(_worker.sp, doc, _worker.max_pair_len)
    nbytes = sum(len(t.encode()) for t in pairs.texts(doc))
    if tokens is None:
      return Encoded("rejected_pair", reason=pc, doc={
          "where": doc["where"], "id": doc["id"], "source": doc["source"], "nbytes": nbytes})
    return Encoded("pair", pair=pc, truncated=truncated, record=(
        doc["source"], doc["id"], tokens, (), (), np.zeros((0, 2), np.int32), nbytes,
        doc.get("split_id"), doc.get("lang_score", float("nan"))))
  return Encoded("document", record=(doc["source"], doc["id"], *_encode(doc),
                                     doc.get("split_id"), doc.get("lang_score", float("nan"))))


def _encode(doc):
  if doc["kind"] == "chat":
    return _encode_chat(doc["messages"])
  blocks = sections.split(doc["text"], doc["kind"])
  ids = _worker.sp.encode([b for b, _ in blocks])
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
    header = [_worker.sp.piece_to_id(f"<|{m['role']}|>")] + _worker.sp.encode("\n")
    body = _worker.sp.encode(m["content"]) + [_worker.sp.piece_to_id(tokenizer.CHAT_END)]
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


@dataclasses.dataclass(frozen=True)
class Options:
  """How `prepare` runs (the `maxlm prepare` flags).

  tokenizer_file: a SentencePiece model to use (None: train one of `vocab_size`). quality: a
  `quality.QualityConfig` to filter and deduplicate with (None: keep every usable document, as
  `quality.OFF` does). rejected: a JSON Lines path listing every rejected document (those
  rejected while reading, under step `input`, too). engine: "local" (a process pool) or
  "datatrove" (its LocalPipelineExecutor, `tasks` tasks on `workers` processes;
  `quality.engine`) for the per-document quality work; inspect_dir: where its tasks' records
  are, or go (default: a temporary folder). as_text: globs of files to read as text that
  prepare would otherwise skip (`documents.text_glob`). max_pair_len: the most row positions a
  preference pair may fill (pairs.py: longer prompts are cut from the left). strict: a source
  the funnel warns about (quality/funnel.py `warnings`) is an error, raised before tokenizing;
  otherwise each warning is logged and kept in the manifest."""
  vocab_size: int = 8192
  tokenizer_file: str | None = None
  val_fraction: float = 0.01
  workers: int | None = None  # None: as many as fit (workers.count)
  progress: bool = True
  overwrite: bool = False
  verbose: bool = False
  quality: quality_lib.QualityConfig | None = None
  rejected: str | None = None
  engine: str = "local"
  tasks: int | None = None
  inspect_dir: str | None = None
  as_text: tuple = ()
  max_pair_len: int = pairs.MAX_PAIR_LEN
  strict: bool = False


def prepare(inputs, out_dir, options=Options(), log=print):
  """Runs the whole preparation as `options` (an Options) say and returns the manifest dict.

  Inputs, the tokenizer file and `out_dir` are checked first; the data dir appears (or replaces
  an old one, with `overwrite`) only once complete."""
  report = Report(options.verbose, options.as_text)
  walk.check_inputs(inputs)
  model_proto = _read_tokenizer(options.tokenizer_file) if options.tokenizer_file else None
  staging = datadir.Staging(out_dir, options.overwrite, log)
  workers = workers_lib.count(options.workers, log)
  spill, listed = None, funnel_lib.Rejected(None)
  try:
    listed = funnel_lib.Rejected(options.rejected)
    report.listener = listed.write_input
    if options.quality is not None:
      spill_dir = os.path.dirname(str(staging.dir)) if staging.local else None
      spill, report.funnel = _select(inputs, report, options.quality, workers,
                                     options.progress, listed, spill_dir, options.engine,
                                     options.tasks, options.inspect_dir)
      report.quality = dataclasses.asdict(options.quality)
      _warn(report.funnel, options.strict, log, options.quality)
    report.rejected_list = listed
    manifest = _prepare(inputs, staging, report, options.vocab_size, model_proto,
                        options.val_fraction, workers, options.progress, spill,
                        options.max_pair_len)
  except BaseException:
    staging.abort()
    listed.discard()
    raise
  finally:
    if spill is not None:
      os.unlink(spill)
  listed.close()
  return manifest


def _warn(funnel, strict, log, quality):
  """The funnel's warnings (quality/funnel.py), and a `--kind` or `--lang SOURCE=` (or their
  `kinds:` / `lang_by_source:` keys) naming no source, logged, or with `strict` the first as an
  error. A warning, not an error up front: the sources are known only once the input is read
  (records name their own); the warning comes after the selection pass, before tokenizing."""
  known = ", ".join(funnel.sources) or "none"
  named = [(f"--kind {name}={kind}", name) for name, kind in quality.kinds.items()]
  named += [(f"--lang {name}={','.join(codes)}", name)
            for name, codes in quality.lang_by_source.items()]
  funnel.notes = [f"{flag}: no source is named {name!r} (the sources: {known})"
                  for flag, name in named if name not in funnel.sources]
  found = funnel.as_json()["warnings"]
  if strict and found:
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    raise MaxlmError(f"--strict: {found[0]}{more}")
  for line in found:
    log(f"warning: {line}")


def _select(inputs, report, quality, workers, progress, rejected, spill_dir, engine, tasks,
            inspect_dir):
  docs = unique_ids(iter_documents(inputs, report), report)
  inspector = quality_lib.Inspector(quality)
  if engine == "local":
    return select.run(docs, inspector, workers, progress, rejected, spill_dir)
  work = inspect_dir or tempfile.mkdtemp(prefix="maxlm-prepare-engine-", dir=spill_dir)
  try:
    tasks = tasks or workers
    quality_engine.run_datatrove(inputs, inspector, work, tasks, workers,
                                 report.as_text)
    return select.run(docs, inspector, workers, progress, rejected, spill_dir,
                      inspected=quality_engine.merged(docs, work, tasks, inspector,
                                                      report.as_text))
  finally:
    if inspect_dir is None:
      shutil.rmtree(work, ignore_errors=True)


def _prepare(inputs, staging, report, vocab_size, model_proto, val_fraction, workers, progress,
             spill, max_pair_len):
  if model_proto is None:
    first_pass, seen = Report(as_text=report.as_text), []
    kept = select.read_spill(spill) if spill else iter_documents(inputs, first_pass)
    docs = (seen.append(1) or d for d in kept)
    try:
      model_proto = tokenizer.train(training_sentences(docs), vocab_size,
                                    num_threads=os.cpu_count() or 1)
    except RuntimeError as e:
      if not seen:
        raise _no_documents(inputs, report if spill else first_pass) from None
      raise MaxlmError(tokenizer.training_failure(e, vocab_size)) from None
  sp = tokenizer.load(model_proto)
  special = tokenizer.special_ids(sp)

  writer = DataDirWriter(staging)
  with workers_lib.pool(workers, _init_worker, (model_proto, max_pair_len)) as pool:
    docs = (select.read_spill(spill) if spill else
            unique_ids(iter_documents(inputs, report), report))
    encoded = select.bounded_imap(pool, encode_document, docs)
    for done in tqdm.tqdm(encoded, desc="tokenize", unit="doc", disable=not progress):
      if done.kind == "document":
        writer.add(*done.record)
      elif done.kind == "pair":
        report.truncated_pairs += done.truncated
        writer.add(*done.record, pair=done.pair)
      elif done.kind == "prompt":
        writer.prompts.append(done.prompt)
      else:
        _reject_pair(report, done)
  if not writer.doc_ids and not writer.prompts:
    raise _no_documents(inputs, report)
  return writer.finish(report, special, sp.vocab_size(), model_proto, val_fraction)


def _reject_pair(report, done):
  """Counts and lists a preference pair too long to fit (an Encoded of kind rejected_pair)."""
  report.reject_pair(done.reason, done.doc["where"], listen=False)
  if report.funnel is not None:
    report.funnel.remove_kept(done.doc["source"], done.doc["nbytes"], "over_long", done.reason)
  report.rejected_list.write(done.doc, "over_long" if report.funnel is not None else "input",
                             done.reason)


def _read_tokenizer(path):
  try:
    proto = pathlib.Path(path).read_bytes()
  except FileNotFoundError:
    raise MaxlmError(f"--tokenizer {path}: not found") from None
  except OSError as e:
    raise MaxlmError(f"--tokenizer {path}: cannot be read ({e.strerror})") from None
  try:
    sp = tokenizer.load(proto)
  except RuntimeError:
    raise MaxlmError(f"--tokenizer {path} is not a SentencePiece model") from None
  try:
    tokenizer.special_ids(sp)
  except ValueError as e:
    raise MaxlmError(f"--tokenizer {path}: {e}") from None
  return proto


def _no_documents(inputs, report):
  removed = ""
  if report.funnel is not None and report.funnel.input[0]:
    rules = {k: v[0] for k, v in report.funnel.rules.items() if v[0]}
    removed = (f"; the quality steps removed all {report.funnel.input[0]:,}: {rules} (see "
               "docs/data.md; --filters off --dedup off --lang any keeps everything)")
  return MaxlmError(f"no usable documents in {', '.join(map(str, inputs))} "
                    f"(rejected: {dict(+report.rejected) or 'none'}; "
                    f"skipped: {dict(+report.skipped) or 'none'}; "
                    f"skipped files: {dict(report.skipped_files) or 'none'}{removed})"
                    + ("; --as-text GLOB reads skipped files as text (docs/data.md)"
                       if report.skipped_files else ""))


class DataDirWriter:
  """Accumulates tokenized documents and writes the store, index, ids and manifest, through a
  datadir.Staging (made here from a path, for tests and tools)."""

  def __init__(self, out, overwrite=False):
    self.staging = out if isinstance(out, datadir.Staging) else datadir.Staging(out, overwrite)
    self.tokens = store.StoreWriter(self.staging)
    self.cols = collections.defaultdict(list)
    self.bounds, self.no_loss, self.doc_ids, self.sources = [], [], [], {}
    self.split_ids, self.pairs, self.prompts = [], [], []

  def add(self, source, doc_id, tokens, bound_pos=(), bound_level=(), no_loss=(), nbytes=0,
          split_id=None, lang_score=float("nan"), pair=(0, 0)):
    shard, offset = self.tokens.add(tokens)
    self.cols["lang_score"].append(lang_score)
    for name, value in (("shard", shard), ("offset", offset), ("length", len(tokens)),
                        ("source", self.sources.setdefault(source, len(self.sources))),
                        ("nbytes", nbytes), ("id", doc_id)):
      self.cols[name].append(value)
    self.bounds.append((np.asarray(bound_pos, np.int32), np.asarray(bound_level, np.int8)))
    self.no_loss.append(np.asarray(no_loss, np.int32).reshape(-1, 2))
    self.doc_ids.append(doc_id)
    self.split_ids.append(doc_id if split_id is None else split_id)
    self.pairs.append(pair)

  def finish(self, report, special, vocab_size, model_proto=None, val_fraction=0.01):
    """Writes the rest, manifest.json last, and puts the data dir in place; the manifest."""
    try:
      return self._finish(report, special, vocab_size, model_proto, val_fraction)
    except BaseException:
      self.staging.abort()
      raise

  def _finish(self, report, special, vocab_size, model_proto, val_fraction):
    self.tokens.close()
    source = np.array(self.cols["source"], np.int32)
    split = np.array([store.VAL if heldout(s, i, val_fraction) else store.TRAIN
                      for s, i in zip(self.cols["source"], self.split_ids)], np.uint8)
    for s in range(len(self.sources) if val_fraction > 0 else 0):
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
        sources=list(self.sources), lang_score=np.array(self.cols["lang_score"], np.float16),
        pair=np.array(self.pairs, np.int32).reshape(-1, 2))
    index_files.write(self.staging, index.arrays(), index.sources, self.doc_ids)
    if self.prompts:
      self.staging.write(PROMPTS, "".join(json.dumps(p) + "\n" for p in self.prompts).encode())
    if model_proto is not None:
      self.staging.write("tokenizer.model", model_proto)
    listed = getattr(report, "rejected_list", None)
    if listed is not None:
      self.staging.write(store.REMOVED, listed.lines())
    return self.staging.commit(_manifest(index, report, special, vocab_size))


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
        "chat_documents": int((mine & index.is_chat).sum()),
        "pairs": int((mine & (index.pair[:, 0] > 0)).sum())}
  return {
      "sources": per_source,
      "rejected": dict(report.rejected),
      "rejected_examples": dict(report.examples),
      "skipped_files": dict(report.skipped_files),
      "skipped_file_examples": dict(report.skipped_file_examples),
      "as_text": list(report.as_text),
      "skipped": dict(report.skipped),
      "skipped_examples": dict(report.skipped_examples),
      "renamed_ids": report.renamed,
      "renamed_id_examples": report.renamed_examples,
      **_pair_counts(report),
      **_funnel(report, index),
      "vocab_size": vocab_size,
      "special_ids": dict(vars(special)),
      "tokenizer": "tokenizer.model",
  }


def _pair_counts(report):
  """Preference-pair and RL-prompt rejects per reason, and the pairs whose prompt was cut."""
  if not hasattr(report, "pair_rejected"):
    return {}
  return {"rejected_pairs": dict(report.pair_rejected),
          "rejected_prompts": dict(report.prompt_rejected),
          "rejected_pair_examples": dict(report.pair_examples),
          "truncated_pairs": report.truncated_pairs}


def _funnel(report, index):
  """The quality steps' config and funnel (with the kept tokens), when they ran."""
  if getattr(report, "funnel", None) is None:
    return {}
  report.funnel.kept_tokens = int(index.length.sum())
  report.funnel.source_tokens = {name: int(index.length[index.source == s].sum())
                                 for s, name in enumerate(index.sources)}
  return {"quality": report.quality, "funnel": report.funnel.as_json()}

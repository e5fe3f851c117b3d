"""The selection pass of `maxlm prepare`: documents in, the kept ones spilled to disk.

1. Documents stream in input order from the walk; worker processes run the `Inspector`
   (steps 1-5 and the dedup keys) with an ordered `imap`, so the main process sees them in
   input order whatever the worker count.
2. The main process decides exact and near duplicates in that order (`minhash.Deduper`),
   counts every document in the `Funnel` and, with `--rejected`, writes a line per removal.
3. Each kept document (its text cleaned) is appended to a JSON Lines spill file next to the
   output; the tokenizer is trained on it and the tokenize pass reads it back.
Memory stays bounded whatever the input size: documents are streamed, and only the dedup key
tables and kept signatures grow (~900 bytes per kept document).
"""

import contextlib
import itertools
import json
import os
import tempfile

import tqdm

from maxlm import MaxlmError
from maxlm.data import workers as workers_lib
from maxlm.data.quality import funnel as funnel_lib

_INSPECT = None


def _init(inspector):
  global _INSPECT
  _INSPECT = inspector


def _inspect(doc):
  return _INSPECT(doc)


def bounded_imap(pool, fn, items, window=2048, chunksize=16):
  """`pool.imap(fn, items)` in input order, reading at most `window` items ahead: the pool's
  own imap queues the whole input at once, which would hold a corpus in memory."""
  items = iter(items)
  while True:
    batch = list(itertools.islice(items, window))
    if not batch:
      return
    yield from pool.imap(fn, batch, chunksize=chunksize)


def run(docs, inspector, workers=None, progress=False, rejected=None, spill_dir=None,
        inspected=None):
  """(spill path, Funnel): the kept documents of `docs`, in order, and the counts.
  rejected: a `funnel.Rejected` (left open) or a path (or None); inspected: the documents
  already inspected, with their verdicts (by `engine.merged`)."""
  from maxlm.data.quality import minhash
  config = inspector.config
  funnel = funnel_lib.Funnel()
  dedup = minhash.Deduper(config.near_threshold, config.num_perm)
  owned = not isinstance(rejected, funnel_lib.Rejected)
  rejected = funnel_lib.Rejected(rejected) if owned else rejected
  fd, spill = tempfile.mkstemp(prefix="maxlm-kept-", suffix=".jsonl", dir=spill_dir)
  ids = []  # kept documents' ids by their number, to name what a duplicate duplicates
  try:
    with os.fdopen(fd, "w") as out, contextlib.ExitStack() as stack:
      stream = inspected
      if stream is None:  # inspect here, on a pool of worker processes
        pool = stack.enter_context(workers_lib.pool(workers or workers_lib.count(),
                                                    _init, (inspector,)))
        stream = bounded_imap(pool, _inspect, docs)
      for doc in tqdm.tqdm(stream, desc="filter", unit="doc", disable=not progress):
        verdict = doc.pop("verdict")
        doc["kind"] = verdict.get("kind", doc["kind"])
        doc.pop("kind_from", None)
        count = lambda *a: funnel.count(verdict, *a, source=doc["source"], where=doc["id"])
        if verdict["step"] is not None:
          count()
          rejected.write(doc, verdict["step"], verdict["rule"])
          continue
        if inspector.config.dedup:
          found = dedup.check(len(ids), verdict["exact"], verdict["sig"], verdict["bands"])
          if found is not None:
            kind, earlier = found
            step = f"{kind}_dup"
            count(step, kind)
            rejected.write(doc, step, kind, duplicate_of=ids[earlier])
            continue
        count()
        ids.append(doc["id"])
        doc["lang_score"] = verdict["lang_score"]
        _spill(out, doc, spill)
  except BaseException:
    os.unlink(spill)
    if owned:
      rejected.discard()
    raise
  if owned:
    rejected.close()
  return spill, funnel


def _spill(out, doc, path):
  try:
    out.write(json.dumps(doc, ensure_ascii=False) + "\n")
  except OSError as e:
    raise MaxlmError(f"cannot write the kept documents to {path} ({e.strerror or e}"
                     + (f", errno {e.errno}" if e.errno else "") + "): free space beside "
                     "--out, or choose an --out with room for the corpus") from None


def read_spill(path):
  with open(path) as f:
    for line in f:
      yield json.loads(line)

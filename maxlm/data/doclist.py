"""`maxlm docs DATA_DIR`: the ids of a data dir's documents, so they can be found and passed to
`show-doc` and `trace`.

A kept document's row comes from the doc index (its source, tokens and split: `train` or
`held out`); a removed one's from the data dir's removed.jsonl (the step and rule that removed
it; an input reject has no id, and is listed by where it was read). An id holding a line break
or a tab is shown JSON-quoted in the table, as it is in --json. Data dirs prepared
before removed.jsonl existed list their kept documents only, and say so.
"""

import json
import re

from maxlm import MaxlmError, io
from maxlm.data import store

KEPT, REMOVED = "kept", "removed"


def rows(data_dir, source=None, pattern=None, which=(KEPT, REMOVED)):
  """Yields {id, source, tokens, status} for each document whose source is `source` (any if
  None) and whose id matches the regular expression `pattern` (any if None)."""
  store.load_manifest(data_dir)  # a data dir, and one whose files match their manifest
  match = _matcher(pattern)
  index = store.load_index(data_dir)
  gone = (removed(data_dir) or []) if REMOVED in which or source is not None else []
  known = list(dict.fromkeys([*index.sources, *(r["source"] for r in gone if r["source"])]))
  if source is not None and source not in known:
    raise MaxlmError(f"--source {source!r}: {data_dir} has sources {', '.join(known)}")
  if KEPT in which:
    ids = store.load_doc_ids(data_dir)
    for i in range(len(ids)):
      name = index.sources[index.source[i]]
      if (source is None or name == source) and match(ids[i]):
        yield {"id": ids[i], "source": name, "tokens": int(index.length[i]),
               "status": "held out" if index.split[i] == store.VAL else "train"}
  if REMOVED in which:
    for row in gone:
      name = row["id"] if row["id"] is not None else row.get("where", "?")
      if (source is None or row["source"] == source) and match(name):
        yield {"id": row["id"], **({"where": row["where"]} if row["id"] is None else {}),
               "source": row["source"], "tokens": None,
               "status": f"removed: {row['step']}/{row['rule']}"}


def removed(data_dir):
  """The rows of removed.jsonl, or None for a data dir prepared before it existed."""
  if not has_removed(data_dir):
    return None
  data = io.read_bytes(io.join(data_dir, store.REMOVED))
  return [json.loads(line) for line in data.decode().splitlines() if line]


def has_removed(data_dir):
  """Whether the data dir keeps its removed documents (prepared since removed.jsonl exists)."""
  return io.exists(io.join(data_dir, store.REMOVED))


def removed_row(data_dir, doc_id):
  """The removed.jsonl row of `doc_id`, or None."""
  return next((r for r in removed(data_dir) or () if r["id"] == doc_id), None)


def _matcher(pattern):
  if pattern is None:
    return lambda _: True
  try:
    found = re.compile(pattern).search
  except re.error as e:
    raise MaxlmError(f"--grep {pattern!r}: not a regular expression ({e})") from None
  return lambda doc_id: found(doc_id) is not None


def format_rows(found):
  """Lines of a table: id, source, tokens, status."""
  lines = [f"{'tokens':>9}  {'source':<14} {'status':<34} id"]
  for r in found:
    tokens = f"{r['tokens']:,}" if r["tokens"] is not None else "-"
    name = _shown(r["id"]) if r["id"] is not None else f"(no id: rejected at {r['where']})"
    lines.append(f"{tokens:>9}  {r['source'] or '-':<14} {r['status']:<34} {name}")
  return lines


def _shown(doc_id):
  """An id on one line: one holding a line break or a tab is shown quoted, escaped."""
  return json.dumps(doc_id, ensure_ascii=False) if any(c in doc_id for c in "\n\r\t") \
      else doc_id

"""What will be trained on: a kept document's cleaned text, and how it came from its input.

`kept_text(data_dir, id)` decodes the document's tokens from the data dir (the tokenizer is
lossless, so this is the exact text that was tokenized). `explain(inputs, id, config)` reads
the document from the inputs again and runs the quality steps on it with the data dir's
settings (manifest.json `quality`), so `maxlm show-doc DATA_DIR ID --diff INPUT...` can print
each input line with the rule that removed it, or none. Both back `maxlm show-doc`.
"""

import dataclasses

from maxlm import MaxlmError
from maxlm import io
from maxlm.data import doclist, store, tokenizer
from maxlm.data.quality import Inspector, QualityConfig, lines
from maxlm.typed_yaml import build


def doc_number(data_dir, doc_id):
  ids = store.load_doc_ids(data_dir)
  try:
    return ids.index(doc_id)
  except ValueError:
    gone = doclist.removed_row(data_dir, doc_id)
    if gone is not None:
      raise MaxlmError(f"document {doc_id!r} was removed by {gone['step']}/{gone['rule']}: "
                       f"`maxlm show-doc {data_dir} {doc_id} --diff INPUT...` shows why") from None
    raise MaxlmError(f"{data_dir} holds no document {doc_id!r}: `maxlm docs {data_dir} --grep "
                     "PART` lists the ids") from None


def kept_text(data_dir, doc_id):
  """The kept document's text, decoded from its tokens; a preference pair's prompt, chosen
  and rejected answers are shown one after the other."""
  manifest = store.load_manifest(data_dir)
  number = doc_number(data_dir, doc_id)
  sp = tokenizer.load(io.read_bytes(io.join(data_dir, manifest.get("tokenizer",
                                                                   "tokenizer.model"))))
  tokens = store.TokenStore(data_dir).document(number).tolist()
  return sp.decode(tokens)


def config_of(manifest):
  """The QualityConfig a data dir was prepared with (None: prepared without the steps)."""
  raw = manifest.get("quality")
  return None if raw is None else build(QualityConfig, raw)


def explain(docs, doc_id, config):
  """(kind, kind_from, [(line, rule or None)], verdict) of document `doc_id` among `docs`
  (documents.iter_documents' dicts), as the quality steps with `config` judge it."""
  for doc in docs:
    if doc["id"] != doc_id:
      continue
    inspector = Inspector(dataclasses.replace(config, dedup=False))
    kind, kind_from = inspector.kind_of(doc)
    verdict = inspector(doc)["verdict"]
    text = doc.get("text")
    if text is None:
      return kind, kind_from, [], verdict
    if kind == "web" and config.filters and verdict["step"] not in ("language",):
      judged = lines.explain(text, config.thresholds)[0]
    else:
      judged = [(line, None) for line in text.split("\n")]
    return kind, kind_from, judged, verdict
  raise MaxlmError(f"no document {doc_id!r} in the inputs given")


def format_diff(judged, width=100):
  """Kept lines as '  line', removed lines as '- line' with their rule at the right."""
  out = []
  for line, rule in judged:
    if rule is None:
      out.append(f"  {line}")
    else:
      shown = line if len(line) <= width else line[:width - 3] + "..."
      out.append(f"- {shown:<{width}}  [{rule}]")
  return "\n".join(out)

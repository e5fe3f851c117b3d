"""The funnel: documents and bytes in, removed at each step and by each rule, and kept; in
total and per source.

`Funnel.count(verdict, source)` takes every inspected document in input order (its `verdict`
says where, if anywhere, it was removed); `as_json()` goes into manifest.json as `funnel`,
`table()` prints it, `save_png()` draws it, `warnings()` names the sources that lost much
(`--strict` makes them an error), and `Rejected` writes one JSON line per removed document.
The counts add up by construction, in total and for every source: input = removed at every
step + kept, in documents and in bytes (bytes are UTF-8 bytes of the text; the lines that
line cleaning dropped from a document count under `lines`, by the rule that dropped them).
Tokens: the kept documents' are exact (from the doc index); removed documents are never
tokenized, so the tokens they held are estimated from their bytes at their source's kept
bytes per token (`tokens_est`).
Per source, `kinds` counts the documents of each kind, `kinds_from` where the kinds came from
(`content`: routed to `code` by the content check, with `content_examples`), and
`kept_chars_median` is the median, over the kept documents, of the share of each one's
characters that survived line cleaning.
"""

import collections
import json
import os
import tempfile

import numpy as np

from maxlm import MaxlmError
from maxlm.data.quality import STEPS

LOST_BYTES = 0.5  # a source losing more than this share of its bytes is warned about
KEPT_CHARS = 0.8  # ... or whose kept documents keep less than this on median
SPOOL_BYTES = 64 * 2**20  # the removed list kept in memory up to this, in a temporary file beyond
_BINS = 1000
_EXAMPLES = 5


class _Counts:

  def __init__(self):
    self.input = [0, 0]  # documents, bytes
    self.removed = {step: [0, 0] for step in STEPS}
    self.rules = collections.defaultdict(lambda: [0, 0])
    self.kept = [0, 0]
    self.kept_chars = np.zeros(_BINS + 1, np.int64)  # histogram of kept shares
    self.kinds = collections.Counter()
    self.kinds_from = collections.Counter()
    self.content_examples = []

  def add(self, verdict, step, rule, where):
    self.input[0] += 1
    self.input[1] += verdict["nbytes_in"]
    if "kind" in verdict:
      self.kinds[verdict["kind"]] += 1
      self.kinds_from[verdict["kind_from"]] += 1
      if verdict["kind_from"] == "content" and len(self.content_examples) < _EXAMPLES:
        self.content_examples.append(where)
    nbytes = verdict.get("nbytes_out", verdict["nbytes_in"])
    if nbytes != verdict["nbytes_in"]:
      self.removed["lines"][1] += verdict["nbytes_in"] - nbytes
      left = verdict["nbytes_in"] - nbytes
      for line_rule, n in sorted(verdict.get("line_bytes", {}).items()):
        n = min(n, left)
        self.rules[f"lines/{line_rule}"][1] += n
        left -= n
      if left:
        self.rules["lines/c4_citations_and_spacing"][1] += left
    if step is None:
      self.kept[0] += 1
      self.kept[1] += nbytes
      share = verdict["nchars_out"] / max(verdict["nchars_in"], 1) if "nchars_out" in verdict \
          else 1.0
      self.kept_chars[min(_BINS, int(share * _BINS))] += 1
      return
    for counts in (self.removed[step], self.rules[f"{step}/{rule}"]):
      counts[0] += 1
      counts[1] += nbytes

  def move_kept(self, nbytes, step, rule):
    """A kept document removed after all (an over-long pair at tokenizing)."""
    self.kept[0] -= 1
    self.kept[1] -= nbytes
    self.kept_chars[_BINS] -= 1
    for counts in (self.removed[step], self.rules[f"{step}/{rule}"]):
      counts[0] += 1
      counts[1] += nbytes

  def median_kept_chars(self):
    total = int(self.kept_chars.sum())
    if not total:
      return None
    return float(np.searchsorted(np.cumsum(self.kept_chars), (total + 1) // 2) / _BINS)

  def as_json(self, kept_tokens=None, bytes_per_token=None):
    per = bytes_per_token or (self.kept[1] / kept_tokens if kept_tokens else None)
    est = (lambda b: int(round(b / per))) if per else (lambda b: None)
    out = {"input": {"documents": self.input[0], "bytes": self.input[1],
                     "tokens_est": est(self.input[1])},
           "steps": [{"step": s, "documents": d, "bytes": b, "tokens_est": est(b)}
                     for s, (d, b) in self.removed.items()],
           "rules": {k: {"documents": d, "bytes": b, "tokens_est": est(b)}
                     for k, (d, b) in sorted(self.rules.items())},
           "kept": {"documents": self.kept[0], "bytes": self.kept[1],
                    "tokens": kept_tokens or 0},
           "kept_chars_median": self.median_kept_chars(),
           "kinds": dict(sorted(self.kinds.items())),
           "kinds_from": dict(sorted(self.kinds_from.items()))}
    if self.content_examples:
      out["content_examples"] = list(self.content_examples)
    return out


class Funnel:
  """The counts in total (`total`) and per source (`sources`, in order of appearance)."""

  def __init__(self):
    self.total = _Counts()
    self.sources = {}
    self.kept_tokens = 0
    self.source_tokens = {}  # source -> kept tokens, set once the doc index is written
    self.notes = []  # warnings that are not about one source's losses (e.g. an unknown --kind)

  @property
  def input(self):
    return self.total.input

  @property
  def rules(self):
    return self.total.rules

  def count(self, verdict, step=None, rule=None, source=None, where=None):
    """One document: kept (step None) or removed at `step` by `rule`."""
    step, rule = step or verdict["step"], rule or verdict["rule"]
    self.total.add(verdict, step, rule, where)
    if source is not None:
      self.sources.setdefault(source, _Counts()).add(verdict, step, rule, where)

  def remove_kept(self, source, nbytes, step, rule):
    self.total.move_kept(nbytes, step, rule)
    if source in self.sources:
      self.sources[source].move_kept(nbytes, step, rule)

  def as_json(self):
    out = self.total.as_json(self.kept_tokens)
    per = out["kept"]["bytes"] / self.kept_tokens if self.kept_tokens else None
    out["sources"] = {name: c.as_json(self.source_tokens.get(name), None if
                                      self.source_tokens.get(name) else per)
                      for name, c in self.sources.items()}
    out["warnings"] = self.notes + warnings(out)
    return out


_FIXES = {
    "lines": "if {s} is not web pages, --kind {s}=prose keeps every line (--kind {s}=code "
             "for source code)",
    "language": "--lang {s}=CODES accepts its languages (--lang {s}=any skips language ID), "
                "or --kind {s}=code if it is source code",
    "quality": "if {s} is your own documents, not crawled pages, --kind {s}=prose judges only "
               "their prose and keeps short ones; --kind {s}=code if it is source code; else "
               "--filter THRESHOLD=VALUE loosens the rule (docs/data.md)",
    "quality/prose": "--filter THRESHOLD=VALUE loosens the rule, and `maxlm show-doc` with "
                     "--diff shows a removed document (docs/data.md)",
    "code": "--filter THRESHOLD=VALUE loosens the code rule (docs/data.md)",
    "exact_dup": "it repeats documents (its own or an earlier source's); --dedup off keeps "
                 "copies",
    "over_long": "--max-pair-len N fits longer pairs",
}
_FIXES["repetition"] = _FIXES["quality"]
_FIXES["repetition/prose"] = _FIXES["quality/prose"]
_FIXES["near_dup"] = _FIXES["exact_dup"]


def warnings(funnel):
  """One line per source that lost more than half its bytes, or whose kept documents keep
  under 80% of their characters on median: the source, the rule that removed most of its
  bytes, and the fix."""
  out = []
  for name, c in funnel.get("sources", {}).items():
    total = c["input"]["bytes"]
    lost = 1 - c["kept"]["bytes"] / total if total else 0
    median = c.get("kept_chars_median")
    if lost <= LOST_BYTES and (median is None or median >= KEPT_CHARS):
      continue
    rule, counts = max(c["rules"].items(), key=lambda kv: (kv[1]["bytes"], kv[0]),
                       default=("?", {"bytes": 0}))
    shown = f" (kept documents keep {median:.0%} of their characters on median)" \
        if median is not None and median < KEPT_CHARS else ""
    step = rule.split("/")[0]
    kinds = c.get("kinds") or {"web": 1}
    kind = max(kinds, key=kinds.get)
    fix = _FIXES.get(f"{step}/{kind}") or _FIXES.get(step, "see docs/data.md")
    out.append(f"source {name!r} lost {lost:.0%} of its bytes{shown}, most to {rule} "
               f"({counts['bytes'] / total:.0%}): " + fix.format(s=name))
  return out


def table(funnel, warnings=True):
  """The funnel of a manifest (`funnel` key) as text: one line per step, then per rule."""
  total_docs, total_bytes = funnel["input"]["documents"], funnel["input"]["bytes"]
  pct = lambda n, d: f"{100 * n / d:5.1f}%" if d else "    -"
  lines = [f"{'step':<22}{'documents':>11}{'':>7}{'bytes':>14}{'':>7}",
           f"{'input':<22}{total_docs:>11,}{'':>7}{total_bytes:>14,}"]
  docs, nbytes = total_docs, total_bytes
  for row in funnel["steps"]:
    docs, nbytes = docs - row["documents"], nbytes - row["bytes"]
    if row["documents"] or row["bytes"]:
      lines.append(f"{'- ' + row['step']:<22}{-row['documents']:>11,}"
                   f"{pct(row['documents'], total_docs):>7}{-row['bytes']:>14,}"
                   f"{pct(row['bytes'], total_bytes):>7}")
  kept = funnel["kept"]
  lines.append(f"{'kept':<22}{kept['documents']:>11,}{pct(kept['documents'], total_docs):>7}"
               f"{kept['bytes']:>14,}{pct(kept['bytes'], total_bytes):>7}  "
               f"{kept['tokens']:,} tokens")
  ranked = [(rule, c["documents"]) for rule, c in sorted(
      funnel["rules"].items(), key=lambda kv: (-kv[1]["documents"], kv[0])) if c["documents"]]
  if ranked:
    more = f", and {len(ranked) - 8} more rules (manifest.json: funnel.rules)" \
        if len(ranked) > 8 else ""
    lines.append("removed most by: " + ", ".join(f"{r} {n:,}" for r, n in ranked[:8]) + more)
  lines += _source_rows(funnel.get("sources", {}))
  lines += [f"warning: {w}" for w in funnel.get("warnings", ()) if warnings]
  return "\n".join(lines)


def _source_rows(sources):
  """Per source: its kinds, documents in and kept, bytes kept, the median kept share of
  characters, and the rule that removed most of its bytes."""
  if not sources:
    return []
  rows = [f"{'source':<16}{'kinds':<22}{'documents':>17}{'bytes kept':>11}"
          f"{'chars kept':>11}  removed most bytes by"]
  for name, c in sources.items():
    kinds = ", ".join(f"{k} {n:,}" for k, n in c["kinds"].items())
    docs = f"{c['input']['documents']:,} -> {c['kept']['documents']:,}"
    share = c["kept"]["bytes"] / c["input"]["bytes"] if c["input"]["bytes"] else 0
    median = c.get("kept_chars_median")
    top = max(c["rules"].items(), key=lambda kv: (kv[1]["bytes"], kv[0]), default=None)
    shown = top and top[1]["bytes"] >= 0.01 * c["input"]["bytes"]
    rows.append(f"{name[:15]:<16}{kinds[:21]:<22}{docs:>17}{share:>10.1%} "
                f"{'-' if median is None else f'{median:.0%}':>10}  "
                f"{top[0] if shown else '-'}")
    if c["kinds_from"].get("content"):
      rows.append(f"{'':<16}{c['kinds_from']['content']:,} routed to code by the content check "
                  f"(e.g. {c['content_examples'][0]})")
  return rows


def save_png(funnel, path, title="prepare funnel"):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  names, docs, nbytes = ["input"], [funnel["input"]["documents"]], [funnel["input"]["bytes"]]
  for row in funnel["steps"]:
    names.append(f"after {row['step']}")
    docs.append(docs[-1] - row["documents"])
    nbytes.append(nbytes[-1] - row["bytes"])
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for ax, values, label in ((axes[0], docs, "documents"), (axes[1], nbytes, "bytes")):
    ax.barh(range(len(names))[::-1], values, color="#4878a8")
    ax.set_yticks(range(len(names))[::-1], names)
    ax.set_xlabel(label)
    for y, v in zip(range(len(names))[::-1], values):
      share = v / values[0] if values[0] else 0
      ax.text(v, y, f" {share:.0%}", va="center", fontsize=8)
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


class Rejected:
  """`--rejected FILE.jsonl`: {"id", "source", "step", "rule"[, "duplicate_of"]} per line;
  documents rejected while reading (`empty`, `bad_unicode`, ...: step `input`) have "where"
  instead of an id when their record could not be read. Written whole or not at all: the lines
  go to a temporary file beside it, renamed to `path` by `close()`; `discard()` (prepare
  failed) removes it. A path that is not a regular file (/dev/stdout, a fifo) is written as it
  is. A write that fails (a full disk) is one line naming the file. The same lines are kept
  for the data dir's own removed.jsonl (`lines()`, which `maxlm docs` reads), in memory up to
  SPOOL_BYTES and in a temporary file beyond."""

  def __init__(self, path):
    self.path = path
    self.tmp = f"{path}.tmp-{os.getpid()}" if path else None
    if path and os.path.exists(path) and not os.path.isfile(path):
      self.tmp = path  # /dev/stdout, a fifo: written as it is, never replaced
    self.file = self._do(open, self.tmp, "w") if path else None
    self.kept = tempfile.SpooledTemporaryFile(SPOOL_BYTES, "w+b")

  def lines(self):
    """Every line written so far, as bytes (the data dir's removed.jsonl)."""
    self.kept.seek(0)
    data = self.kept.read()
    self.kept.seek(0, os.SEEK_END)
    return data

  def _line(self, row):
    line = json.dumps(row, ensure_ascii=False) + "\n"
    try:
      self.kept.write(line.encode())
    except OSError as e:
      raise MaxlmError(f"cannot keep the list of removed documents in {tempfile.gettempdir()} "
                       f"({e.strerror or e}); free space there or set TMPDIR") from None
    if self.file is not None:
      self._do(self.file.write, line)

  def _do(self, fn, *args):
    try:
      return fn(*args)
    except OSError as e:
      self.discard()
      raise MaxlmError(f"--rejected {self.path}: cannot write ({e.strerror or e}"
                       + (f", errno {e.errno}" if e.errno else "") + "); free space there "
                       "or write it elsewhere") from None

  def write(self, doc, step, rule, duplicate_of=None):
    row = {"id": doc["id"], "source": doc["source"], "step": step, "rule": rule}
    if duplicate_of is not None:
      row["duplicate_of"] = duplicate_of
    self._line(row)

  def write_input(self, reason, where):
    """A document rejected before the quality steps, by `documents.Report`."""
    self._line({"id": None, "where": where, "source": None, "step": "input", "rule": reason})

  def close(self):
    """Puts the whole list at its path (a no-op after `discard`)."""
    if self.file is not None:
      self._do(self.file.close)
      if self.tmp != self.path:
        self._do(os.replace, self.tmp, self.path)
      self.file = None

  def discard(self):
    self.kept.close()
    if self.file is not None:
      file, self.file = self.file, None
      try:
        file.close()
      except OSError:
        pass
    if self.tmp and self.tmp != self.path and os.path.exists(self.tmp):
      os.remove(self.tmp)

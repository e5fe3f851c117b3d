"""The funnel: documents and bytes in, removed at each step and by each rule, and kept.

`Funnel.count(doc)` takes every inspected document in input order (its `verdict` says where,
if anywhere, it was removed); `as_json()` goes into manifest.json as `funnel`, `table()`
prints it, `save_png()` draws it, and `Rejected` writes one JSON line per removed document.
The counts add up by construction: input = removed at every step + kept, in documents and
in bytes (bytes are UTF-8 bytes of the text; a kept document's dropped lines count under
`lines`).
"""

import collections
import json

from maxlm.data.quality import STEPS


class Funnel:

  def __init__(self):
    self.input = [0, 0]  # documents, bytes
    self.removed = {step: [0, 0] for step in STEPS}
    self.rules = collections.defaultdict(lambda: [0, 0])
    self.kept = [0, 0]
    self.kept_tokens = 0

  def count(self, verdict, step=None, rule=None):
    """One document: kept (step None) or removed at `step` by `rule`. The lines that line
    cleaning dropped from a document it kept count as bytes removed by `lines/c4_lines`."""
    self.input[0] += 1
    self.input[1] += verdict["nbytes_in"]
    nbytes = verdict.get("nbytes_out", verdict["nbytes_in"])
    if nbytes != verdict["nbytes_in"]:
      for counts in (self.removed["lines"], self.rules["lines/c4_lines"]):
        counts[1] += verdict["nbytes_in"] - nbytes
    step, rule = step or verdict["step"], rule or verdict["rule"]
    if step is None:
      self.kept[0] += 1
      self.kept[1] += nbytes
      return
    for counts in (self.removed[step], self.rules[f"{step}/{rule}"]):
      counts[0] += 1
      counts[1] += nbytes

  def as_json(self):
    return {"input": {"documents": self.input[0], "bytes": self.input[1]},
            "steps": [{"step": s, "documents": d, "bytes": b}
                      for s, (d, b) in self.removed.items()],
            "rules": {k: {"documents": d, "bytes": b} for k, (d, b) in sorted(self.rules.items())},
            "kept": {"documents": self.kept[0], "bytes": self.kept[1],
                     "tokens": self.kept_tokens}}


def table(funnel):
  """The funnel of a manifest (`funnel` key) as text: one line per step, then per rule."""
  total_docs, total_bytes = funnel["input"]["documents"], funnel["input"]["bytes"]
  pct = lambda n, d: f"{100 * n / d:5.1f}%" if d else "    -"
  lines = [f"{'step':<22}{'documents':>11}{'':>7}{'bytes':>14}{'':>7}",
           f"{'input':<22}{total_docs:>11,}{'':>7}{total_bytes:>14,}"]
  docs, nbytes = total_docs, total_bytes
  for row in funnel["steps"]:
    docs, nbytes = docs - row["documents"], nbytes - row["bytes"]
    if row["documents"]:
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
  return "\n".join(lines)


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
  """`--rejected FILE.jsonl`: {"id", "source", "step", "rule"[, "duplicate_of"]} per line."""

  def __init__(self, path):
    self.file = open(path, "w") if path else None

  def write(self, doc, step, rule, duplicate_of=None):
    if self.file is None:
      return
    row = {"id": doc["id"], "source": doc["source"], "step": step, "rule": rule}
    if duplicate_of is not None:
      row["duplicate_of"] = duplicate_of
    self.file.write(json.dumps(row, ensure_ascii=False) + "\n")

  def close(self):
    if self.file is not None:
      self.file.close()

"""The embedded demo corpus: text already on any machine with Python, no download.

`prose` is the .md/.rst/.txt files and package METADATA (long descriptions) under the
interpreter's library folders; `code` is the standard library's .py files. Files are taken in
an order fixed by a hash of their relative path until a byte budget is met, so two machines
with the same Python and packages build the same corpus. Each record names its kind (`prose`
or `code`), so prepare never takes the docs for web pages (quality/kinds.py).
"""

import hashlib
import json
import pathlib
import sysconfig

from maxlm import io

_PROSE_SUFFIXES = (".md", ".rst", ".txt")
_MAX_FILE_BYTES = 40_000  # long files would fill the small demo stages with few documents


def _roots():
  paths = sysconfig.get_paths()
  roots = {pathlib.Path(paths[k]).resolve() for k in ("stdlib", "purelib", "platlib")}
  return sorted(r for r in roots if r.is_dir())


def _candidates(kind):
  seen = set()
  for root in _roots():
    for path in root.rglob("*.py" if kind == "code" else "*"):
      if kind == "prose" and not (path.suffix in _PROSE_SUFFIXES or path.name == "METADATA"):
        continue
      if not path.is_file() or path in seen or path.stat().st_size > _MAX_FILE_BYTES:
        continue
      if kind == "code" and "site-packages" in path.parts:
        continue
      seen.add(path)
      rel = f"{root.name}/{path.relative_to(root)}"
      yield hashlib.sha1(rel.encode()).hexdigest(), rel, path


def build(out_dir, bytes_per_source=4_000_000):
  """Writes `code.jsonl` and `prose.jsonl` under out_dir; returns their paths."""
  written = []
  for kind in ("prose", "code"):
    lines, total = [], 0
    for _, rel, path in sorted(_candidates(kind)):
      try:
        text = path.read_text(encoding="utf-8")
      except (UnicodeDecodeError, OSError):
        continue
      if not text.strip():
        continue
      lines.append(json.dumps({"id": rel, "source": kind, "kind": kind, "text": text}))
      total += len(text)
      if total >= bytes_per_source:
        break
    target = io.join(out_dir, f"{kind}.jsonl")
    io.write_bytes(target, ("\n".join(lines) + "\n").encode())
    written.append(target)
  return written

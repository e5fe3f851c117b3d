"""Corpora of real text from this machine, none of it written for maxlm, for the tests and
tools/bench_cleaning.py: rendered man pages (hard-wrapped prose), markdown and reST docs,
Python source as JSON Lines whose ids carry no suffix, web-like pages (real paragraphs between
navigation and footer lines), other-language pages (translation catalogs), planted junk and
planted near-duplicates. Files are picked by glob in an order fixed by a hash of their name,
so any Linux machine gives a corpus of the same shape; where a kind of file is missing, the
standard library stands in (pydoc_data's hard-wrapped topics, package METADATA)."""

import glob
import gzip
import hashlib
import json
import os
import random
import shutil
import subprocess
import sysconfig
import textwrap

import planted
from limits import HANG_S

MIN_CHARS, MAX_CHARS = 1500, 60_000


def _ordered(paths):
  return sorted(set(paths), key=lambda p: hashlib.sha1(os.path.basename(p).encode()).digest())


def man_pages(n):
  """Up to n man pages rendered as text (hard-wrapped at ~78 columns), by groff."""
  groff = shutil.which("groff")
  out = []
  if not groff:
    return out
  for path in _ordered(glob.glob("/usr/share/man/man[18]/*.gz")):
    try:
      with gzip.open(path) as f:
        roff = f.read()
      if b".so " in roff[:200]:  # a link to another page
        continue
      text = subprocess.run([groff, "-Tutf8", "-man", "-P-cbou"], input=roff,
                            capture_output=True, timeout=HANG_S).stdout.decode("utf-8", "replace")
    except (OSError, EOFError, subprocess.TimeoutExpired):
      continue
    if MIN_CHARS <= len(text) <= MAX_CHARS and "\ufffd" not in text:
      out.append((os.path.basename(path).rsplit(".", 2)[0], text))
    if len(out) >= n:
      break
  return out


def pydoc_topics(n):
  """Python's own hard-wrapped documentation topics (the stdlib's pydoc_data)."""
  from pydoc_data import topics
  texts = [(f"topic-{k}", v) for k, v in sorted(topics.topics.items())
           if MIN_CHARS <= len(v) <= MAX_CHARS]
  return texts[:n]


def hard_wrapped(n):
  """n hard-wrapped prose documents: man pages, topped up with pydoc_data topics."""
  docs = man_pages(n)
  return docs + pydoc_topics(n - len(docs))


def markdown_docs(n):
  """Up to n markdown or reST files from site-packages and /usr/share/doc (two at most from
  any one package or doc folder), topped up with packages' METADATA long descriptions."""
  lib = sysconfig.get_paths()["purelib"]
  paths = (glob.glob(f"{lib}/**/*.md", recursive=True) +
           glob.glob(f"{lib}/**/*.rst", recursive=True) +
           glob.glob("/usr/share/doc/**/*.md", recursive=True))
  out, per_package = [], {}
  for path in _ordered(paths) + _ordered(glob.glob(f"{lib}/*.dist-info/METADATA")):
    package = (path[len(lib):] if path.startswith(lib) else path).strip("/").split("/")[
        0 if path.startswith(lib) else 3]  # site-packages/PKG/... or /usr/share/doc/PKG/...
    if per_package.get(package, 0) >= 2:  # a package's many examples would be the whole set
      continue
    try:
      text = open(path, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError):
      continue
    if MIN_CHARS <= len(text) <= MAX_CHARS and text not in (t for _, t in out):
      suffix = os.path.splitext(path)[1] or ".md"
      name = path.split("/")[-2] if path.endswith("METADATA") else os.path.basename(path)
      out.append((f"{len(out):03d}-{os.path.splitext(name)[0]}{suffix}", text))
      per_package[package] = per_package.get(package, 0) + 1
    if len(out) >= n:
      break
  return out


def site_docs(n, max_chars=200_000):
  """[(file name, text)]: up to n .md/.rst files of site-packages of every size (short READMEs
  included), in hash order; on a machine with awscli most are its reST command pages, prose
  around JSON and shell examples, as a user's own docs folder has them."""
  lib = sysconfig.get_paths()["purelib"]
  paths = glob.glob(f"{lib}/**/*.md", recursive=True) + glob.glob(f"{lib}/**/*.rst",
                                                                   recursive=True)
  out = []
  for path in _ordered(paths):
    try:
      text = open(path, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError):
      continue
    if text.strip() and len(text) <= max_chars:
      out.append((f"{len(out):03d}-{os.path.basename(path)}", text))
    if len(out) >= n:
      break
  return out


def python_sources(n):
  """n standard-library modules' source."""
  lib = sysconfig.get_paths()["stdlib"]
  out = []
  for path in _ordered(glob.glob(f"{lib}/*.py") + glob.glob(f"{lib}/*/*.py")):
    try:
      text = open(path, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError):
      continue
    if MIN_CHARS <= len(text) <= MAX_CHARS:
      out.append(text)
    if len(out) >= n:
      break
  return out


NAV = ["Home | Docs | Blog | Download | About", "Search", "Menu", "Sign in | Register"]
FOOTER = ["Share on Twitter | Facebook | LinkedIn", "Copyright 2024 Example Foundation",
          "Privacy Policy | Terms of Use | Contact", "Back to top"]


def web_pages(n, rng, skip=0):
  """n pages (after the first `skip`): a navigation bar, a title, real paragraphs (one per
  line, as crawled text is), a footer."""
  pages = []
  for i, body in enumerate(planted.english_docs(skip + n, words=300)[skip:]):
    title = " ".join(body.split()[:6]).rstrip(".,:;")
    nav = rng.sample(NAV, 3)
    pages.append("\n".join(nav + [title, ""] + body.split("\n\n") + [""] +
                           rng.sample(FOOTER, 3)))
  return pages


def foreign_pages(n):
  """Up to n other-language pages from translation catalogs (none where there are none)."""
  import pytest
  try:
    return planted.foreign_docs(n)
  except pytest.skip.Exception:
    return []


def wrapped_pages(pages, rng):
  """The pages with each paragraph hard-wrapped at 60-79 columns, as HTML source often is."""
  out = []
  for page in pages:
    width = rng.randint(60, 79)
    out.append("\n".join(textwrap.fill(line, width) if len(line) > width else line
                         for line in page.split("\n")))
  return out


def junk_pages(rng):
  """Pages with nothing worth training on: link lists, keyword spam, lorem ipsum, cookie
  banners, tables of numbers, repeated calls to action."""
  items = ["shoes", "phones", "laptops", "watches", "bags", "jackets"]
  pages = list(planted.JUNK.values())
  for item in items:
    pages.append("\n".join(f"{w.title()} {item} | {rng.choice(items)} deals | Shop now"
                           for w in ("cheap", "best", "new", "top", "sale") * 6))
    pages.append((f"buy {item} online cheap {item} best {item} discount {item} " * 60).strip()
                 + ".")
    pages.append("\n".join(" | ".join(str(rng.randint(0, 9999)) for _ in range(8))
                           for _ in range(40)))
  pages.append("\n".join(["Sign up for our newsletter and never miss a deal!"] * 40))
  return pages


def write(root, n=40, seed=0):
  """Writes the corpora under root; returns {what: [(id, source)]} and the input paths.

  manpages/*.txt     hard-wrapped prose, files (kind prose by suffix)
  wrapped.jsonl      the same hard-wrapped text as JSON Lines (kind web: paragraph rules)
  docs/*             markdown and reST files (prose)
  code.jsonl         Python source, ids without a suffix (kind code by the content check)
  web.jsonl          web pages (some with hard-wrapped paragraphs), other-language pages,
                     junk pages (kind web)
  mirror.jsonl       exact and near copies of web pages
  """
  rng = random.Random(seed)
  truth = {k: [] for k in ("wrapped", "wrapped_web", "docs", "code", "web", "web_wrapped",
                           "foreign", "junk", "near")}
  os.makedirs(f"{root}/manpages", exist_ok=True)
  os.makedirs(f"{root}/docs", exist_ok=True)
  wrapped = hard_wrapped(2 * n)
  wrapped, wrapped_web = wrapped[:n], wrapped[n:]
  for name, text in wrapped:
    with open(f"{root}/manpages/{name}.txt", "w") as f:
      f.write(text)
    truth["wrapped"].append(f"{root}/manpages/{name}.txt")
  _jsonl(f"{root}/wrapped.jsonl", [{"id": f"wrapped-{name}", "text": text}
                                   for name, text in wrapped_web])
  truth["wrapped_web"] = [f"wrapped-{name}" for name, _ in wrapped_web]
  for name, text in markdown_docs(n // 2):
    with open(f"{root}/docs/{name}", "w") as f:
      f.write(text)
    truth["docs"].append(f"{root}/docs/{name}")
  code = python_sources(n)
  _jsonl(f"{root}/code.jsonl", [{"id": f"code-{i}", "text": t} for i, t in enumerate(code)])
  truth["code"] = [f"code-{i}" for i in range(len(code))]
  web = web_pages(n, rng)
  rows = [{"id": f"web-{i}", "text": t} for i, t in enumerate(web)]
  truth["web"] = [r["id"] for r in rows]
  for i, text in enumerate(wrapped_pages(web_pages(n, rng, skip=n), rng)):
    rows.append({"id": f"web-wrapped-{i}", "text": text})
    truth["web_wrapped"].append(f"web-wrapped-{i}")
  for i, text in enumerate(foreign_pages(max(5, n // 8))):
    rows.append({"id": f"foreign-{i}", "text": text})
    truth["foreign"].append(f"foreign-{i}")
  for i, text in enumerate(junk_pages(rng)):
    rows.append({"id": f"junk-{i}", "text": text})
    truth["junk"].append(f"junk-{i}")
  _jsonl(f"{root}/web.jsonl", rows)
  mirror = []
  for i in range(n):
    copy = perturb(web[i], rng)
    mirror.append({"id": f"near-{i}", "text": copy})
    truth["near"].append((f"near-{i}", f"web-{i}", planted.jaccard(web[i], copy)))
  _jsonl(f"{root}/mirror.jsonl", mirror)
  inputs = [f"{root}/{p}" for p in ("manpages", "wrapped.jsonl", "docs", "code.jsonl",
                                    "web.jsonl", "mirror.jsonl")]
  return truth, inputs


def perturb(text, rng, fraction=0.01):
  """A near-copy: `fraction` of the words changed (never a line break), a line added."""
  lines = [line.split(" ") for line in text.split("\n")]
  spots = [(i, j) for i, words in enumerate(lines) for j in range(len(words)) if words[j]]
  for i, j in rng.sample(spots, max(1, int(fraction * len(spots)))):
    lines[i][j] = "changed"
  return "\n".join(" ".join(words) for words in lines) + \
      "\n\nShare this article with your friends and colleagues today."


def _jsonl(path, rows):
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)

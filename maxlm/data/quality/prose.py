"""What the quality rules judge in a `prose` document: its prose, not its examples.

`prose` documents are a user's own files (.md, .rst, .txt, man pages, --as-text files), not
crawled pages. Two things make Gopher's web rules wrong for them:

- **Examples inside prose.** Documentation shows commands, JSON and code in literal blocks;
  judged as words, `"arn:aws:proton:region-id:123456789012:service/simple-svc"` makes the mean
  word length of a page of prose exceed 10, and repeated `},` lines look like a spam page's
  duplicate lines. The rules see the text with the literal blocks taken out (`prose_only`):
  markdown fenced blocks (``` or ~~~), reST literal blocks (the indented block after a
  paragraph ending in `::`) and reST code directives (`.. code-block::`, `.. code::`,
  `.. sourcecode::`, `.. literalinclude::`, `.. highlight::`, their indented body). The
  document itself is kept whole: nothing is deleted from it.
- **Short documents.** A 30-word README is not low quality; it is short. Web statistics need
  words to mean anything (Gopher's own floor is 50), so a prose document with fewer than
  `gopher_min_words` words of prose is not judged by the quality, repetition or language
  rules at all (the language of 20 words is a guess), only deduplicated. Web pages keep every
  rule: there, short pages are mostly navigation and stubs.
- **Templates.** Documentation repeats its own frame ("For more information, see ...", an
  "Output:" per example), which Gopher's repetition rules, made for spam, count against it.
  A prose document's repetition thresholds are REPETITION_SCALE times the web's (capped at
  1; `--filter rep_...=` sets the web's, and so these): measured on this machine's docs
  (tools/bench_own_docs.py: 300 site-packages .md/.rst files, mostly reST command pages),
  the web thresholds keep 83% of their bytes and twice them 93%, while every junk page of
  tests/realtext.py given as prose is still removed.
Indented text alone is not a literal block: man pages indent all their prose.
"""

import dataclasses
import re

REPETITION_SCALE = 2
_FENCE = re.compile(r"^[ \t]*(```|~~~)")
_DIRECTIVE = re.compile(r"^([ \t]*)\.\. (?:code-block|code|sourcecode|literalinclude|highlight)"
                        r"::")


def prose_only(text):
  """The text without its literal blocks (see the module docstring)."""
  out, lines, i = [], text.split("\n"), 0
  while i < len(lines):
    line = lines[i]
    fence = _FENCE.match(line)
    if fence:
      i = _after_fence(lines, i + 1, fence.group(1))
      continue
    directive = _DIRECTIVE.match(line)
    if directive:
      i = _after_indented(lines, i + 1, len(directive.group(1)))
      continue
    if line.rstrip().endswith("::"):
      head = line.rstrip()[:-2].rstrip()
      if len(head.split()) > 3:  # a sentence introducing the block; "Output::" goes with it
        out.append(head + ":")
      i = _after_indented(lines, i + 1, len(line) - len(line.lstrip()))
      continue
    out.append(line)
    i += 1
  return "\n".join(out)


def _after_fence(lines, i, marker):
  while i < len(lines) and not lines[i].lstrip().startswith(marker):
    i += 1
  return i + 1  # past the closing fence (or the end: an unclosed fence runs to it)


def _after_indented(lines, i, indent):
  """The index past the block indented deeper than `indent` that starts at i (blank lines
  inside it included; blank lines before it skipped)."""
  while i < len(lines) and not lines[i].strip():
    i += 1
  end = i
  while i < len(lines) and (not lines[i].strip() or
                            len(lines[i]) - len(lines[i].lstrip()) > indent):
    i += 1
    if lines[i - 1].strip():
      end = i
  return end


def repetition_thresholds(t):
  """The repetition thresholds a prose document is judged by: the web's x REPETITION_SCALE."""
  return dataclasses.replace(t, **{f.name: min(1.0, getattr(t, f.name) * REPETITION_SCALE)
                                   for f in dataclasses.fields(t) if f.name.startswith("rep_")})

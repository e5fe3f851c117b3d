"""What the quality rules judge in a `prose` document: its prose, not its examples.

`prose` documents are a user's own files (.md, .rst, .txt, man pages, --as-text files), not
crawled pages. Two things make Gopher's web rules wrong for them:

- **Examples inside prose.** Documentation shows commands, JSON and code in literal blocks;
  judged as words, `"arn:aws:proton:region-id:123456789012:service/simple-svc"` makes the mean
  word length of a page of prose exceed 10, and repeated `},` lines look like a spam page's
  duplicate lines. The prose rules see the text with the literal blocks taken out (`split`):
  markdown fenced blocks (``` or ~~~), reST literal blocks (the indented block after a
  paragraph ending in `::`) and reST code directives (`.. code-block::`, `.. code::`,
  `.. sourcecode::`, `.. literalinclude::`, `.. highlight::`, their indented body), and the
  literal blocks get rules of their own instead (`literal_rule`: a line over 10x
  code_max_line_length characters, control characters, or under code_min_alnum_fraction of
  the non-space characters alphanumeric), so a fence is no hiding place for junk. The code
  rules themselves would remove real examples: indented JSON is 22% alphanumeric with its
  spaces, a one-line policy document 1,377 characters long (measured on the docs below). The
  document itself is kept whole: nothing is deleted from it.
- **Short documents.** A 30-word README is not low quality; it is short. Web statistics need
  words to mean anything (Gopher's own floor is 50), so a prose document with fewer than
  `gopher_min_words` words of prose is not judged by the quality, repetition or language
  rules (the language of 20 words is a guess): only its literal blocks by the code rules, and
  dedup. Web pages keep every
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
  return split(text)[0]


def split(text):
  """(the prose, the literal blocks' lines): what the prose rules judge, and what the code
  rules judge (a fence or a block of control characters is no hiding place)."""
  out, literal, lines, i = [], [], text.split("\n"), 0
  while i < len(lines):
    line = lines[i]
    fence, directive = _FENCE.match(line), _DIRECTIVE.match(line)
    if fence:
      end = _after_fence(lines, i + 1, fence.group(1))
    elif directive:
      end = _after_indented(lines, i + 1, len(directive.group(1)))
    elif line.rstrip().endswith("::"):
      head = line.rstrip()[:-2].rstrip()
      if len(head.split()) > 3:  # a sentence introducing the block; "Output::" goes with it
        out.append(head + ":")
      end = _after_indented(lines, i + 1, len(line) - len(line.lstrip()))
    else:
      out.append(line)
      i += 1
      continue
    literal += lines[i + 1:end]
    i = end
  return "\n".join(out), "\n".join(literal)


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


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_SPACE = re.compile(r"\s+")
_ALNUM = re.compile(r"[^\W_]")


def literal_rule(literal, t):
  """The rule that removes a prose document for its literal blocks, or None."""
  if max(map(len, literal.split("\n"))) > 10 * t.code_max_line_length:
    return "literal_max_line_length"
  if len(_CONTROL.findall(literal)) > 0.01 * len(literal):
    return "literal_control_chars"
  solid = _SPACE.sub("", literal)
  if solid and len(_ALNUM.findall(solid)) / len(solid) < t.code_min_alnum_fraction:
    return "literal_alnum_fraction"
  return None

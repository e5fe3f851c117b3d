"""Where a document may be cut: section, paragraph and code-block boundaries, as char offsets.

A boundary is the start of a line, with a level: 2 for a section (a markdown or reST heading, a
top-level `def`/`class` in code), 1 for a paragraph (a line after a blank line, the edges of a
fenced code block). Nothing inside a fenced block is a boundary, so code blocks stay whole when
they fit. The chunker prefers the last level-2 boundary that fits, then level 1.
"""

import re

SECTION, PARAGRAPH = 2, 1

CODE_SUFFIXES = frozenset(
    ".py .pyi .pyx .c .h .cc .cpp .hpp .cu .js .ts .go .rs .java .kt .scala .sh .rb .lua .sql"
    .split())
_MD_HEADING = re.compile(r"#{1,6}\s")
_RST_RULE = re.compile(r"""([=\-~^"'*+#`])\1{2,}\s*$""")
_FENCE = re.compile(r"\s{0,3}(```|~~~)")
_CODE_TOP = re.compile(r"(def |class |async def |@|fn |func |pub fn |function |struct )")


def boundaries(text, kind):
  """[(char_offset, level)] in increasing offset, excluding 0; kind is 'code' or 'prose'."""
  lines = text.splitlines(keepends=True)
  found, offset, in_fence, prev_blank = [], 0, False, False
  for i, line in enumerate(lines):
    level = 0
    stripped = line.strip()
    if kind == "code":
      if _CODE_TOP.match(line) and not _under_decorator(lines, i):
        level = SECTION
      elif prev_blank and stripped:
        level = PARAGRAPH
    else:
      fence = _FENCE.match(line)
      if in_fence:
        in_fence = not fence
      elif fence:
        in_fence, level = True, PARAGRAPH
      elif _MD_HEADING.match(line) or _is_rst_title(lines, i):
        level = SECTION
      elif stripped and (prev_blank or _closes_fence(lines, i)):
        level = PARAGRAPH
    if level and offset > 0:
      found.append((offset, level))
    prev_blank = not stripped
    offset += len(line)
  return found


def _under_decorator(lines, i):
  """A `def` right under a decorator belongs to the decorator's section."""
  return i > 0 and lines[i - 1].startswith("@") and not lines[i].startswith("@")


def _is_rst_title(lines, i):
  return (i + 1 < len(lines) and lines[i].strip() and not _RST_RULE.match(lines[i])
          and _RST_RULE.match(lines[i + 1]) is not None)


def _closes_fence(lines, i):
  return i > 0 and _FENCE.match(lines[i - 1]) is not None and lines[i - 1].strip() in (
      "```", "~~~")


def split(text, kind):
  """The text cut at its boundaries: [(block_text, level_of_its_start)]."""
  cuts = boundaries(text, kind)
  starts = [0] + [c for c, _ in cuts]
  levels = [0] + [lvl for _, lvl in cuts]
  ends = starts[1:] + [len(text)]
  return [(text[s:e], lvl) for s, e, lvl in zip(starts, ends, levels)]

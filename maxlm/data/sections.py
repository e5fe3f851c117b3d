"""Where a document may be cut: section, paragraph and code-block boundaries, as char offsets.

A coarse boundary is the start of a line, with a level: 2 for a section (a markdown or reST
heading, a top-level `def`/`class` in code), 1 for a paragraph (a line after a blank line, the
edges of a fenced code block). Nothing inside a fenced block is a coarse boundary, so code
blocks stay whole when they fit. The chunker prefers the last level-2 boundary that fits, then
level 1.

Between coarse boundaries, fine ones (levels below 0: -1 a line start, -2 a sentence start, -3
a word start) let the planner end a piece within a few tokens of where a row ends (chunk.py,
fill.py) without cutting a word. All of them would make the index as large as the token store,
so a stretch between coarse boundaries gets one fine boundary about every FINE_CHARS
characters, never two closer than half that, each the coarsest within its reach. A sentence or
word boundary falls before the space (the space starts the next piece), where SentencePiece's
whitespace split already separates tokens, so encoding the blocks one by one gives the tokens
of the whole text.
"""

import bisect
import re

SECTION, PARAGRAPH = 2, 1
LINE, SENTENCE, WORD = -1, -2, -3
FINE_CHARS = 32

CODE_SUFFIXES = frozenset(
    ".py .pyi .pyx .c .h .cc .cpp .hpp .cu .js .ts .go .rs .java .kt .scala .sh .rb .lua .sql"
    .split())
_MD_HEADING = re.compile(r"#{1,6}\s")
_RST_RULE = re.compile(r"""([=\-~^"'*+#`])\1{2,}\s*$""")
_FENCE = re.compile(r"\s{0,3}(```|~~~)")
_CODE_TOP = re.compile(r"(def |class |async def |@|fn |func |pub fn |function |struct )")
_WORD_END = re.compile(r"\S(?=[ \t])")  # a word followed by a space or tab: cut after it
_SENTENCE_END = ".!?;:\u3002\uff01\uff1f"
_CLOSERS = "\"')]*_`"


def boundaries(text, kind):
  """[(char_offset, level)] in increasing offset, excluding 0; kind is 'code' or 'prose'."""
  coarse, line_starts = _coarse(text, kind)
  found, edges = [], [0] + [c for c, _ in coarse] + [len(text)]
  for k, (a, b) in enumerate(zip(edges, edges[1:])):
    if k:
      found.append(coarse[k - 1])
    if b - a > FINE_CHARS:
      found += _fine(text, a, b, line_starts, kind == "code")
  return found


def _coarse(text, kind):
  """The coarse boundaries, and every line start (offset > 0) for the fine ones."""
  lines = text.splitlines(keepends=True)
  found, starts, offset, in_fence, prev_blank = [], [], 0, False, False
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
    if offset > 0:
      starts.append(offset)
    prev_blank = not stripped
    offset += len(line)
  return found, starts


def _fine(text, a, b, line_starts, code):
  """Fine boundaries in (a, b): greedily, the coarsest in the next [FINE_CHARS/2, FINE_CHARS]
  characters (the latest of that level), else the first one after."""
  found, pos, half = [], a, FINE_CHARS // 2
  while b - pos > FINE_CHARS:
    lo, hi = pos + half, pos + FINE_CHARS
    j = bisect.bisect_right(line_starts, hi)
    if j and line_starts[j - 1] >= lo:  # a line start outranks any sentence or word
      best = (line_starts[j - 1], LINE)
    else:
      best = None
      for m in _WORD_END.finditer(text, max(lo - 1, 0), hi):
        end = m.end()
        level = WORD if code or not _ends_sentence(text, end) else SENTENCE
        if best is None or level >= best[1]:
          best = (end, level)
      if best is None:
        best = _first_after(text, hi, b - half, line_starts)
        if best is None:
          break
    found.append(best)
    pos = best[0]
  return found


def _ends_sentence(text, end):
  k = end - 1
  while k > 0 and text[k] in _CLOSERS:
    k -= 1
  return text[k] in _SENTENCE_END


def _first_after(text, lo, hi, line_starts):
  """The first line or word boundary in (lo, hi), or None."""
  i = bisect.bisect_right(line_starts, lo)
  line = line_starts[i] if i < len(line_starts) and line_starts[i] < hi else None
  m = _WORD_END.search(text, lo, hi if line is None else line)
  if m and m.end() < hi:
    return (m.end(), WORD)
  return None if line is None else (line, LINE)


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

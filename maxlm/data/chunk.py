"""Cutting one document into pieces that fit a row, at the best boundary available.

A piece's segment is [BOS if it starts the document] + context + body + [EOS if it ends it]
(+3 FIM markers when FIM may apply) and must fit `capacity` = L + 1 tokens, since a segment of
n tokens fills n - 1 positions. The body ends at the last section boundary that keeps at least
`min_cut` of the room, else the last paragraph boundary, else the coarsest fine boundary (line,
sentence, word: sections.py) within `slack` tokens of where the room ends, else the last fine
boundary that keeps `min_cut`, else (a cut inside a word, the last resort) where the room ends.
The next piece carries the `overlap` tokens before its start as loss-masked context.

`fill_end` is the cut the planner makes to fill the end of a row (fill.py): the coarsest
boundary of any level within `slack` tokens of where the room ends, else the nearest within 4
`slack`, else inside a word.
"""

import numpy as np

FIM_MARKERS = 3
COARSE = (2, 1)  # section, paragraph (sections.py)
FINE = (-1, -2, -3)  # line, sentence, word


def positions(bos, ctx, body, eos, fim):
  """Row positions a piece fills: its segment length minus one."""
  return bos + ctx + body + eos + FIM_MARKERS * (fim > 0) - 1


def slack(seq_len):
  """Tokens a cut may fall short of the room's end to land on a fine boundary."""
  return max(16, seq_len // 256)


def cut(length, start, end, bound_pos, bound_level, capacity, overlap, min_cut, slack=0):
  """[(start, end, ctx)] covering [start, end) of a document of `length` tokens."""
  pieces, pos = [], start
  while pos < end:
    bos, ctx = int(pos == 0), min(overlap, pos)
    room = capacity - bos - ctx
    eos = int(end == length)
    if end - pos + eos <= room:
      pieces.append((pos, end, ctx))
      break
    limit = min(pos + room, end - 1) if eos else min(pos + room, end)
    lowest = pos + max(1, int(np.ceil(min_cut * room)))
    pieces.append((pos, _best_cut(pos, limit, lowest, bound_pos, bound_level, slack), ctx))
    pos = pieces[-1][1]
  return pieces


def fill_end(pos, limit, bound_pos, bound_level, slack):
  """(end, level) of a piece from `pos` that should end as near `limit` as it can: the coarsest
  boundary in [limit - slack, limit] (the latest of its level), else the latest boundary in
  [limit - 4 slack, limit], else (limit, None): inside a word."""
  a, b = _between(bound_pos, max(pos + 1, limit - 4 * slack), limit)
  if b == a:
    return limit, None
  near = [(lvl, p) for p, lvl in zip(bound_pos[a:b].tolist(), bound_level[a:b].tolist())
          if p >= limit - slack]
  if not near:
    return int(bound_pos[b - 1]), int(bound_level[b - 1])
  level, end = max(near)
  return end, level


def _between(bound_pos, lo, hi):
  """The index range of bound_pos within [lo, hi]."""
  return int(bound_pos.searchsorted(lo, "left")), int(bound_pos.searchsorted(hi, "right"))


def _best_cut(pos, limit, lowest, bound_pos, bound_level, slack):
  a, b = _between(bound_pos, max(lowest, pos + 1), limit)
  levels = bound_level[a:b]
  coarse = np.flatnonzero(levels > 0)
  if len(coarse):
    sections = coarse[levels[coarse] == max(COARSE)]
    return int(bound_pos[a + (sections[-1] if len(sections) else coarse[-1])])
  end, level = fill_end(pos, limit, bound_pos, bound_level, slack)
  if level is None and b > a:
    return int(bound_pos[b - 1])  # a fine boundary short of the slack beats a cut in a word
  return end

"""Cutting one document into pieces that fit a row, at the best boundary available.

A piece's segment is [BOS if it starts the document] + context + body + [EOS if it ends it]
(+3 FIM markers when FIM may apply) and must fit `capacity` = L + 1 tokens, since a segment of
n tokens fills n - 1 positions. The body ends at the last section boundary that keeps at least
`min_cut` of the room, else the last paragraph boundary, else wherever the room ends. The next
piece carries the `overlap` tokens before its start as loss-masked context.
"""

import numpy as np

FIM_MARKERS = 3


def positions(bos, ctx, body, eos, fim):
  """Row positions a piece fills: its segment length minus one."""
  return bos + ctx + body + eos + FIM_MARKERS * (fim > 0) - 1


def cut(length, start, end, bound_pos, bound_level, capacity, overlap, min_cut):
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
    pieces.append((pos, _best_cut(pos, limit, lowest, bound_pos, bound_level), ctx))
    pos = pieces[-1][1]
  return pieces


def _best_cut(pos, limit, lowest, bound_pos, bound_level):
  a = np.searchsorted(bound_pos, max(lowest, pos + 1), "left")
  b = np.searchsorted(bound_pos, limit, "right")
  if b > a:
    levels = bound_level[a:b]
    for level in (2, 1):
      hits = np.flatnonzero(levels == level)
      if len(hits):
        return int(bound_pos[a + hits[-1]])
  return limit

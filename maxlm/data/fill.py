"""Filling rows: each source's pool of waiting pieces, and the rows packed from them.

A `Pool` walks one source's documents in its keyed order per epoch (permute.py), cuts those
that do not fit a row (chunk.py) and keeps up to `data.lookahead` pieces waiting, in arrival
order and indexed by size. `pack_rows` fills each row: it opens with the oldest piece of the
source furthest below its token quota, then best-fits the remaining room from the windows,
sources in order of deficit, taking a piece only while every source stays within one piece
of its quota. When no waiting piece fits the room left, it cuts a waiting piece of a document
longer than a row (one being cut anyway) so that its head fills the room: at the coarsest
boundary within `chunk.slack(L)` tokens of the room's end (section, paragraph, line, sentence,
word), else the nearest within 4 slacks, else (trying another such piece first, and only for a
room over 4 slacks) inside a word; the rest waits in its place, with the `data.overlap` tokens
before it as loss-masked context. This is what keeps padding under what Grain's BestFit leaves on
the same pieces (docs/performance.md, tools/bench_packing.py); Grain's packers cannot cut an
element, so they can only choose among whole pieces.
"""

import bisect
import collections
import itertools

import numpy as np

from maxlm import MaxlmError
from maxlm.data import chunk, fim, pairs, permute

CHUNK = 4096  # permutation positions evaluated at a time

MIN_FILL = 8  # the fewest body tokens a fill cut places (`min_fill`)
FILL_TRIES = 8  # waiting pieces of cut documents a fill cut considers, oldest first

# A piece: (pool, doc, start, end, ctx, fim_mode, positions).
POOL, DOC, START, END, CTX, FIM, SIZE = range(7)


def min_fill(overlap):
  """The fewest body tokens a fill cut places: under the overlap, the context the rest then
  carries would cost more positions than the cut fills."""
  return max(overlap, MIN_FILL)


class Pool:
  """One source's documents: its permutation cursor and its lookahead window of pieces."""

  def __init__(self, planner, index):
    self.p, self.index = planner, index
    self.docs = planner.index.pool(index)  # a view of the memory-mapped pool_docs
    self.n = len(self.docs)
    self.train_tokens = int(planner.index.pool_tokens[index])
    self.name = planner.index.sources[index]
    self.fim_ok = planner.fim_sources is None or self.name in planner.fim_sources
    self.epoch, self.cursor = -1, 0
    self._keys = (None, None)
    self._chunk = (None, 0, [], [], [])  # epoch, first position, docs, lengths, FIM modes
    self.cut_queue = collections.deque()
    self.window = collections.OrderedDict()  # seq -> piece, in arrival order
    self.by_size = []  # sorted (positions, -seq)
    self.long = {}  # seq -> None: the waiting pieces of documents cut to fit a row, in order
    self.seq = 0

  def state(self):
    return (self.epoch, self.cursor, list(self.cut_queue), list(self.window.values()), self.seq)

  def restore(self, state):
    self.epoch, self.cursor, cut_queue, window, self.seq = state
    self.cut_queue = collections.deque(tuple(p) for p in cut_queue)
    self._clear()
    for piece in window:
      self._add(tuple(piece), self._is_cut(piece))

  def epoch_docs(self, epoch, positions):
    """The documents at `positions` of the pool's order in `epoch` (an int64 array)."""
    if self._keys[0] != epoch:
      self._keys = (epoch, permute.round_keys("pool", self.p.seed, self.name, epoch))
    return self.docs[permute.permute(self.n, self._keys[1], positions)].astype(np.int64)

  def _epoch_done(self):
    return self.epoch < 0 or self.cursor >= self.n

  def fill(self):
    """Tops the window up; an epoch's last pieces leave it before the next epoch's enter."""
    while len(self.window) < self.p.lookahead:
      if self.window and not self.cut_queue and self.cursor >= self.n:  # (epoch >= 0 here)
        break
      self._add(*self._next_piece())

  def head(self):
    seq, piece = next(iter(self.window.items()))
    return seq, piece

  def best_fit(self, space):
    i = bisect.bisect_right(self.by_size, (space, 1)) - 1
    return (-self.by_size[i][1], self.window[-self.by_size[i][1]]) if i >= 0 else (None, None)

  def take(self, seq):
    piece = self.window.pop(seq)
    del self.by_size[bisect.bisect_left(self.by_size, (piece[SIZE], -seq))]
    self.long.pop(seq, None)
    return piece

  def fill_cut(self, space):
    """(seq, head, rest) for filling `space` positions: of the FILL_TRIES oldest waiting pieces
    of documents cut to fit a row, the first with a boundary near the space's end (else, for a
    space over 4 slacks, the first cut inside a word), cut so that `head` fills the space and
    `rest` (which takes the piece's place, `put_back`) carries on; (None, None, None) when
    there is none, or the head would hold under `min_fill` tokens."""
    slack, fallback = chunk.slack(self.p.seq_len), None
    if space + 1 < self.p.min_fill:
      return None, None, None
    for seq in itertools.islice(self.long, FILL_TRIES):
      piece = self.window[seq]
      if piece[SIZE] <= space:
        continue
      start, ctx, mode = piece[START], piece[CTX], piece[FIM]
      markers = chunk.FIM_MARKERS if mode else 0
      limit = min(start + space + 1 - int(start == 0) - ctx - markers, piece[END] - 1)
      if limit - start < self.p.min_fill:
        continue
      cut, level = chunk.fill_end(start, limit, *_bounds(self.p.index, piece[DOC]), slack)
      if level is not None and cut - start >= self.p.min_fill:
        return self._split(seq, piece, cut)
      if fallback is None and limit - start > 4 * slack:
        fallback = seq, piece, limit
    return self._split(*fallback) if fallback else (None, None, None)

  def _split(self, seq, piece, cut):
    """(seq, head, rest) of waiting piece `seq` cut at token `cut`."""
    doc, start, end, ctx, mode = piece[DOC:SIZE]
    rest = min(self.p.overlap, cut)
    eos = int(end == self.p.index.length[doc])
    return seq, (self.index, doc, start, cut, ctx, mode,
                 chunk.positions(int(start == 0), ctx, cut - start, 0, mode)), (
        self.index, doc, cut, end, rest, fim.NONE, chunk.positions(0, rest, end - cut, eos,
                                                                  fim.NONE))

  def put_back(self, seq, piece):
    """Puts `piece` in the window in place of piece `seq` (keeping its arrival order)."""
    del self.by_size[bisect.bisect_left(self.by_size, (self.window[seq][SIZE], -seq))]
    self.window[seq] = piece
    bisect.insort(self.by_size, (piece[SIZE], -seq))

  def refit(self):
    """Re-cuts carried pieces for a new stage's row length."""
    runs = []  # maximal runs of back-to-back pieces of one document
    for piece in self.cut_queue:
      if runs and runs[-1][-1][DOC] == piece[DOC] and runs[-1][-1][END] == piece[START]:
        runs[-1].append(piece)
      else:
        runs.append([piece])
    self.cut_queue = collections.deque(
        p for run in runs for p in self._cut(run[0][DOC], run[0][START], run[-1][END],
                                             run[0][FIM]))
    carried = list(self.window.values())
    self._clear()
    for piece in reversed(carried):
      if piece[SIZE] <= self.p.seq_len:
        continue
      self._pair_fits(piece[DOC], piece[SIZE])
      self.cut_queue.extendleft(reversed(self._cut(piece[DOC], piece[START], piece[END],
                                                   piece[FIM])))
    for piece in carried:
      if piece[SIZE] <= self.p.seq_len:
        self._add(piece, self._is_cut(piece))

  def _clear(self):
    self.window.clear()
    self.by_size.clear()
    self.long.clear()

  def _add(self, piece, cut):
    """Adds a waiting piece; `cut`: whether it is part of a document that did not fit a row."""
    self.seq += 1
    self.window[self.seq] = piece
    bisect.insort(self.by_size, (piece[SIZE], -self.seq))
    if cut:
      self.long[self.seq] = None

  def _is_cut(self, piece):
    return not (piece[START] == 0 and piece[END] == self.p.index.length[piece[DOC]])

  def _load_chunk(self, i):
    """Documents, lengths and FIM modes of positions [i, i + CHUNK) of the current epoch."""
    docs = self.epoch_docs(self.epoch, np.arange(i, min(i + CHUNK, self.n)))
    modes = fim.modes(self.p.seed, docs, 0, self.epoch, self.p.fim_rate, self.p.fim_spm)
    if not self.fim_ok:
      modes[:] = fim.NONE
    modes[self.p.index.is_chat[docs] | (self.p.index.pair[docs, 0] > 0)] = fim.NONE
    self._chunk = (self.epoch, i, docs.tolist(), self.p.index.length[docs].tolist(),
                   modes.tolist())

  def _next_piece(self):
    """(the next piece to wait, whether it is part of a document cut to fit)."""
    if self.cut_queue:
      return self.cut_queue.popleft(), True
    if self._epoch_done():
      if not self.n:
        raise MaxlmError(f"source {self.name!r} has no training documents; drop it from the mix")
      self.epoch, self.cursor = self.epoch + 1, 0
    i = self.cursor
    self.cursor += 1
    epoch, first, docs, lengths, modes = self._chunk
    if epoch != self.epoch or not first <= i < first + len(docs):
      self._load_chunk(i)
      epoch, first, docs, lengths, modes = self._chunk
    doc, n, mode = docs[i - first], lengths[i - first], modes[i - first]
    p, _ = self.p.index.pair_of(doc)
    if p:  # a preference pair: one piece, never cut (pairs.py)
      return (self.index, doc, 0, n, 0, fim.NONE,
              self._pair_fits(doc, pairs.positions(n, p))), False
    size = n + 1 + (chunk.FIM_MARKERS if mode else 0)  # BOS + body + EOS, minus one
    if size <= self.p.seq_len:
      return (self.index, doc, 0, n, 0, mode, size), False
    self.cut_queue.extend(self._cut(doc, 0, n, mode))
    return self.cut_queue.popleft(), True

  def _pair_fits(self, doc, size):
    if size > self.p.seq_len and self.p.index.pair_of(doc)[0]:
      raise MaxlmError(f"source {self.name!r}: a preference pair fills {size} row positions, "
                       f"more than this stage's seq_len={self.p.seq_len}; a pair is never "
                       "split: raise seq_len, or re-run maxlm prepare with --max-pair-len "
                       f"{self.p.seq_len}")
    return size

  def _cut(self, doc, first, last, first_mode):
    reserve = chunk.FIM_MARKERS if self.fim_ok and self.p.fim_rate > 0 else 0
    n = int(self.p.index.length[doc])
    pos, lvl = self.p.index.bounds(doc)
    pieces = []
    for start, end, ctx in chunk.cut(n, first, last, pos, lvl, self.p.seq_len + 1 - reserve,
                                     self.p.overlap, self.p.min_cut,
                                     chunk.slack(self.p.seq_len)):
      mode = fim.NONE  # FIM only for a piece without context, where FIM may apply
      if ctx == 0 and reserve and not self.p.index.is_chat[doc]:
        mode = (first_mode if start == first else int(
            fim.modes(self.p.seed, doc, start, self.epoch, self.p.fim_rate, self.p.fim_spm)))
      size = chunk.positions(int(start == 0), ctx, end - start, int(end == n), mode)
      pieces.append((self.index, doc, start, end, ctx, mode, size))
    return pieces


def _bounds(index, doc):
  """index.bounds(doc), read through plain ndarray views (a memmap's indexing is slow)."""
  ptr = np.asarray(index.bound_ptr)
  a, b = ptr[doc], ptr[doc + 1]
  return np.asarray(index.bound_pos)[a:b], np.asarray(index.bound_level)[a:b]


def pack_rows(pools, n_rows, L, q, taken, largest):
  """`n_rows` rows of pieces from `pools` (quotas `q`); updates `taken` (body tokens per pool)
  in place and returns (rows, largest body so far)."""
  active = [i for i in range(len(pools)) if q[i] > 0]
  for i in active:
    pools[i].fill()
  rows = []
  for _ in range(n_rows):
    row, space = [], L
    while space > 0:
      pick = _pick(pools, active, row, space, taken, q, largest)
      if pick is None:
        break
      i, seq, piece, rest = pick
      pool = pools[i]
      if rest is None:
        pool.take(seq)
        pool.fill()
      else:
        pool.put_back(seq, rest)
      row.append(piece)
      taken[i] += piece[END] - piece[START]
      largest = max(largest, piece[END] - piece[START])
      space -= piece[SIZE]
    rows.append(row)
  return rows, largest


def _pick(pools, active, row, space, taken, q, largest):
  """(pool, seq, piece, rest) of the next piece of a row (rest: what a fill cut leaves, else
  None), or None when the row is done."""
  if len(active) == 1:
    order = active
  else:
    total = sum(taken)
    order = sorted(active, key=lambda i: (taken[i] - q[i] * total, i))
  fits = lambda i, body: (len(active) == 1 or
                          _worst_share(i, body, taken, q, active) <= max(largest, body))
  for i in order:
    seq, piece = pools[i].head() if not row else pools[i].best_fit(space)
    if piece is not None and fits(i, piece[END] - piece[START]):
      return i, seq, piece, None
  if not row:
    total = sum(taken)
    behind = [j for j in order if q[j] * total - taken[j] >= 0]
    i = min(behind, key=lambda j: _worst_share(j, _body(pools[j].head()[1]), taken, q, active))
    # a row always opens: with the least straying head of a source not ahead of its quota
    # (so no source ever gets more than one piece ahead)
    return (i, *pools[i].head(), None)
  if space + 1 < pools[order[0]].p.min_fill:
    return None
  for i in order:
    seq, piece, rest = pools[i].fill_cut(space)
    if piece is not None and fits(i, piece[END] - piece[START]):
      return i, seq, piece, rest
  return None


def _body(piece):
  return piece[END] - piece[START]


def _worst_share(chosen, body, taken, q, active):
  """The largest |tokens taken - quota share| of any source if `chosen` takes `body` tokens."""
  total = sum(taken) + body
  return max(abs(q[i] * total - taken[i] - (body if i == chosen else 0)) for i in active)

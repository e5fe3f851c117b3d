"""Fill-in-the-middle, decided by hashing so that any host recomputes the same choice.

Whether a piece becomes FIM (and PSM or SPM) is a hash of (seed, doc, start, epoch) against the
rate; where the middle starts and ends is a hash of (seed, doc, start), so the assembler needs
only the piece and its stored mode. The hash key is the piece's identity rather than its row,
because the 3 marker tokens change the piece's length and the packer needs it before rows exist.

PSM: <PRE> prefix <SUF> suffix <MID> middle
SPM: <PRE> <SUF> suffix <MID> prefix middle
"""

import numpy as np

NONE, PSM, SPM = 0, 1, 2
NAMES = {NONE: None, PSM: "psm", SPM: "spm"}

_M1, _M2, _GOLD = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(
    0x9E3779B97F4A7C15)


def _mix(x):
  with np.errstate(over="ignore"):
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def hash64(*keys):
  """splitmix64 chained over integer keys (scalars or arrays); returns uint64."""
  h = np.uint64(0)
  with np.errstate(over="ignore"):
    for k in keys:
      h = _mix(h + _GOLD + np.asarray(k).astype(np.uint64))
  return h


def unit(h):
  return (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def modes(seed, docs, starts, epoch, rate, spm_share):
  """FIM mode (NONE/PSM/SPM) per piece, vectorized."""
  if rate <= 0:
    return np.zeros(np.shape(docs), np.int8)
  u = unit(hash64(seed, docs, starts, epoch, 1))
  v = unit(hash64(seed, docs, starts, epoch, 2))
  return np.where(u < rate, np.where(v < spm_share, SPM, PSM), NONE).astype(np.int8)


def split_points(seed, doc, start, n):
  """0 <= i <= j <= n: prefix [0,i), middle [i,j), suffix [j,n)."""
  a = int(hash64(seed, doc, start, 3) % np.uint64(n + 1))
  b = int(hash64(seed, doc, start, 4) % np.uint64(n + 1))
  return min(a, b), max(a, b)


def apply(body, mode, i, j, special):
  """The body rearranged with its 3 markers."""
  pre, mid, suf = body[:i], body[i:j], body[j:]
  p, m, s = ([t] for t in (special.fim_prefix, special.fim_middle, special.fim_suffix))
  parts = [p, pre, s, suf, m, mid] if mode == PSM else [p, s, suf, m, pre, mid]
  return np.concatenate([np.asarray(x, np.int32) for x in parts])


def undo(tokens, mode, i, j):
  """The original body from a FIM'd one with split points (i, j) (for tests and inspection)."""
  n = len(tokens) - 3
  if mode == PSM:
    prefix, suffix, middle = tokens[1:1 + i], tokens[2 + i:2 + i + n - j], tokens[3 + n - j + i:]
  else:
    suffix, rest = tokens[2:2 + n - j], tokens[3 + n - j:]
    prefix, middle = rest[:i], rest[i:]
  return np.concatenate([prefix, middle, suffix]).astype(np.int32)

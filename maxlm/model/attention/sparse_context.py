"""Sparse attention and the indexer's warm-up under context parallelism.

The same zigzag as `context`: each device holds query chunks i and 2n-1-i of 2n, all-gathers
the keys, values, indexer keys and segment ids, and runs `sparse.sparse_blocks` (or `warmup`)
for its two chunks at their global offsets, so selection, causality and segments are exact
across shard boundaries. The per-call sums are added over the batch and context axes.
Heads stay whole inside the shard_map (a tensor axis computes them redundantly).

Tested where its contract is stated, against one device: tests/test_train_sparse.py
test_sparse_with_context_parallelism_matches_one_device trains the indexer warm-up and sparse
stages with context=2 and compares with the run on one device (and its refusal of select=token);
a direct test would need the same mesh and the same comparison.
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from maxlm import MaxlmError
from maxlm.model.attention import context


def _spec(x, batch_axes):
  return P(batch_axes, "context", *([None] * (x.ndim - 2)))


def run(fn, q_args, kv_args, segment_ids, *, mesh, batch_axes, block, with_out, keys):
  """fn(*q_parts, *kv_full, q_seg, kv_seg, offset) -> (out, peak, stats) if with_out, else
  stats; q_args and kv_args are [B, L, ...] arrays; returns the same, for the whole row."""
  n = mesh.shape["context"]
  length = segment_ids.shape[1]
  if length % (2 * n) or (length // (2 * n)) % block:
    raise MaxlmError(f"sparse attention with context={n}: seq_len {length} must split into "
                     f"2 x {n} chunks that are multiples of sparse.block={block}")
  order, inverse, chunk = context._zigzag(length, n)
  zq = [x[:, order] for x in q_args]
  zkv = [x[:, order] for x in kv_args]
  zseg = segment_ids[:, order]
  axes = tuple(a for a in (batch_axes or ()) if a) + ("context",)
  in_specs = tuple(_spec(x, batch_axes) for x in zq + zkv) + (P(batch_axes, "context"),)
  stats_spec = {k: P() for k in ("kl", "selected", "queries", "recall", "recall_queries")}

  def local(*args):
    ql, kvl, sl = args[:len(zq)], args[len(zq):-1], args[-1]
    gather = lambda x: jax.lax.all_gather(x, "context", axis=1, tiled=True)[:, inverse]
    kvf, sf = [gather(x) for x in kvl], gather(sl)
    d = jax.lax.axis_index("context")
    results = []
    for part, offset in ((0, d * chunk), (1, (2 * n - 1 - d) * chunk)):
      piece = slice(part * chunk, (part + 1) * chunk)
      results.append(fn(*[x[:, piece] for x in ql], *kvf, sl[:, piece], sf, offset))
    if with_out:
      (o0, p0, s0), (o1, p1, s1) = results
    else:
      s0, s1 = results
    stats = {k: jax.lax.psum(s0[k] + s1[k], axes) for k in s0}
    if not with_out:
      return stats
    peak = jax.lax.pmax(jax.lax.stop_gradient(jnp.maximum(p0, p1)), tuple(mesh.axis_names))
    return jnp.concatenate([o0, o1], axis=1), peak, stats

  st_spec = {k: stats_spec[k] for k in keys}
  out_specs = (_spec(q_args[0], batch_axes), P(), st_spec) if with_out else st_spec
  wrapped = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                          check_vma=False)
  result = wrapped(*zq, *zkv, zseg)
  if not with_out:
    return result
  out, peak, stats = result
  return out[:, inverse], peak, stats


def sparse(q, k, v, iq, iw, ik, segment_ids, *, mesh, batch_axes, topk, block,
           recall_blocks=0):
  from maxlm.model.attention import sparse_blocks
  fn = lambda q, iq, iw, k, v, ik, qs, ks, off: sparse_blocks.sparse_blocks(
      q, k, v, iq, iw, ik, qs, ks, off, topk=topk, block=block, recall_blocks=recall_blocks)
  keys = ("kl", "selected", "queries") + (("recall", "recall_queries") if recall_blocks else ())
  return run(fn, [q, iq, iw], [k, v, ik], segment_ids, mesh=mesh, batch_axes=batch_axes,
             block=block, with_out=True, keys=keys)


def warmup(q, k, iq, iw, ik, segment_ids, *, mesh, batch_axes, topk, chunk):
  from maxlm.model.attention import sparse as sparse_lib
  fn = lambda q, iq, iw, k, ik, qs, ks, off: sparse_lib.warmup(
      q, k, iq, iw, ik, qs, ks, off, topk=topk, chunk=chunk)
  return run(fn, [q, iq, iw], [k, ik], segment_ids, mesh=mesh, batch_axes=batch_axes, block=1,
             with_out=False, keys=("kl", "selected", "queries", "recall", "recall_queries"))

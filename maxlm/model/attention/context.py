"""Context parallelism: the sequence sharded over the mesh's `context` axis.

Each device holds two query chunks, i and 2n-1-i of 2n (the zigzag that balances causal work),
all-gathers K/V and segment ids, and runs blockwise attention of its chunks against the whole
sequence at their global offsets, so segments and causality are exact across shard boundaries.
Autodiff turns the all-gather into a reduce-scatter for dK/dV. A window (local layer) passes
through: blockwise places each chunk at its global offset, so its window bounds are global too.

Tested through `attention(..., mesh=)` against the one-device reference on 8 simulated devices
(tests/test_model_attention.py test_context_parallel_matches_reference, test_model_window.py
test_context_parallel_equals_the_reference_with_a_window): equality with the reference, outputs
and gradients, is this module's whole contract, so a direct test would repeat them.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from maxlm.model.attention import blockwise


def _zigzag(length, n):
  chunk = length // (2 * n)
  order = np.concatenate([np.r_[d * chunk:(d + 1) * chunk,
                                (2 * n - 1 - d) * chunk:(2 * n - d) * chunk] for d in range(n)])
  return order, np.argsort(order), chunk


def attention(q, k, v, segment_ids, *, mesh, batch_axes, head_axes, block_q, block_k,
              window=0):
  n = mesh.shape["context"]
  length = q.shape[1]
  extra = -length % (2 * n)
  if extra:
    q, k, v = (jnp.pad(x, [(0, 0), (0, extra), (0, 0), (0, 0)]) for x in (q, k, v))
    segment_ids = jnp.pad(segment_ids, [(0, 0), (0, extra)])
  order, inverse, chunk = _zigzag(q.shape[1], n)
  qz, kz, vz, sz = (x[:, order] for x in (q, k, v, segment_ids))
  spec = P(batch_axes, "context", head_axes, None)
  seg_spec = P(batch_axes, "context")

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(spec, spec, spec, seg_spec),
                     out_specs=(spec, P()), check_vma=False)
  def local(ql, kl, vl, sl):
    gather = lambda x: jax.lax.all_gather(x, "context", axis=1, tiled=True)[:, inverse]
    kf, vf, sf = gather(kl), gather(vl), gather(sl)
    d = jax.lax.axis_index("context")
    outs, peaks = [], []
    for part, offset in ((0, d * chunk), (1, (2 * n - 1 - d) * chunk)):
      piece = slice(part * chunk, (part + 1) * chunk)
      out, peak = blockwise.attention(ql[:, piece], kf, vf, sl[:, piece], sf, offset,
                                      block_q=block_q, block_k=block_k, window=window)
      outs.append(out)
      peaks.append(peak)
    peak = jax.lax.pmax(jax.lax.stop_gradient(jnp.maximum(*peaks)), tuple(mesh.axis_names))
    return jnp.concatenate(outs, axis=1), peak

  out, peak = local(qz, kz, vz, sz)
  return out[:, inverse][:, :length], peak

"""`attention(q, k, v, segment_ids, *, impl, window)`: one causal, segment-aware signature for
every backend.

q is [B, L, H, D], k and v are [B, L, K, D] with K dividing H, segment_ids is [B, L] int32 with
0 for padding; the result is [B, L, H, D]. Position i sees j iff j <= i and the segments are
equal and non-zero; a padding row's output is 0. The 1/sqrt(D) scale is applied here. With
`window` W > 0 (a local layer) also i - W < j: the last W positions, i itself included, as
transformers' sliding-window masks; every implementation but `gpu_mha` takes it, and the
skipping ones skip the blocks outside the window too, so a local layer costs O(L * W).

| impl          | where         | how                                                            |
|---------------|---------------|----------------------------------------------------------------|
| reference     | tests; CPU    | dense masked einsum (auto: CPU rows of <= 128 positions)       |
| blockwise     | CPU, anywhere | online softmax, custom VJP, skips masked blocks (`blockwise`)  |
| splash        | TPU           | splash, mask info built from segment ids: skips blocks across  |
|               |               | documents too (`splash_segments`)                              |
| gpu           | GPU           | own Pallas-Triton kernel, per-block key ranges from segment    |
|               |               | ids; max logit free (`triton_segments`)                        |
| splash_causal | TPU           | splash skipping causal blocks only (`kernels.splash`; bench)   |
| gpu_mha       | GPU           | jax's Pallas-Triton `mha`, no skipping (`kernels.gpu`; bench)  |
| auto          |               | per stage, from `auto_rule` (documents per row and length)     |

Which runs where is maxlm/model/impl.py's rule (`attention_impl`; for a stage, `choose`).

With a mesh whose `context` axis is larger than 1 the sequence is sharded (`context`).
The indexer stages come here too (`sparse`, `index`; `indexed.py`): `sparse_blocks` (DeepSeek
sparse attention over top-k key blocks from a lightning indexer), `sparse` (top-k keys) or, under
context parallelism, `sparse_context`.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from maxlm import MaxlmError
from maxlm.model import impl as impl_lib
from maxlm.model.attention import (blockwise, context, indexed, kernels, reference,
                                   splash_segments, triton_segments)

def attention(q, k, v, segment_ids, *, impl="auto", block_q=512, block_k=512, mesh=None,
              batch_axes=None, head_axes=None, max_logit=False, docs_per_row=None, window=0,
              platform=None, sparse=None, index=None):
  """Returns out [B, L, H, D], and with max_logit=True also the largest visible logit.
  `platform` (cpu, tpu, gpu; default this process's backend) is where the step runs: it picks
  `auto` and whether a Pallas kernel is interpreted (on a CPU) or compiled.

  An indexer stage gives `sparse` (its config.SparseConfig, mode not dense) and `index` (the
  indexer's iq, iw, ik) and gets (out, peak, stats): the peak is NaN where not computed."""
  way = impl_lib.sparse_impl(sparse, mesh is not None and mesh.shape.get("context", 1) > 1)
  if way == "dense":
    return _dense(q, k, v, segment_ids, impl, block_q, block_k, mesh, batch_axes, head_axes,
                  max_logit, docs_per_row, window, platform)
  if way != "indexer_warmup":
    return indexed.sparse(way, q, k, v, segment_ids, index, sparse, mesh=mesh,
                          batch_axes=batch_axes)
  result = _dense(q, k, v, segment_ids, impl, block_q, block_k, mesh, batch_axes, head_axes,
                  max_logit, docs_per_row, window, platform)
  out, peak = result if max_logit else (result, jnp.float32(jnp.nan))
  return out, peak, indexed.warmup(q, k, segment_ids, index, sparse, mesh=mesh,
                                   batch_axes=batch_axes)


def _dense(q, k, v, segment_ids, impl, block_q, block_k, mesh, batch_axes, head_axes, max_logit,
           docs_per_row, window, platform):
  """Dense causal attention: out, and with max_logit also the largest visible logit."""
  if q.shape[2] % k.shape[2]:
    raise MaxlmError(f"attention: {k.shape[2]} KV heads do not divide {q.shape[2]} heads")
  platform = platform or jax.default_backend()
  impl = impl_lib.attention_impl(impl, platform, seq_len=q.shape[1], docs_per_row=docs_per_row)
  if window and impl == "gpu_mha":
    raise MaxlmError("attention impl 'gpu_mha' has no sliding window; use impl=gpu for "
                     "model.attention.window > 0")
  if mesh is not None and mesh.shape.get("context", 1) > 1:
    out, peak = context.attention(q, k, v, segment_ids, mesh=mesh, batch_axes=batch_axes,
                                  head_axes=head_axes, block_q=block_q, block_k=block_k,
                                  window=window)
  elif impl == "reference":
    out, peak = reference.attention(q, k, v, segment_ids, segment_ids, window=window)
  elif impl == "blockwise":
    out, peak = blockwise.attention(q, k, v, segment_ids, segment_ids, block_q=block_q,
                                    block_k=block_k, window=window)
  else:
    kernel = _kernel(impl, block_q, window, interpret=platform == "cpu")
    out, peak = per_shard(kernel, mesh, batch_axes, head_axes)(q, k, v, segment_ids)
    if max_logit and peak is None:  # the kernel does not report it: a forward pass does
      peak = jax.lax.stop_gradient(blockwise.attention(
          q, k, v, segment_ids, segment_ids, block_q=block_q, block_k=block_k,
          window=window)[1])
  return (out, peak if peak is not None else jnp.float32(jnp.nan)) if max_logit else out


def _kernel(impl, block_q, window, interpret):
  """kernel(q, k, v, segment_ids) -> (out, max logit or None) of a Pallas implementation."""
  if impl == "gpu":
    return lambda q, k, v, seg: triton_segments.gpu(q, k, v, seg, block=min(block_q, 128),
                                                    interpret=interpret, window=window)
  if impl == "splash":
    fn = lambda q, k, v, seg: splash_segments.splash(q, k, v, seg, block=block_q,
                                                     interpret=interpret, window=window)
  elif impl == "splash_causal":
    fn = lambda q, k, v, seg: kernels.splash(q, k, v, seg, block=block_q, interpret=interpret,
                                             window=window)
  else:
    fn = lambda q, k, v, seg: kernels.gpu(q, k, v, seg, block=min(block_q, 128),
                                          interpret=interpret)
  return lambda q, k, v, seg: (fn(q, k, v, seg), None)


def per_shard(kernel, mesh, batch_axes, head_axes):
  """`kernel` run on each device's rows (and heads) of operands sharded over `mesh`. A Pallas
  call is one custom call that XLA cannot partition: Mosaic (TPU) refuses one over sharded
  operands, and on GPU it is computed whole on every device after all-gathering q, k and v.
  Heads split over `head_axes` when the KV heads divide as the query heads do, else each
  device computes every head of its rows; the max logit, where reported, is the mesh's max."""
  if mesh is None or not (batch_axes or head_axes):
    return kernel
  axes = tuple(batch_axes or ()) + tuple(head_axes or ())

  def call(q, k, v, seg):
    ways = int(np.prod([mesh.shape[a] for a in head_axes or ()]))
    kv_heads = head_axes if head_axes and k.shape[2] % ways == 0 else None
    q_spec = P(batch_axes, None, head_axes if kv_heads else None, None)
    kv_spec = P(batch_axes, None, kv_heads, None)
    reports_peak = jax.eval_shape(kernel, q, k, v, seg)[1] is not None

    def local(ql, kl, vl, sl):
      out, peak = kernel(ql, kl, vl, sl)
      return out, (jax.lax.pmax(peak, axes) if reports_peak else jnp.float32(0))
    out, peak = jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec,
                                                          P(batch_axes, None)),
                              out_specs=(q_spec, P()), check_vma=False)(q, k, v, seg)
    return out, (peak if reports_peak else None)
  return call

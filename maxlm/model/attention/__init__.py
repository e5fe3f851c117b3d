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

With a mesh whose `context` axis is larger than 1 the sequence is sharded (`context`).
Stages with `sparse.mode: sparse` do not come here: the decoder calls `sparse_blocks` (DeepSeek
sparse attention over top-k key blocks from a lightning indexer), `sparse` (top-k keys) or, under
context parallelism, `sparse_context`.
"""

import jax
import jax.numpy as jnp

from maxlm import MaxlmError
from maxlm.model.attention import (auto_rule, blockwise, context, kernels, reference,
                                   splash_segments, triton_segments)

IMPLS = ("auto", "reference", "blockwise", "splash", "gpu", "splash_causal", "gpu_mha")


def resolve(impl, platform=None, seq_len=None, docs_per_row=None):
  """The implementation to run; `auto` follows `auto_rule.choose` for the stage's shape."""
  platform = platform or jax.default_backend()
  if impl == "auto":
    return auto_rule.choose(platform, seq_len, docs_per_row)
  if impl not in IMPLS:
    raise MaxlmError(f"attention impl {impl!r}: expected one of {', '.join(IMPLS)}")
  if impl in ("gpu", "gpu_mha") and platform not in ("gpu", "cpu"):
    raise MaxlmError(f"attention impl 'gpu' needs a GPU; this job runs on {platform} "
                     "(set stages.N.attention=auto)")
  if impl in ("splash", "splash_causal") and platform not in ("tpu", "cpu"):
    raise MaxlmError(f"attention impl 'splash' needs a TPU; this job runs on {platform} "
                     "(set stages.N.attention=auto)")
  return impl


def attention(q, k, v, segment_ids, *, impl="auto", block_q=512, block_k=512, mesh=None,
              batch_axes=None, head_axes=None, max_logit=False, docs_per_row=None, window=0):
  """Returns out [B, L, H, D], and with max_logit=True also the largest visible logit."""
  if q.shape[2] % k.shape[2]:
    raise MaxlmError(f"attention: {k.shape[2]} KV heads do not divide {q.shape[2]} heads")
  impl = resolve(impl, seq_len=q.shape[1], docs_per_row=docs_per_row)
  if window and impl == "gpu_mha":
    raise MaxlmError("attention impl 'gpu_mha' has no sliding window; use impl=gpu for "
                     "model.attention.window > 0")
  interpret = jax.default_backend() == "cpu"
  if mesh is not None and mesh.shape.get("context", 1) > 1:
    out, peak = context.attention(q, k, v, segment_ids, mesh=mesh, batch_axes=batch_axes,
                                  head_axes=head_axes, block_q=block_q, block_k=block_k,
                                  window=window)
  elif impl == "reference":
    out, peak = reference.attention(q, k, v, segment_ids, segment_ids, window=window)
  elif impl == "blockwise":
    out, peak = blockwise.attention(q, k, v, segment_ids, segment_ids, block_q=block_q,
                                    block_k=block_k, window=window)
  elif impl == "gpu":
    out, peak = triton_segments.gpu(q, k, v, segment_ids, block=min(block_q, 128),
                                    interpret=interpret, window=window)
  else:
    if impl == "splash":
      out = splash_segments.splash(q, k, v, segment_ids, block=block_q, interpret=interpret,
                                   window=window)
    elif impl == "splash_causal":
      out = kernels.splash(q, k, v, segment_ids, block=block_q, interpret=interpret,
                           window=window)
    else:
      out = kernels.gpu(q, k, v, segment_ids, block=min(block_q, 128), interpret=interpret)
    peak = None
    if max_logit:  # the kernels do not report it; one forward pass without gradients does
      peak = jax.lax.stop_gradient(blockwise.attention(
          q, k, v, segment_ids, segment_ids, block_q=block_q, block_k=block_k,
          window=window)[1])
  return (out, peak if peak is not None else jnp.float32(jnp.nan)) if max_logit else out

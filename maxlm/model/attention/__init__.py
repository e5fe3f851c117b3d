"""`attention(q, k, v, segment_ids, *, impl)`: one causal, segment-aware signature for every backend.

q is [B, L, H, D], k and v are [B, L, K, D] with K dividing H, segment_ids is [B, L] int32 with
0 for padding; the result is [B, L, H, D]. Position i sees j iff j <= i and the segments are
equal and non-zero; a padding row's output is 0. The 1/sqrt(D) scale is applied here.

| impl      | where            | how                                                          |
|-----------|------------------|--------------------------------------------------------------|
| reference | tests            | dense masked einsum                                          |
| blockwise | CPU, anywhere    | online softmax, custom VJP, skips masked blocks (`blockwise`) |
| splash    | TPU              | Pallas splash attention (`kernels.splash`)                   |
| gpu       | GPU              | Pallas-Triton `mha` with segment ids (`kernels.gpu`)         |
| auto      |                  | splash on TPU, gpu on GPU, blockwise elsewhere               |

With a mesh whose `context` axis is larger than 1 the sequence is sharded (`context`).
"""

import jax
import jax.numpy as jnp

from maxlm import MaxlmError
from maxlm.model.attention import blockwise, context, kernels, reference

IMPLS = ("auto", "reference", "blockwise", "splash", "gpu")


def resolve(impl, platform=None):
  platform = platform or jax.default_backend()
  if impl == "auto":
    return {"tpu": "splash", "gpu": "gpu"}.get(platform, "blockwise")
  if impl not in IMPLS:
    raise MaxlmError(f"attention impl {impl!r}: expected one of {', '.join(IMPLS)}")
  if impl == "gpu" and platform not in ("gpu", "cpu"):
    raise MaxlmError(f"attention impl 'gpu' needs a GPU; this job runs on {platform} "
                     "(set stages.N.attention=auto)")
  if impl == "splash" and platform not in ("tpu", "cpu"):
    raise MaxlmError(f"attention impl 'splash' needs a TPU; this job runs on {platform} "
                     "(set stages.N.attention=auto)")
  return impl


def attention(q, k, v, segment_ids, *, impl="auto", block_q=512, block_k=512, mesh=None,
              batch_axes=None, head_axes=None, max_logit=False):
  """Returns out [B, L, H, D], and with max_logit=True also the largest visible logit."""
  if q.shape[2] % k.shape[2]:
    raise MaxlmError(f"attention: {k.shape[2]} KV heads do not divide {q.shape[2]} heads")
  impl = resolve(impl)
  if mesh is not None and mesh.shape.get("context", 1) > 1:
    out, peak = context.attention(q, k, v, segment_ids, mesh=mesh, batch_axes=batch_axes,
                                  head_axes=head_axes, block_q=block_q, block_k=block_k)
  elif impl == "reference":
    out, peak = reference.attention(q, k, v, segment_ids, segment_ids)
  elif impl == "blockwise":
    out, peak = blockwise.attention(q, k, v, segment_ids, segment_ids, block_q=block_q,
                                    block_k=block_k)
  else:
    interpret = jax.default_backend() == "cpu"
    kernel = kernels.splash if impl == "splash" else kernels.gpu
    block = block_q if impl == "splash" else min(block_q, 128)
    out = kernel(q, k, v, segment_ids, block=block, interpret=interpret)
    peak = None
    if max_logit:  # the kernels do not report it; one forward pass without gradients does
      peak = jax.lax.stop_gradient(blockwise.attention(
          q, k, v, segment_ids, segment_ids, block_q=block_q, block_k=block_k)[1])
  return (out, peak if peak is not None else jnp.float32(jnp.nan)) if max_logit else out

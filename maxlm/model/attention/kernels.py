"""Wrappers for jax's accelerator kernels as they come: TPU splash attention (skipping causal
blocks only) and the Pallas-Triton `mha` (skipping none); `splash_causal` and `gpu_mha` in the
table, kept to compare against the segment-skipping `splash_segments` and `triton_segments`.
With a window, splash gets its own `LocalMask` (skipping the blocks outside the window); `mha`
has no window.

Both are given GQA, any length (padded to the tile with segment id 0) and the 1/sqrt(D) scale,
and their padding rows are zeroed, so they keep `attention`'s contract. On CPU they run in
Pallas interpret mode, which is how the tests prove them: tests/test_model_attention.py
(test_every_impl_matches_reference, impls splash_causal and gpu_mha) and test_model_window.py
compare them with the reference through `attention(impl=...)`, outputs and gradients; a direct
test of the wrappers would check the same.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np


def _pad_to(x, block, axis=1):
  extra = -x.shape[axis] % block
  if not extra:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, extra)
  return jnp.pad(x, pad)


@functools.lru_cache(maxsize=32)
def _splash_kernel(length, groups, block, interpret, window):
  """Cached, so it is built outside any trace (ensure_compile_time_eval): the kernel holds its
  mask tables as arrays, and one made inside the first jit would hand that trace's values to
  the next function that uses it (a train step and an eval step at the same length)."""
  with jax.ensure_compile_time_eval():
    return _make_splash_kernel(length, groups, block, interpret, window)


def _make_splash_kernel(length, groups, block, interpret, window):
  from jax.experimental.pallas.ops.tpu.splash_attention import (
      splash_attention_kernel as sk, splash_attention_mask as sm)
  one = (sm.LocalMask((length, length), window_size=(window - 1, 0), offset=0) if window
         else sm.CausalMask((length, length)))
  mask = sm.MultiHeadMask([one for _ in range(groups)])
  sizes = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                        block_q_dq=block, block_kv_dq=block)
  return sk.make_splash_mqa(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                            interpret=interpret), sk.SegmentIds


def splash(q, k, v, segment_ids, *, block=512, interpret=False, window=0):
  """TPU splash attention, vmapped over batch and KV heads (each an MQA group)."""
  b, length, h, d = q.shape
  kh = k.shape[2]
  block = min(block, -(-length // 128) * 128)
  q, k, v, seg = (_pad_to(x, block) for x in (q, k, v, segment_ids))
  lp = q.shape[1]
  kernel, segment_ids_cls = _splash_kernel(lp, h // kh, block, interpret, int(window))
  q = (q / np.sqrt(d).astype(q.dtype)).reshape(b, lp, kh, h // kh, d).transpose(0, 2, 3, 1, 4)
  k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

  def row(qr, kr, vr, sr):
    ids = segment_ids_cls(q=sr, kv=sr)
    return jax.vmap(lambda qg, kg, vg: kernel(qg, kg, vg, segment_ids=ids))(qr, kr, vr)

  out = jax.vmap(row)(q, k, v, seg).transpose(0, 3, 1, 2, 4).reshape(b, lp, h, d)
  return (out * (seg > 0)[:, :, None, None].astype(out.dtype))[:, :length]


def gpu(q, k, v, segment_ids, *, block=64, interpret=False):
  """The Pallas-Triton `mha` with segment ids; KV heads are repeated for GQA."""
  from jax.experimental.pallas.ops.gpu import attention as triton_attention
  b, length, h, d = q.shape
  groups = h // k.shape[2]
  block = min(block, -(-length // 16) * 16)
  q, k, v, seg = (_pad_to(x, block) for x in (q, k, v, segment_ids))
  k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
  bwd = min(block, 64)
  sizes = triton_attention.BlockSizes(block_q=block, block_k=block, block_q_dkv=bwd,
                                      block_kv_dkv=bwd, block_q_dq=bwd, block_kv_dq=bwd)
  out = triton_attention.mha(q, k, v, seg, sm_scale=float(1 / np.sqrt(d)), causal=True,
                             block_sizes=sizes, interpret=interpret)
  return (out * (seg > 0)[:, :, None, None].astype(out.dtype))[:, :length]

"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4's report, section 2.2).

The residual is N parallel streams, x_BxLxNxD (N = `model.mhc.streams`). Before each attention
or MLP block, one small linear map reads a token's streams, flattened and RMS-normalised without
a scale, and gives three sets of weights:
- pre_BxLxN = sigmoid(.) + eps collapses the streams into the block's input;
- post_BxLxN = 2 sigmoid(.) spreads the block's output back over the streams;
- res_BxLxNxN mixes the streams on the residual path. A softmax and then Sinkhorn iterations
  make it doubly stochastic (columns exactly, rows nearly), so the residual path keeps the
  streams' total. It is applied transposed: stream k receives sum_j res[j, k] x[j].
The layer's new streams are post (x) block(sum_n pre_n x_n) + res^T x. A head collapses the
streams once more, with pre weights of its own, before the final norm. All of it runs in
float32: the maps are tiny, and Sinkhorn divides.

Each weight is a function of one token's own streams, so mHC reads no other position, and a
packed row cannot leak across documents through it.

Written here because none of our libraries has it. tests/test_model_mhc.py checks it against
transformers' DeepseekV4HyperConnection and DeepseekV4HyperHead.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxlm.model.dense import init, rms


def sinkhorn(res_logits_NxN, iters, eps):
  """Softmax over each row, then alternate column and row normalisation: `iters` column steps
  and `iters - 1` row steps, ending on columns (the order transformers uses).

  A scan, not a Python loop: unrolled, the 20 steps (and their gradients) are a chain of tiny
  softmax-shaped reductions that XLA:GPU's priority fusion grows into one Triton fusion step
  by step, re-running its tiling search each time; a shrunk V4 step took over 12 minutes to
  compile for an H200 that way and 50 s as a scan (the same values and gradients)."""
  res = jax.nn.softmax(res_logits_NxN, axis=-1) + eps
  res = res / (res.sum(axis=-2, keepdims=True) + eps)

  def rows_then_columns(r, _):
    r = r / (r.sum(axis=-1, keepdims=True) + eps)
    return r / (r.sum(axis=-2, keepdims=True) + eps), None
  return jax.lax.scan(rows_then_columns, res, None, length=iters - 1)[0]


def collapse(streams_BxLxNxD, pre_BxLxN):
  out = jnp.einsum("bln,blnd->bld", pre_BxLxN, streams_BxLxNxD.astype(jnp.float32))
  return out.astype(streams_BxLxNxD.dtype)


def expand(streams_BxLxNxD, out_BxLxD, post_BxLxN, res_BxLxNxN):
  """The layer's new streams: post (x) the block's output + res^T applied to the streams."""
  dt = streams_BxLxNxD.dtype
  mixed = jnp.einsum("bljk,bljd->blkd", res_BxLxNxN.astype(dt), streams_BxLxNxD)
  return post_BxLxN.astype(dt)[..., None] * out_BxLxD[..., None, :] + mixed


def _read_maps(module, streams_BxLxNxD, rows, row_names, n_scales):
  """The linear map a connection or the head reads from a token's streams, flattened and
  RMS-normalised without a scale: (maps_BxLxW, its bias W, its scales). Its parameters `fn`
  [W, N D], `base` [W] and `scale` are created in `module`."""
  b, length, n, d = streams_BxLxNxD.shape
  fn_WxND = module.param("fn", nn.with_logical_partitioning(init(module.init_std),
                                                            (row_names, "mhc_in")),
                         (rows, n * d), jnp.float32)
  base_W = module.param("base", nn.with_logical_partitioning(nn.initializers.zeros,
                                                             (row_names,)), (rows,), jnp.float32)
  scale = module.param("scale", nn.with_logical_partitioning(nn.initializers.ones,
                                                             ("mhc_scales",)), (n_scales,),
                       jnp.float32)
  flat_BxLxND = rms(streams_BxLxNxD.reshape(b, length, n * d), module.norm_eps)
  return flat_BxLxND @ fn_WxND.T, base_W, scale


class HyperConnection(nn.Module):
  """The pre, post and residual weights around one block. Returns (the block's input,
  post_BxLxN, res_BxLxNxN)."""
  streams: int
  sinkhorn_iters: int
  eps: float  # the floor added to pre and inside Sinkhorn
  norm_eps: float
  init_std: float

  @nn.compact
  def __call__(self, streams_BxLxNxD):
    n = self.streams
    b, length = streams_BxLxNxD.shape[:2]
    maps_BxLxW, base_W, scale_3 = _read_maps(self, streams_BxLxNxD, (2 + n) * n, "mhc_maps", 3)
    pre, post, res = jnp.split(maps_BxLxW, [n, 2 * n], axis=-1)
    pre_b, post_b, res_b = jnp.split(base_W, [n, 2 * n])
    pre_BxLxN = jax.nn.sigmoid(pre * scale_3[0] + pre_b) + self.eps
    post_BxLxN = 2 * jax.nn.sigmoid(post * scale_3[1] + post_b)
    res_BxLxNxN = sinkhorn((res * scale_3[2] + res_b).reshape(b, length, n, n),
                           self.sinkhorn_iters, self.eps)
    return collapse(streams_BxLxNxD, pre_BxLxN), post_BxLxN, res_BxLxNxN


class HyperHead(nn.Module):
  """The last collapse of the streams into one, before the final norm."""
  streams: int
  eps: float
  norm_eps: float
  init_std: float

  @nn.compact
  def __call__(self, streams_BxLxNxD):
    maps_BxLxN, base_N, scale_1 = _read_maps(self, streams_BxLxNxD, self.streams,
                                             "mhc_streams", 1)
    pre_BxLxN = jax.nn.sigmoid(maps_BxLxN * scale_1[0] + base_N) + self.eps
    return collapse(streams_BxLxNxD, pre_BxLxN)


def widen(x_BxLxD, streams):
  """The embedding copied into every stream."""
  return jnp.broadcast_to(x_BxLxD[..., None, :], (*x_BxLxD.shape[:2], streams,
                                                  x_BxLxD.shape[-1]))


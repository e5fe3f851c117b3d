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

from maxlm.model.dense import init


def rms_unweighted(x, eps):
  x32 = x.astype(jnp.float32)
  return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def sinkhorn(res_logits_NxN, iters, eps):
  """Softmax over each row, then alternate column and row normalisation: `iters` column steps
  and `iters - 1` row steps, ending on columns (the order transformers uses)."""
  res = jax.nn.softmax(res_logits_NxN, axis=-1) + eps
  res = res / (res.sum(axis=-2, keepdims=True) + eps)
  for _ in range(iters - 1):
    res = res / (res.sum(axis=-1, keepdims=True) + eps)
    res = res / (res.sum(axis=-2, keepdims=True) + eps)
  return res


def collapse(streams_BxLxNxD, pre_BxLxN):
  out = jnp.einsum("bln,blnd->bld", pre_BxLxN, streams_BxLxNxD.astype(jnp.float32))
  return out.astype(streams_BxLxNxD.dtype)


def expand(streams_BxLxNxD, out_BxLxD, post_BxLxN, res_BxLxNxN):
  """The layer's new streams: post (x) the block's output + res^T applied to the streams."""
  dt = streams_BxLxNxD.dtype
  mixed = jnp.einsum("bljk,bljd->blkd", res_BxLxNxN.astype(dt), streams_BxLxNxD)
  return post_BxLxN.astype(dt)[..., None] * out_BxLxD[..., None, :] + mixed


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
    b, length, _, d = streams_BxLxNxD.shape
    width = (2 + n) * n
    fn_WxND = self.param("fn", nn.with_logical_partitioning(init(self.init_std),
                                                            ("mhc_maps", "mhc_in")),
                         (width, n * d), jnp.float32)
    base_W = self.param("base", nn.with_logical_partitioning(nn.initializers.zeros,
                                                             ("mhc_maps",)), (width,), jnp.float32)
    scale_3 = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones,
                                                               ("mhc_scales",)), (3,), jnp.float32)
    flat_BxLxND = rms_unweighted(streams_BxLxNxD.reshape(b, length, n * d), self.norm_eps)
    maps_BxLxW = flat_BxLxND @ fn_WxND.T
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
    n = self.streams
    b, length, _, d = streams_BxLxNxD.shape
    fn_NxND = self.param("fn", nn.with_logical_partitioning(init(self.init_std),
                                                            ("mhc_streams", "mhc_in")),
                         (n, n * d), jnp.float32)
    base_N = self.param("base", nn.with_logical_partitioning(nn.initializers.zeros,
                                                             ("mhc_streams",)), (n,), jnp.float32)
    scale_1 = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones,
                                                               ("mhc_scales",)), (1,), jnp.float32)
    flat_BxLxND = rms_unweighted(streams_BxLxNxD.reshape(b, length, n * d), self.norm_eps)
    pre_BxLxN = jax.nn.sigmoid((flat_BxLxND @ fn_NxND.T) * scale_1[0] + base_N) + self.eps
    return collapse(streams_BxLxNxD, pre_BxLxN)


def widen(x_BxLxD, streams):
  """The embedding copied into every stream."""
  return jnp.broadcast_to(x_BxLxD[..., None, :], (*x_BxLxD.shape[:2], streams,
                                                  x_BxLxD.shape[-1]))


"""The named pieces the layers are built from: a bias-free dense layer whose kernel carries
logical axis names, its normal initializer, the logical constraint on an activation, and RMS
normalisation in float32."""

import flax.linen as nn
import jax
import jax.numpy as jnp


def init(std):
  return nn.initializers.normal(stddev=std)


def constrain(x, names):
  return nn.with_logical_constraint(x, names)


def rms(x, eps, scale=None):
  """x / RMS(x) over the last axis, in float32, times `scale` if given."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return y if scale is None else y * scale


def dense(features, axis, names, std, dtype, name):
  return nn.DenseGeneral(features, axis=axis, use_bias=False, dtype=dtype,
                         param_dtype=jnp.float32,
                         kernel_init=nn.with_logical_partitioning(init(std), names), name=name)

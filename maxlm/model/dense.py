"""The named pieces the layers are built from: a bias-free dense layer whose kernel carries
logical axis names, its normal initializer, and the logical constraint on an activation."""

import flax.linen as nn
import jax.numpy as jnp


def init(std):
  return nn.initializers.normal(stddev=std)


def constrain(x, names):
  return nn.with_logical_constraint(x, names)


def dense(features, axis, names, std, dtype, name):
  return nn.DenseGeneral(features, axis=axis, use_bias=False, dtype=dtype,
                         param_dtype=jnp.float32,
                         kernel_init=nn.with_logical_partitioning(init(std), names), name=name)

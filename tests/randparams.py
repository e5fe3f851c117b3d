"""Random values for every parameter of a module, for the checks against transformers'
modules (tests/test_model_mhc.py, tests/test_model_mqa.py, tests/test_model_moe.py): init
leaves biases 0 and scales 1, which would hide a swapped bias or scale."""

import flax.linen as nn
import jax


def random_params(module, args, seed=1, scale=0.3):
  """module.init(*args)'s parameters, unboxed, each replaced by normal(0, scale) values."""
  params = nn.meta.unbox(jax.jit(module.init)(jax.random.PRNGKey(0), *args)["params"])
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return jax.tree.unflatten(tree, [jax.random.normal(k, p.shape) * scale
                                   for k, p in zip(keys, leaves)])

"""Pallas kernels over sharded operands (maxlm/model/attention/__init__.py `per_shard`): each
device runs the kernel on its rows and heads inside a shard_map, equal to the kernel on the
whole batch, outputs and gradients (interpreted here; compiled by Mosaic in test_compile.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from maxlm.config import MeshConfig
from maxlm.model.attention import attention, per_shard
from maxlm.parallel import mesh as mesh_lib

from attncases import close, packed_segments


def _case(rows, heads, kv_heads, length=256, dim=32):
  rng = np.random.default_rng(1)
  seg = jnp.asarray(packed_segments(rows, length, rng, 90))
  q = jnp.asarray(rng.normal(size=(rows, length, heads, dim)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(rows, length, kv_heads, dim)), jnp.float32)
          for _ in range(2))
  return q, k, v, seg


@pytest.mark.parametrize("impl", ["splash", "gpu"])
@pytest.mark.parametrize("shape, kv_heads", [((4, 1, 1, 1), 2), ((2, 1, 2, 1), 2),
                                             ((2, 1, 2, 1), 1)],
                         ids=["batch4", "batch2-heads2", "batch2-mqa-heads-whole"])
def test_a_kernel_on_each_shard_equals_it_on_the_whole_batch(impl, shape, kv_heads):
  mesh = mesh_lib.make_mesh(MeshConfig(shape[0], shape[1], 1, shape[2], shape[3]),
                            jax.devices()[:int(np.prod(shape))])
  q, k, v, seg = _case(rows=4, heads=4, kv_heads=kv_heads)
  loss = lambda out: (out * jnp.cos(jnp.arange(out.size).reshape(out.shape))).sum()

  def run(q, k, v, **kw):
    return jax.value_and_grad(lambda q, k, v: loss(attention(
        q, k, v, seg, impl=impl, block_q=128, block_k=128, **kw)), argnums=(0, 1, 2))(q, k, v)
  want, want_grads = jax.jit(run)(q, k, v)
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  sq, sk, sv = (put(x, P(("data", "fsdp"), None, "tensor", None)) if x.shape[2] % shape[2] == 0
                else put(x, P(("data", "fsdp"))) for x in (q, k, v))
  got, grads = jax.jit(lambda q, k, v: run(q, k, v, mesh=mesh, batch_axes=("data", "fsdp"),
                                           head_axes=("tensor",)))(sq, sk, sv)
  close(got, want, 1e-5)
  for g, w in zip(grads, want_grads):
    close(g, w, 1e-5)
  traced = jax.make_jaxpr(lambda q, k, v: attention(
      q, k, v, seg, impl=impl, block_q=128, mesh=mesh, batch_axes=("data", "fsdp"),
      head_axes=("tensor",)))(sq, sk, sv)
  assert "shard_map" in str(traced)  # not left to XLA, which cannot partition a kernel


def test_a_kernel_reports_the_whole_meshs_max_logit():
  mesh = mesh_lib.make_mesh(MeshConfig(4, 1, 1, 1, 1), jax.devices()[:4])
  q, k, v, seg = _case(rows=4, heads=2, kv_heads=2, length=64)
  kernel = lambda q, k, v, s: (q, jnp.max(q))  # a stand-in kernel whose peak is its input's
  out, peak = per_shard(kernel, mesh, ("data",), None)(q, k, v, seg)
  assert float(peak) == float(jnp.max(q)) and (np.asarray(out) == np.asarray(q)).all()
  assert per_shard(kernel, None, ("data",), None) is kernel  # no mesh: the kernel itself

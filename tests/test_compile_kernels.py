"""Our Pallas kernels compiled, not interpreted, by their real compilers on this CPU machine:
Mosaic (libtpu) for splash and megablox on a v5e slice, Triton (the CUDA plugin) for our
segments kernel and jax's mha on H200s, forward and backward, at lengths 4K to 64K and with
sliding windows. A kernel that stops compiling for its target fails here. Each runs per device
inside a shard_map (maxlm/model/attention `per_shard`): the compiled step gathers nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxlm.compile import report, target
from maxlm.model import grouped
from maxlm.model.attention import attention

KERNEL_CALL = {"tpu": "tpu_custom_call", "gpu": "__gpu$xla.gpu.triton"}


@pytest.fixture(scope="module")
def tpu_devices():
  pytest.importorskip("libtpu")
  return target.devices(target.parse("tpu:v5e:2x2"))


@pytest.fixture(scope="module")
def gpu_devices():
  pytest.importorskip("jax_plugins.xla_cuda12")
  return target.devices(target.parse("gpu:h200:1x1x4"))


def _attention_grads(devices, platform, impl, length, window, block):
  """The compiled HLO of d(sum of attention)/d(q, k, v), one row a device, two heads of 128."""
  mesh = Mesh(np.array(devices), ("data",))
  rows = NamedSharding(mesh, P("data"))
  q = jax.ShapeDtypeStruct((len(devices), length, 2, 128), jnp.bfloat16, sharding=rows)
  seg = jax.ShapeDtypeStruct((len(devices), length), jnp.int32, sharding=rows)

  def grads(q, k, v, seg):
    def loss(q, k, v):
      out = attention(q, k, v, seg, impl=impl, block_q=block, block_k=block, mesh=mesh,
                      batch_axes=("data",), window=window, platform=platform)
      return out.astype(jnp.float32).sum()
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  return jax.jit(grads).lower(q, q, q, seg).compile().as_text()


def _assert_kernels_per_device(hlo, platform, calls):
  assert hlo.count(KERNEL_CALL[platform]) >= calls  # forward, and the backward's kernels
  assert report.collectives(hlo)["all-gather"]["count"] == 0  # each device its own rows


@pytest.mark.parametrize("impl, length, window", [
    ("splash", 4096, 0), ("splash", 65536, 4096), ("splash_causal", 4096, 1024),
    ("splash_causal", 16384, 0)])
def test_splash_compiles_for_tpu(tpu_devices, impl, length, window):
  hlo = _attention_grads(tpu_devices, "tpu", impl, length, window, block=512)
  _assert_kernels_per_device(hlo, "tpu", calls=3)


@pytest.mark.parametrize("impl, length, window", [
    ("gpu", 4096, 0), ("gpu", 65536, 4096), ("gpu", 16384, 1024), ("gpu_mha", 4096, 0)])
def test_triton_kernels_compile_for_h200(gpu_devices, impl, length, window):
  hlo = _attention_grads(gpu_devices, "gpu", impl, length, window, block=128)
  _assert_kernels_per_device(hlo, "gpu", calls=3)


def _grouped_grads(device, impl, k=512, n=1024):
  """The compiled HLO of a grouped matmul's value and gradients (8 experts, [k, n] each) on one
  device."""
  one = NamedSharding(Mesh(np.array([device]), ("x",)), P())
  lhs = jax.ShapeDtypeStruct((2048, k), jnp.bfloat16, sharding=one)
  rhs = jax.ShapeDtypeStruct((8, k, n), jnp.bfloat16, sharding=one)
  sizes = jax.ShapeDtypeStruct((8,), jnp.int32, sharding=one)
  loss = lambda x, w, s: grouped.matmul(x, w, s, impl=impl).astype(jnp.float32).sum()
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  return step.lower(lhs, rhs, sizes).compile().as_text()


@pytest.mark.parametrize("k, n", [(512, 1024), (64, 192)])
def test_megablox_compiles_for_tpu(tpu_devices, k, n):
  """Widths that are not whole 128-lane tiles (an expert's d_ff of 64) compile too: they are
  padded to them (maxlm/model/grouped.py)."""
  assert _grouped_grads(tpu_devices[0], "megablox", k, n).count(KERNEL_CALL["tpu"]) >= 3


def test_ragged_dot_compiles_for_h200(gpu_devices):
  """XLA:GPU's own grouped matmul: the forward is one GEMM over the 2048 rows (a Triton GEMM
  fusion), not a dense product per expert, and the gradients compile. (The experts' gradient
  is not so lean: XLA:GPU masks the rows once per expert, an [experts, rows, out] buffer;
  docs/performance.md.)"""
  hlo = _grouped_grads(gpu_devices[0], "ragged_dot_tiles")
  forward = [line for line in hlo.splitlines() if "gemm_fusion" in line and " fusion(" in line
             and "jvp()/ragged_dot" in line and "transpose(" not in line]
  assert len(forward) == 1 and "bf16[2048,1024]" in forward[0]
  assert "bf16[8,512,1024]" in hlo  # the experts' gradient

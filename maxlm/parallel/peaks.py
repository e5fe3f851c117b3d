"""Peak matmul FLOP/s per device, by device kind and compute dtype: the MFU denominator.

One table for the train loop (`maxlm/train/loop.py`), the tools (`tools/bench_train.py`,
`tools/gpu_train_check.sh`, `tools/gpu_kernels_check.py`) and docs/performance.md, so a logged
MFU and a documented one are against the same number. MFU = global tokens x FLOPs per token /
seconds / (per-device peak x device count) (`mfu`).

Dense (no structured sparsity) datasheet peaks, FLOP/s per device (chip):

  device            bfloat16     float32 at JAX's default precision
  H100 / H200 SXM   989.4e12     494.7e12 (TF32)    NVIDIA H100 and H200 datasheets: "BF16
                                                     Tensor Core 1,979 TFLOPS*", "TF32 989*",
                                                     * with sparsity, i.e. half without
  H100 PCIe         756e12       378e12 (TF32)      NVIDIA H100 datasheet (1,513 / 756 sparse)
  A100              312e12       156e12 (TF32)      NVIDIA A100 datasheet (dense figures)
  TPU v4            275e12       275e12             Cloud TPU docs, "TPU v4": 275 TFLOPs bf16
  TPU v5e           197e12       197e12             Cloud TPU docs, "TPU v5e": 197 TFLOPs bf16
  TPU v5p           459e12       459e12             Cloud TPU docs, "TPU v5p": 459 TFLOPs bf16
  TPU v6e           918e12       918e12             Cloud TPU docs, "TPU v6e": 918 TFLOPs bf16

float32: maxlm sets no matmul precision, and JAX's default computes float32 dots with TF32 on
recent NVIDIA GPUs and with one bfloat16 pass on TPUs (JAX docs, "Matmul precision"), so those
are the peaks a float32 model can reach. Parameters stay float32 either way; the compute dtype
is `model.dtype`.

Any other device (a CPU, an unlisted accelerator) has no datasheet entry: its peak is measured
here as the best of a few square matmuls on one device, in float32 on a CPU (its bfloat16 dots
are emulated and slower, which would flatter MFU) and in the compute dtype elsewhere. Fake CPU
devices (`--xla_force_host_platform_device_count`) share the host's cores, so a run on n of them
has 1/n of the MFU one device would have: each is credited the whole host's matmul rate.
"""

import time

import jax
import jax.numpy as jnp

# (substring of the lower-cased device_kind, bfloat16 FLOP/s, float32 FLOP/s); first match wins
PEAKS = (
    ("h100 pcie", 756e12, 378e12),
    ("h200", 989.4e12, 494.7e12),
    ("h100", 989.4e12, 494.7e12),
    ("a100", 312e12, 156e12),
    ("v6 lite", 918e12, 918e12), ("v6e", 918e12, 918e12),
    ("v5 lite", 197e12, 197e12), ("v5e", 197e12, 197e12),
    ("v5p", 459e12, 459e12), ("tpu v5", 459e12, 459e12),
    ("v4", 275e12, 275e12),
)


def datasheet(device_kind, dtype):
  """The table's peak FLOP/s for one device of this kind in this compute dtype, or None."""
  kind = device_kind.lower()
  for name, bf16, f32 in PEAKS:
    if name in kind:
      return bf16 if str(jnp.dtype(dtype)) == "bfloat16" else f32
  return None


def per_device(dtype, device=None):
  """(peak FLOP/s of one device, where it came from: 'datasheet' or 'measured')."""
  device = device or jax.devices()[0]
  found = datasheet(device.device_kind, dtype)
  if found is not None:
    return found, "datasheet"
  measured_dtype = jnp.float32 if device.platform == "cpu" else jnp.dtype(dtype)
  return measure_matmul(measured_dtype, device), "measured"


def measure_matmul(dtype=jnp.float32, device=None, n=1024, repeats=3):
  """Best FLOP/s of an n x n matmul on one device over a few runs (after one to compile)."""
  x = jax.device_put(jnp.ones((n, n), dtype), device or jax.devices()[0])
  f = jax.jit(lambda a: a @ a)
  jax.block_until_ready(f(x))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(f(x))
    best = min(best, time.perf_counter() - start)
  return 2 * n ** 3 / best


def mfu(flops_per_token, tokens, seconds, peak_per_device, n_devices):
  """Model FLOPs utilisation of a step: `tokens` is the global count the step trained on."""
  return flops_per_token * tokens / seconds / (peak_per_device * n_devices)

"""A GPU's description for XLA:GPU when no GPU is present: the GpuTargetConfigProto (text form)
that `jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)` takes.

The CUDA plugin ships no such description and a machine without the GPU cannot query one, so we
write it from each chip's published figures (SM count, memory, bandwidth, clocks, Hopper's
sm_90a). The compiler reads these to pick kernels and tile sizes and to check shared memory and
registers; it autotunes nothing without a device. Fields the plugin of jax 0.10.2 rejects
(`collective_memory_granularity`) and the per-unit rate tables (used only by XLA's own cost
model, which this plugin does not expose) are left out.
"""

import typing


class Gpu(typing.NamedTuple):
  name: str  # as the driver reports it
  memory_bytes: int  # device memory the driver reports (below the marketing GB)
  bandwidth: int  # HBM bytes a second
  memory_clock_khz: int


GPUS = {
    "h100": Gpu("NVIDIA H100 80GB HBM3", 84_942_979_072, 3_352_320_000_000, 2_619_000),
    "h200": Gpu("NVIDIA H200 141GB HBM3e", 151_397_597_184, 4_800_000_000_000, 3_750_000),
}
_SMS, _CLOCK_GHZ, _L2_BYTES = 132, 1.98, 50 * 2 ** 20  # both SXM Hopper parts


def target_config(chip):
  """The text-form GpuTargetConfigProto of `chip` (a key of GPUS)."""
  g = GPUS[chip]
  info = {
      "threads_per_block_limit": 1024, "threads_per_warp": 32,
      "shared_memory_per_block": 48 * 1024, "shared_memory_per_core": 228 * 1024,
      "threads_per_core_limit": 2048, "core_count": _SMS, "fpus_per_core": 128,
      "block_dim_limit_x": 2 ** 31 - 1, "block_dim_limit_y": 65535, "block_dim_limit_z": 65535,
      "memory_bandwidth": g.bandwidth, "l2_cache_size": _L2_BYTES, "clock_rate_ghz": _CLOCK_GHZ,
      "device_memory_size": g.memory_bytes, "shared_memory_per_block_optin": 227 * 1024,
  }
  limits = {
      "registers_per_core_limit": 65536, "registers_per_block_limit": 65536,
      "thread_dim_limit_x": 1024, "thread_dim_limit_y": 1024, "thread_dim_limit_z": 64,
      "device_vendor": "NVIDIA Corporation", "platform_version": "Compute Capability 9.0a",
      "model_str": (f"sm_9.0a with {g.memory_bytes}B RAM, {_SMS} cores, "
                    f"{int(_CLOCK_GHZ * 1e6)}KHz clock, {g.memory_clock_khz}KHz mem clock, "
                    f"{_L2_BYTES}B L2$"),
      "device_address_bits": 64, "pcie_bandwidth": 32 * 2 ** 30, "ecc_enabled": True,
      "name": g.name,
  }
  lines = ["gpu_device_info {", *_fields(info),
           "  cuda_compute_capability { major: 9 feature_extension: ACCELERATED_FEATURES }",
           *_fields(limits), "}", 'platform_name: "CUDA"',
           "dnn_version_info { major: 9 minor: 10 patch: 0 }",
           f"device_description_str: {_value(g.name)}"]
  return "\n".join(lines) + "\n"


def _fields(values):
  return [f"  {k}: {_value(v)}" for k, v in values.items()]


def _value(v):
  if isinstance(v, bool):
    return "true" if v else "false"
  return f'"{v}"' if isinstance(v, str) else str(v)

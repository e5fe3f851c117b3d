"""A compile target: a TPU slice or a GPU node named on the command line, as devices this machine
compiles for without having them.

  tpu:<topology>                          libtpu's names: v5e:2x4, v5p:4x4x4, v6e:4x4, v4:2x2x1
  gpu:<h100|h200>:<partitions>x<hosts>x<gpus>   e.g. gpu:h200:1x1x8

TPU slices come from `jax.experimental.topologies` with libtpu installed, GPU nodes from the
same with the CUDA plugin and a description of the GPU we write (maxlm/compile/gpu_spec.py);
both come with the `aot` extra. A TPU chip's memory is its generation's published HBM; a
GPU's, the memory its driver reports (gpu_spec.py), which the compiler is told too. A target
this install cannot compile for is one line naming what to install.
"""

import contextlib
import importlib.util
import os
import re
import typing

from maxlm import MaxlmError
from maxlm.compile import gpu_spec

GIB = 2 ** 30
HBM_BYTES = {"v4": 32 * GIB, "v5e": 16 * GIB, "v5p": 95 * GIB, "v6e": 32 * GIB,
             **{chip: gpu.memory_bytes for chip, gpu in gpu_spec.GPUS.items()}}
TPU_PEAK_BF16 = {"v4": 275e12, "v5e": 197e12, "v5p": 459e12, "v6e": 918e12}
INSTALL = "pip install -e '.[aot]' (libtpu for TPU targets, the CUDA plugin for GPU ones)"


class Target(typing.NamedTuple):
  name: str  # as given: tpu:v5e:2x4
  platform: str  # tpu | gpu
  chip: str  # v5e, v5p, v6e, v4, h100, h200
  topology: str  # libtpu's topology name, or partitions x hosts x gpus
  hbm_bytes: int  # a chip's memory


def parse(text):
  """The Target `text` names, or one line saying what a target looks like."""
  tpu = re.fullmatch(r"tpu:(v4|v5e|v5p|v6e):(\d+(?:x\d+){1,2})", text or "")
  if tpu:
    return Target(text, "tpu", tpu[1], f"{tpu[1]}:{tpu[2]}", HBM_BYTES[tpu[1]])
  gpu = re.fullmatch(r"gpu:(h100|h200):(\d+x\d+x\d+)", text or "")
  if gpu:
    return Target(text, "gpu", gpu[1], gpu[2], HBM_BYTES[gpu[1]])
  raise MaxlmError(f"--target {text!r}: expected tpu:<chip>:<topology> (chip v4, v5e, v5p or "
                   "v6e; e.g. tpu:v5e:2x4, tpu:v5p:4x4x4) or gpu:<h100|h200>:<partitions>x"
                   "<hosts>x<gpus> (e.g. gpu:h200:1x1x8)")


def devices(target):
  """The target's devices, in the topology's order."""
  if target.platform == "gpu":
    return _gpu_devices(target)
  if importlib.util.find_spec("libtpu") is None:  # the TPU compiler topologies loads
    raise MaxlmError(f"--target {target.name} needs the TPU compiler, which this install "
                     f"lacks: {INSTALL}")
  # libtpu takes a host-wide lock for the chips it drives; compiling drives none, and two
  # compiles (or a test suite's workers) at once must not refuse each other
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies
  with _quiet_stderr():  # libtpu logs that this host has no TPU: true, and beside the point
    try:
      topo = topologies.get_topology_desc(platform="tpu", topology_name=target.topology)
    except Exception as e:  # noqa: BLE001 (libtpu's words for a topology it does not know)
      raise MaxlmError(f"--target {target.name}: libtpu has no topology {target.topology!r} "
                       f"({str(e).splitlines()[0][:160]})") from None
  return list(topo.devices)


def _gpu_devices(target):
  """A GPU node's devices from the CUDA plugin, described by maxlm/compile/gpu_spec.py."""
  if importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
    raise MaxlmError(f"--target {target.name} needs the GPU compiler (the CUDA plugin), which "
                     f"this install lacks: {INSTALL}")
  from jax.experimental import topologies
  try:
    topo = topologies.get_topology_desc(platform="cuda", topology=target.topology,
                                        target_config=gpu_spec.target_config(target.chip))
  except Exception as e:  # noqa: BLE001 (the plugin's words for what it cannot build)
    if "not implemented for cuda" in str(e):  # jax started its CUDA backend, not the CPU's
      raise MaxlmError(f"--target {target.name}: jax was started for a GPU this host lacks; "
                       "set JAX_PLATFORMS=cpu (maxlm sets it when imported before jax)") from None
    raise MaxlmError(f"--target {target.name}: the CUDA plugin cannot describe "
                     f"{target.topology!r} ({str(e).splitlines()[0][:160]})") from None
  return list(topo.devices)


@contextlib.contextmanager
def _quiet_stderr():
  """File descriptor 2 to /dev/null for the block (libtpu's C++ logging writes there)."""
  saved = os.dup(2)
  try:
    with open(os.devnull, "w") as null:
      os.dup2(null.fileno(), 2)
    yield
  finally:
    os.dup2(saved, 2)
    os.close(saved)

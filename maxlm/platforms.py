"""Which JAX backends a process may start, decided before jax starts any.

On a host with neither TPU chips nor an NVIDIA GPU, jax is held to its CPU backend
(JAX_PLATFORMS=cpu) unless the user set JAX_PLATFORMS: with libtpu installed (the `aot`
extra, for `maxlm compile`) jax would otherwise try to drive TPU chips the host does not have
and log its failure on every command. libtpu's host-wide lock on the chips it drives is
waived (ALLOW_MULTIPLE_LIBTPU_LOAD): a compile drives none, and two compiles, or a test
suite's workers, must not refuse each other. TPU topologies still compile under both.
"""

import glob
import os


def hold_to_cpu_without_accelerators():
  """Sets the two variables on a host without accelerators; a no-op elsewhere or when the
  user already chose JAX_PLATFORMS."""
  if "JAX_PLATFORMS" in os.environ or _has_accelerator():
    return
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


# as jax's hardware_utils finds accelerators (read here because importing jax would fix its
# platforms before this could set them): TPU chips by PCI vendor and device id, NVIDIA GPUs
# by their device files
GOOGLE_PCI_VENDOR = "0x1ae0"
TPU_PCI_DEVICES = ("0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076")
NVIDIA_DEVICES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")  # dxg: WSL2


def _has_accelerator():
  for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
    try:
      with open(vendor) as f, open(os.path.join(os.path.dirname(vendor), "device")) as g:
        if f.read().strip() == GOOGLE_PCI_VENDOR and g.read().strip() in TPU_PCI_DEVICES:
          return True
    except OSError:
      continue
  return any(os.path.exists(d) for d in NVIDIA_DEVICES)

"""The device mesh (data, fsdp, expert, tensor, context) and the logical -> mesh axis rules.

Every parameter and key activation carries logical axis names (see `model.transformer`);
`config.rules` maps them to mesh axes (in flax's form: maxlm/model/sharding.py).
"""

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxlm import MaxlmError
from maxlm.config import MESH_AXES
from maxlm.parallel import distributed


def initialize_distributed(enabled, env=None):
  """Joins the multi-host job when `distributed: true` (`maxlm.parallel.distributed`)."""
  distributed.initialize(enabled, env)


def mesh_shape(mesh_config, n_devices):
  sizes = dataclasses.asdict(mesh_config)
  fixed = math.prod(n for n in sizes.values() if n != -1)
  if -1 in sizes.values():
    if n_devices % fixed:
      raise MaxlmError(f"mesh {sizes}: {n_devices} devices are not divisible by {fixed}")
    sizes = {k: (n_devices // fixed if n == -1 else n) for k, n in sizes.items()}
  if math.prod(sizes.values()) != n_devices:
    raise MaxlmError(f"mesh {sizes} needs {math.prod(sizes.values())} devices; "
                     f"this job has {n_devices}")
  return tuple(sizes[a] for a in MESH_AXES)


def make_mesh(mesh_config, devices=None):
  devices = jax.devices() if devices is None else devices
  shape = mesh_shape(mesh_config, len(devices))
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def batch_sharding(mesh, rules):
  return NamedSharding(mesh, P(_axes(rules, "batch"), _axes(rules, "length")))


def _axes(rules, name):
  axes = tuple(rules.get(name, ()))
  return axes if axes else None


def place_batch(batch, mesh, rules):
  """This host's rows -> global arrays sharded over the mesh."""
  sharding = batch_sharding(mesh, rules)
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
          for k, v in batch.items()}


def place_rows(array, mesh, rules):
  """This host's rows of an array whose other axes are not positions (sharded by row only)."""
  sharding = NamedSharding(mesh, P(_axes(rules, "batch")))
  return jax.make_array_from_process_local_data(sharding, np.asarray(array))

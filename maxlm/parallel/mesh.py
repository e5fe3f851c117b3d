"""The device mesh (data, fsdp, tensor, context) and the logical -> mesh axis rules.

Every parameter and key activation carries logical axis names (see `model.transformer`);
`config.rules` maps them to mesh axes.
"""

import dataclasses
import math
import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxlm import MaxlmError
from maxlm.config import MESH_AXES


def initialize_distributed(enabled, env=None):
  """Joins the multi-host job when `distributed: true`. MAXLM_COORDINATOR (host:port),
  MAXLM_NUM_PROCESSES and MAXLM_PROCESS_ID, as launch/slurm.sbatch sets them, name the job
  explicitly; without them JAX finds it itself (Cloud TPU, SLURM)."""
  env = os.environ if env is None else env
  if not enabled or jax.distributed.is_initialized():
    return
  names = ("MAXLM_COORDINATOR", "MAXLM_NUM_PROCESSES", "MAXLM_PROCESS_ID")
  given = [n for n in names if env.get(n)]
  if not given:
    jax.distributed.initialize()
    return
  if len(given) < len(names):
    missing = ", ".join(n for n in names if n not in given)
    raise MaxlmError(f"distributed: {', '.join(given)} set but {missing} missing; set all three")
  try:
    count, index = int(env["MAXLM_NUM_PROCESSES"]), int(env["MAXLM_PROCESS_ID"])
  except ValueError:
    raise MaxlmError("distributed: MAXLM_NUM_PROCESSES and MAXLM_PROCESS_ID must be integers")
  jax.distributed.initialize(coordinator_address=env["MAXLM_COORDINATOR"],
                             num_processes=count, process_id=index)


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


def rules_list(rules):
  """flax's rule format: ((logical, mesh axes or None), ...)."""
  return tuple((name, tuple(axes) if axes else None) for name, axes in rules.items())


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

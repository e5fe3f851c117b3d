"""Joining a multi-process job, and what its processes must agree on.

`initialize` calls `jax.distributed.initialize` from the MAXLM_* variables (or lets JAX find the
job on Cloud TPU and SLURM). On a machine without accelerators it first selects gloo for the
CPU backend's collectives, so `maxlm train ... distributed=true` with MAXLM_COORDINATOR,
MAXLM_NUM_PROCESSES and MAXLM_PROCESS_ID runs several CPU processes as one job (how the tests
run multi-process training on one machine). JAX's own peer heartbeat is set longer than our
watchdog's (`maxlm.parallel.watchdog`), so a lost peer is reported by us, in one line.

What processes share beyond the collectives goes through the JAX distributed client's
key-value store (the coordination service on process 0), never through the device, so it does
not synchronize the step pipeline:
  `agree`        process 0 decides (takes the run_dir's lease); the others wait for its verdict
                 and fail with the same one line when it failed;
  `fingerprint`  the global batch's fingerprint, from every process's row digests, the same
                 value for any number of processes;
  `host_rows` / `gather_rows`  this process's share of a batch every process builds whole
                 (evaluation), and the whole result back on every process.
"""

import hashlib
import importlib.util
import itertools
import json
import os
import re

import jax
import numpy as np

from maxlm import MaxlmError

NAMES = ("MAXLM_COORDINATOR", "MAXLM_NUM_PROCESSES", "MAXLM_PROCESS_ID")
_JAX_HEARTBEAT_MARGIN_S = 30  # JAX's own peer check fires this long after ours
_WAIT_MS = 24 * 3600 * 1000  # a dead peer is caught by the watchdog, not by this timeout
_agreements = itertools.count()


def peer_timeout(env=None):
  """Seconds without a peer's heartbeat before a process gives up on it (MAXLM_PEER_TIMEOUT,
  default 100: with the watchdog's beat, a lost peer ends the others within 105 s)."""
  env = os.environ if env is None else env
  text = env.get("MAXLM_PEER_TIMEOUT", "100")
  try:
    value = float(text)
  except ValueError:
    value = -1
  if not 2 <= value <= 86400:
    raise MaxlmError(f"MAXLM_PEER_TIMEOUT={text!r}: expected seconds between 2 and 86400")
  return value


def parse_env(env):
  """(coordinator, count, index) from the MAXLM_* variables, None when none is set; a one-line
  MaxlmError naming the variable when one is missing or malformed."""
  given = [n for n in NAMES if env.get(n)]
  if not given:
    return None
  if len(given) < len(NAMES):
    missing = ", ".join(n for n in NAMES if n not in given)
    raise MaxlmError(f"distributed: {', '.join(given)} set but {missing} missing; set all three")
  address = env["MAXLM_COORDINATOR"]
  match = re.fullmatch(r"(\[[0-9a-fA-F:]+\]|[^:\s]+):(\d+)", address)
  if not match or not 0 < int(match.group(2)) < 65536:
    raise MaxlmError(f"MAXLM_COORDINATOR={address!r}: expected HOST:PORT (e.g. 10.0.0.2:12355)")
  try:
    count, index = int(env["MAXLM_NUM_PROCESSES"]), int(env["MAXLM_PROCESS_ID"])
  except ValueError:
    raise MaxlmError("distributed: MAXLM_NUM_PROCESSES and MAXLM_PROCESS_ID must be "
                     "integers") from None
  if count < 1 or not 0 <= index < count:
    raise MaxlmError(f"distributed: MAXLM_PROCESS_ID={index} must be in 0..MAXLM_NUM_PROCESSES-1"
                     f" (MAXLM_NUM_PROCESSES={count})")
  return address, count, index


def _cpu_only(env):
  platforms = env.get("JAX_PLATFORMS") or jax.config.jax_platforms or ""
  if platforms:
    return set(platforms.split(",")) == {"cpu"}
  plugins = ("libtpu", "jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin",
             "jax_rocm7_plugin")
  return not any(importlib.util.find_spec(p) for p in plugins)


def initialize(enabled, env=None):
  """Joins the job when `distributed: true` (see the module docstring)."""
  env = os.environ if env is None else env
  if not enabled or jax.distributed.is_initialized():
    return
  explicit = parse_env(env)
  timeout = peer_timeout(env)
  if _cpu_only(env):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  kwargs = {"heartbeat_timeout_seconds": int(timeout) + _JAX_HEARTBEAT_MARGIN_S}
  if explicit is not None:
    address, count, index = explicit
    kwargs.update(coordinator_address=address, num_processes=count, process_id=index)
  try:
    jax.distributed.initialize(**kwargs)
  except (RuntimeError, ValueError) as e:
    where = f" (coordinator {explicit[0]})" if explicit else ""
    raise MaxlmError(f"distributed: could not join the job{where}: "
                     f"{str(e).splitlines()[0][:200]}") from None


def client():
  from jax._src import distributed as jax_distributed
  return jax_distributed.global_state.client


def multi():
  return jax.process_count() > 1


def agree(what, decide):
  """decide() on process 0; the other processes wait for it and raise the same MaxlmError
  when it raised one (`what` names the decision in the key)."""
  if not multi():
    return decide()
  key = f"maxlm/agree/{next(_agreements)}/{what}"
  if jax.process_index() == 0:
    try:
      result = decide()
    except MaxlmError as e:
      client().key_value_set(key, "E" + str(e))
      raise
    client().key_value_set(key, "ok")
    return result
  verdict = client().blocking_key_value_get(key, _WAIT_MS)
  if verdict.startswith("E"):
    raise MaxlmError(verdict[1:])
  return None


def gather_json(what, value):
  """[every process's value] on process 0 (in process order), None on the others; each
  process calls it the same number of times."""
  if not multi():
    return [value]
  key = f"maxlm/gather/{next(_agreements)}/{what}"
  me = jax.process_index()
  if me:
    client().key_value_set(f"{key}/{me}", json.dumps(value))
    return None
  out = [value]
  for p in range(1, jax.process_count()):
    out.append(json.loads(client().blocking_key_value_get(f"{key}/{p}", _WAIT_MS)))
    client().key_value_delete(f"{key}/{p}")
  return out


def _row_digests(batch):
  names = sorted(batch)
  rows = len(batch[names[0]])
  out = []
  for r in range(rows):
    h = hashlib.sha256()
    for name in names:
      h.update(np.ascontiguousarray(batch[name][r]).tobytes())
    out.append(h.hexdigest()[:32])
  return "".join(out)


def fingerprint(batch, step):
  """The fingerprint of the global batch of global step `step` (16 hex digits) on process 0,
  None on the others: a digest of every row's digest in global row order, so any number of
  processes reading their own rows gives the value one process reading all of them does."""
  digests = _row_digests(batch)
  if multi():
    me, n = jax.process_index(), jax.process_count()
    if me:
      client().key_value_set(f"maxlm/rows/{step}/{me}", digests, allow_overwrite=True)
      return None
    where = f"maxlm/rows/{step}"
    ready = dict(client().key_value_dir_get(where + "/"))  # one call for those already there
    parts = [digests] + [ready.get(f"{where}/{p}") or client().blocking_key_value_get(
        f"{where}/{p}", _WAIT_MS) for p in range(1, n)]
    client().key_value_delete(where)  # the folder, with every key under it
    digests = "".join(parts)
  return hashlib.sha256(digests.encode()).hexdigest()[:16]


def host_rows(batch):
  """This process's contiguous share of rows of a batch that every process built whole."""
  if not multi():
    return batch
  me, n = jax.process_index(), jax.process_count()
  rows = len(next(iter(batch.values())))
  if rows % n:
    raise MaxlmError(f"a batch of {rows} rows does not split over {n} processes")
  per = rows // n
  return {k: v[me * per:(me + 1) * per] for k, v in batch.items()}


def gather_rows(x):
  """A global array (rows sharded over processes) as one host array on every process."""
  if not multi():
    return jax.device_get(x)
  from jax.experimental import multihost_utils
  return multihost_utils.process_allgather(x, tiled=True)

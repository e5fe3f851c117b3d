"""Grain loading: batch k of stage s, for one host, as a pure function of (data, config, s, k).

`Data` opens a prepared data dir for a config (index, token store, tokenizer ids, planner).
`stage_dataset` is a Grain `MapDataset` of this host's rows -> batches of [rows_per_host, L];
element k is step k, so any step can be read directly, and `iterator` wraps it for training
with optional worker processes. Step k of stage s trains on batch `plan_step(s, k)` of the
stage's plan: k itself, unless `data.skip_steps` skips batches before it (maxlm/data/skip.py). Its state is saved with Orbax through `grain.checkpoint`; since
each batch depends only on (s, k), a run may also resume by step alone on another host or
worker count.
"""

import atexit
import json

import grain
import numpy as np

from maxlm import MaxlmError
from maxlm.config import ConfigError
from maxlm.data import assemble, fim, plan, skip, store, tokenizer


class Data:
  """A prepared data dir opened for one config."""

  def __init__(self, config):
    self.config = config
    self.manifest = store.load_manifest(config.data.dir)  # first: refuses mismatched files
    self.index = store.load_index(config.data.dir)
    _check_fim_sources(config, self.index.sources)
    self.store = store.TokenStore(config.data.dir, self.index)
    self.special = tokenizer.SpecialIds(**self.manifest["special_ids"])
    self.planner = plan.Planner(self.index, skip.planning_config(config))
    self.skips = [skip.StageSkips(config, s) for s in range(len(config.stages))]
    self._doc_ids = None

  def rows_per_host(self, s, hosts):
    batch = self.config.stages[s].batch
    if batch % hosts:
      raise MaxlmError(f"stages.{s}.batch={batch} is not divisible by {hosts} hosts")
    return batch // hosts

  def plan_step(self, s, k):
    """The batch of stage s's plan that its step k trains on."""
    return self.skips[s](k)

  def global_batch_pieces(self, s, k):
    """Rows of pieces of the global batch stage s's step k trains on."""
    batch = self.config.stages[s].batch
    return self.planner.rows(s, self.plan_step(s, k) * batch, batch)

  def provenance(self, rows):
    """JSON-able provenance for rows of pieces."""
    if self._doc_ids is None:
      self._doc_ids = store.load_doc_ids(self.config.data.dir)
    return [[{"source": self.index.sources[p[plan.POOL]], "doc_id": self._doc_ids[p[plan.DOC]],
              "start": p[plan.START], "end": p[plan.END], "context": p[plan.CTX],
              "fim": fim.NAMES[p[plan.FIM]],
              **({"pair": True} if self.index.pair_of(p[plan.DOC])[0] else {})}
             for p in row] for row in rows]


def _check_fim_sources(config, sources):
  """data.fim.sources must name sources of the data dir (mix names: checked by the planner)."""
  for name in config.data.fim.sources:
    if name not in sources:
      raise ConfigError(f"data.fim.sources: unknown source {name!r}; the data has: "
                        f"{', '.join(sources)}")


class HostRows:
  """Host-local row j of a stage -> the row's six arrays, assemble.FIELDS (picklable for Grain
  workers)."""

  def __init__(self, data, s, host, hosts):
    self.store, self.special = data.store, data.special
    self.planner, self.seed = data.planner, data.config.seed
    self.s, self.host, self.skips = s, host, data.skips[s]
    self.batch = data.config.stages[s].batch
    self.per_host = data.rows_per_host(s, hosts)
    self.seq_len = data.config.stages[s].seq_len
    self.document_mask = data.config.data.document_mask
    data.planner.warm(s)  # workers then plan from within the stage, not from stage 0

  def global_row(self, j):
    step, r = divmod(j, self.per_host)
    return self.skips(step) * self.batch + self.host * self.per_host + r

  def __call__(self, j):
    (pieces,) = self.planner.rows(self.s, self.global_row(int(j)), 1)
    arrays = assemble.row_arrays(self.store, self.special, self.seed, pieces, self.seq_len)
    return arrays if self.document_mask else assemble.without_document_mask(arrays)


def stage_dataset(data, s, host=0, hosts=1):
  """MapDataset whose element k is this host's slice of global batch k of stage s."""
  if not 0 <= host < hosts:
    raise MaxlmError(f"host index {host} is outside 0..{hosts - 1}")
  rows = HostRows(data, s, host, hosts)
  steps = data.config.stages[s].num_steps
  return grain.MapDataset.range(steps * rows.per_host).map(rows).batch(rows.per_host)


def iterator(data, s, host=0, hosts=1, start_step=0, workers=None):
  """A Grain iterator over batches start_step.. of stage s; batches do not depend on workers."""
  workers = data.config.data.workers if workers is None else workers
  ds = stage_dataset(data, s, host, hosts)[start_step:]
  it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  if workers:
    _absl_flags_parsed()
    it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(
        num_workers=workers, per_worker_buffer_size=data.config.data.prefetch))
    it = iter(it_ds)
    atexit.register(_close_quietly, it)
    return it
  return iter(it_ds)


def _close_quietly(it):
  """Stops a worker iterator before multiprocessing's own exit finalizer does: after a worker
  raised (a changed shard block, say), Grain's finalizer can race its prefetch thread and print
  an AttributeError traceback below the command's one-line error."""
  try:
    it.close()
  except Exception:  # noqa: BLE001 (exiting anyway)
    pass


def _absl_flags_parsed():
  from absl import flags
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


def save_iterator(path, it):
  """Saves a Grain iterator's state with Orbax (synchronously)."""
  import orbax.checkpoint as ocp
  with ocp.Checkpointer(grain.checkpoint.CheckpointHandler()) as ckpt:
    ckpt.save(path, args=grain.checkpoint.CheckpointSave(it))


def restore_iterator(path, it):
  import orbax.checkpoint as ocp
  with ocp.Checkpointer(grain.checkpoint.CheckpointHandler()) as ckpt:
    ckpt.restore(path, args=grain.checkpoint.CheckpointRestore(it))
  return it


def stack(batches):
  """[N, rows, L] arrays from a list of batch dicts."""
  return {f: np.stack([b[f] for b in batches]).astype(np.int32) for f in assemble.FIELDS}


def provenance_json(data, s, steps, host=0, hosts=1):
  per_host = data.rows_per_host(s, hosts)
  out = []
  for k in steps:
    rows = data.global_batch_pieces(s, k)[host * per_host:(host + 1) * per_host]
    out.append(data.provenance(rows))
  return json.dumps(out)

"""The planner: a pure function of (doc index, config, stage) giving every row's pieces.

It touches lengths only, never tokens, so every host computes the same global plan quickly.
Why our own rather than Grain's packers: those mix per element not per token, raise on
documents longer than L, and tie their state to worker count and per-host batch
(docs/architecture.md).

Per stage the planner
  1. draws documents from one pool per source, each in a keyed permutation per epoch, computed
     a window of positions at a time and never stored (`permute`);
  2. cuts documents that do not fit (see `chunk`), the overlap becoming the next piece's context;
  3. fills each row starting with the oldest piece of the source furthest below its token
     quota, then best-fits the rest from each source's lookahead window, in order of deficit,
     taking a piece only if every source's share stays within one piece of its quota, and
     when nothing waiting fits, cuts a long document's waiting piece to fill the room (`fill`);
  4. decides FIM per piece by hash (see `fim`);
  5. shuffles rows within windows of `data.shuffle_rows`.
Stage s starts from the pool cursors where stage s-1 ended. Rows are planned in blocks of
`data.block_rows`; the state at a block start (`Snapshot`) is small (each pool's epoch, cursor
and lookahead window) and picklable, and restoring one costs the same at any step and corpus
size: a resume, or a Grain worker given the parent's planner, plans on from the nearest one.

Memory does not grow with the corpus: a pool is a view of the index's memory-mapped
`pool_docs` (its training documents, grouped by source at prepare time), and an epoch's order
exists only for the CHUNK positions after the cursor. Positioning without a snapshot still
plans every row before the target, at the planner's throughput (docs/performance.md).

VERSION names the plan: the same (data, config, stage, step) gives the same batch only under
the same version. v1 (before the memory-mapped index) drew numpy permutations; v2 draws
`permute`'s; v3 cuts at fine boundaries and cuts waiting pieces to fill rows (`fill`). A
checkpoint records its snapshot's version and resumes only under it (`check_resume`).
"""

import collections
import copy
import dataclasses

import numpy as np

from maxlm import MaxlmError, __version__
from maxlm.data import fill
from maxlm.data.fill import CHUNK, CTX, DOC, END, FIM, POOL, SIZE, START, Pool  # noqa: F401

VERSION = 3
KEEP_SNAPSHOTS = 64  # recent block snapshots kept (and every KEEP_SNAPSHOTS-th one for good)


@dataclasses.dataclass
class Block:
  """Rows [first_row, first_row + rows) of a stage, as flat piece arrays (rows in final order)."""
  row_ptr: np.ndarray
  pool: np.ndarray
  doc: np.ndarray
  start: np.ndarray
  end: np.ndarray
  ctx: np.ndarray
  fim: np.ndarray
  order: np.ndarray  # final row i is packed row order[i]

  def row(self, i):
    a, b = self.row_ptr[i], self.row_ptr[i + 1]
    return [(int(self.pool[k]), int(self.doc[k]), int(self.start[k]), int(self.end[k]),
             int(self.ctx[k]), int(self.fim[k])) for k in range(a, b)]


@dataclasses.dataclass
class Snapshot:
  """Everything needed to plan on from a block start."""
  stage: int
  block: int
  pools: list
  taken: list  # body tokens per pool this stage
  largest: int  # largest piece body this stage
  version: int = VERSION  # the plan it belongs to

def unmixed(mixes, names):
  """The sources among `names` that no stage trains on: named by none of `mixes` (one mix per
  stage; an empty mix takes every source by its share of tokens)."""
  if any(not mix for mix in mixes):
    return []
  named = {n for mix in mixes for n in mix}
  return [n for n in names if n not in named]


def untrained(config, names):
  """The sources among `names` that no stage of `config` trains on (unmixed over its mixes)."""
  return unmixed([config.mix_for(s) for s in range(len(config.stages))], names)


def unmixed_line(left_out, strict=False):
  """The one line that names sources no stage trains on (as a warning, or `strict`'s error)."""
  return (f"no stage's mix names source{'s' if len(left_out) > 1 else ''} "
          f"{', '.join(map(repr, left_out))}: not trained on (add it to data.mix, a source of "
          "preference pairs to a dpo stage's mix, or prepare without it"
          + ("; data.strict=false lets a run leave it out)" if strict else
             "; data.strict=true makes this an error)"))


def check_resume(saved, step_no):
  """A checkpoint's planner snapshot (its JSON, or None) must be of this plan's version."""
  version = (saved or {}).get("version", 1)
  if version != VERSION:
    raise MaxlmError(f"checkpoint {step_no} was planned with data plan v{version}; this maxlm "
                     f"({__version__}) plans v{VERSION}, and the same step would train on other "
                     "batches: finish the run with the maxlm that started it, or start over "
                     "in a new run_dir (docs/design.md)")


class Planner:
  """Plans stages block by block; `block(s, b)` is a pure function of (index, config, s, b)."""

  def __init__(self, index, config, cache_blocks=4):
    d = config.data
    self.index, self.config, self.seed = index, config, config.seed
    self.lookahead, self.overlap, self.min_cut = d.lookahead, d.overlap, d.min_cut
    self.min_fill = fill.min_fill(d.overlap)
    self.fim_rate, self.fim_spm = d.fim.rate, d.fim.spm
    self.fim_sources = set(d.fim.sources) or None
    self.block_rows, self.shuffle_rows = d.block_rows, d.shuffle_rows
    self.quotas = [self._quotas(s) for s in range(len(config.stages))]
    self.pools = [Pool(self, i) for i in range(len(index.sources))]
    self.seq_len = config.stages[0].seq_len
    self._snapshots = {}  # kept for good: stage starts, seeded ones, every KEEP_SNAPSHOTS-th
    self._recent = collections.OrderedDict()  # the latest KEEP_SNAPSHOTS block starts
    self._blocks = collections.OrderedDict()
    self._cache_blocks = cache_blocks
    self._state = None  # (stage, block) the live pools are at

  def stage_rows(self, s):
    st = self.config.stages[s]
    return st.num_steps * st.batch

  def num_blocks(self, s):
    return -(-self.stage_rows(s) // self.block_rows)

  def rows(self, s, first, count):
    """Pieces of rows [first, first + count) of stage s, in final order."""
    out = []
    for r in range(first, first + count):
      b, i = divmod(r, self.block_rows)
      out.append(self.block(s, b).row(i))
    return out

  def block(self, s, b):
    if (s, b) not in self._blocks:
      self._goto(s, b)
      self._keep(s, b, self._plan_block(s, b))
    self._blocks.move_to_end((s, b))
    return self._blocks[(s, b)]

  def snapshot(self, s, b):
    """The planner state at the start of block b of stage s (plans up to it if needed)."""
    self._goto(s, b)
    return self._snapshot(s, b)

  def seed_snapshot(self, snap):
    """Installs a snapshot (e.g. from a checkpoint) so planning resumes from it."""
    if snap.version != VERSION:
      raise MaxlmError(f"a snapshot of data plan v{snap.version} cannot seed plan v{VERSION}")
    self._snapshots[(snap.stage, snap.block)] = copy.deepcopy(snap)

  def warm(self, s):
    """Makes sure planning in stage s starts from within it (e.g. before Grain workers get a
    copy of the planner): a no-op when a snapshot of stage s is known."""
    if not any(k[0] == s for k in list(self._snapshots) + list(self._recent)):
      self.snapshot(s, 0)

  def _goto(self, s, b):
    """Brings the live pools to the start of block b of stage s."""
    if self._state == (s, b):
      return
    known = [k for k in list(self._snapshots) + list(self._recent) if k <= (s, b)]
    latest = max(known) if known else None
    if self._state is None or self._state > (s, b) or (latest and latest > self._state):
      self._restore(self._snapshots.get(latest) or self._recent.get(latest) if latest else None)
    while self._state != (s, b):
      cs, cb = self._state
      if cb >= self.num_blocks(cs):
        self._begin_stage(cs + 1)
      else:
        self._keep(cs, cb, self._plan_block(cs, cb))
    if (s, b) not in self._snapshots:
      self._recent[(s, b)] = self._snapshot(s, b)
      self._recent.move_to_end((s, b))

  def _keep(self, s, b, block):
    self._blocks[(s, b)] = block
    self._state = (s, b + 1)
    while len(self._blocks) > self._cache_blocks:
      self._blocks.popitem(last=False)
    if (b + 1) % KEEP_SNAPSHOTS == 0:
      self._snapshots.setdefault((s, b + 1), self._snapshot(s, b + 1))
    elif (s, b + 1) not in self._snapshots:
      self._recent[(s, b + 1)] = self._snapshot(s, b + 1)
      while len(self._recent) > KEEP_SNAPSHOTS:
        self._recent.popitem(last=False)

  def _restore(self, snap):
    if snap is None:
      for pool in self.pools:
        pool.restore((-1, 0, [], [], 0))
      self._begin_stage(0)
      return
    self.seq_len = self.config.stages[snap.stage].seq_len
    for pool, state in zip(self.pools, snap.pools):
      pool.restore(state)
    self.taken, self.largest = list(snap.taken), snap.largest
    self._state = (snap.stage, snap.block)

  def _snapshot(self, s, b):
    return Snapshot(s, b, [p.state() for p in self.pools], list(self.taken), self.largest)

  def _begin_stage(self, s):
    if s >= len(self.config.stages):
      raise IndexError(f"stage {s} is past the schedule's {len(self.config.stages)} stages")
    L = self.config.stages[s].seq_len
    if 2 * self.overlap >= L:
      raise MaxlmError(f"data.overlap={self.overlap} must be under half of stages.{s}.seq_len={L}")
    self.seq_len = L
    for pool in self.pools:
      pool.refit()
    self.taken, self.largest = [0] * len(self.pools), 1
    self._state = (s, 0)
    self._snapshots[(s, 0)] = self._snapshot(s, 0)

  def _quotas(self, s):
    mix = self.config.mix_for(s)
    names = self.index.sources
    for name in mix:
      if name not in names:
        raise MaxlmError(f"stages.{s} mix: unknown source {name!r}; the data has: "
                         f"{', '.join(names)}")
    if not mix:
      mix = {n: float(self.index.pool_tokens[i]) for i, n in enumerate(names)}
    total = sum(mix.values())
    return np.array([mix.get(n, 0.0) / total for n in names])

  def _plan_block(self, s, b):
    n_rows = min(self.block_rows, self.stage_rows(s) - b * self.block_rows)
    rows, self.largest = fill.pack_rows(self.pools, n_rows, self.seq_len,
                                        self.quotas[s].tolist(), self.taken, self.largest)
    return self._to_block(s, b, rows)

  def _to_block(self, s, b, rows):
    order = np.arange(len(rows))
    for w in range(0, len(rows), self.shuffle_rows):
      rng = np.random.default_rng([self.seed, s, b, w, 7])
      order[w:w + self.shuffle_rows] = w + rng.permutation(min(self.shuffle_rows, len(rows) - w))
    ordered = [rows[i] for i in order]
    flat = [p for row in ordered for p in row]
    cols = np.array([p[:SIZE] for p in flat], np.int64).reshape(-1, SIZE)
    ptr = np.concatenate([[0], np.cumsum([len(r) for r in ordered])]).astype(np.int64)
    return Block(row_ptr=ptr, pool=cols[:, POOL].astype(np.int16),
                 doc=cols[:, DOC].astype(np.int32), start=cols[:, START].astype(np.int32),
                 end=cols[:, END].astype(np.int32), ctx=cols[:, CTX].astype(np.int32),
                 fim=cols[:, FIM].astype(np.int8), order=order)

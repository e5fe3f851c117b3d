"""A stage's steps on planned batches (the lm and dpo objectives): batch k of stage s read from
the plan, placed on the mesh and stepped, and the held-out evaluation of the stage.

Step k + 1 is dispatched before step k's metrics are read (the device never waits on the host:
its batch is placed while step k runs), unless step k is due to evaluate, checkpoint or stop;
then it is read at once, so a non-finite state is never saved. Tested through the loop it
serves (tests/test_train.py: a stopped and resumed run equals an uninterrupted one bit for bit;
tests/test_train_integrity.py: a non-finite step is never saved), as a unit would need a
prepared data dir and a compiled stage all the same.
"""

import contextlib
import time

import jax
import numpy as np

from maxlm.data import ledger, plan
from maxlm.eval import bpb, long_eval, passkey, positions
from maxlm.model import moe_state
from maxlm.parallel import distributed, mesh as mesh_lib
from maxlm.train import schedule

_WARNED_SMALL = set()  # run dirs whose small held-out sets this process has named


class Steps:
  """step(state, s, k, g, read_now) -> (state, metrics as floats, batch, seconds, tokens row)."""

  def __init__(self, config, data, s, parts, step_fn, it, it_start, lookahead, log, k0,
               evaluates=True):
    self.config, self.data, self.s, self.parts, self.step_fn = config, data, s, parts, step_fn
    self.it, self.it_start, self.lookahead, self.log, self.k0 = it, it_start, lookahead, log, k0
    self.evaluates = evaluates
    self.g0 = schedule.Schedule(config).offset(s) + k0  # the global step this process starts at
    self.ahead = None  # (batch, metrics on device) of the next step, dispatched early
    self._passkey = None  # (prompts, predict) once train.eval_passkey first runs
    self.t0 = None

  def _dispatch(self, state, batch):
    with self.parts.mesh:
      return self.step_fn(state, mesh_lib.place_batch(batch, self.parts.mesh, self.config.rules))

  def step(self, state, k, consumed, read_now):
    stage = self.config.stages[self.s]
    if self.ahead is None:
      batch = next(self.it)
      self.t0 = time.perf_counter()
      with (self.log.phase(f"compiling the stage-{self.s} step (L={stage.seq_len}, batch "
                           f"{stage.batch}) and running step {self.g0}") if k == self.k0
            else contextlib.nullcontext()):
        state, m = self._dispatch(state, batch)
        if k == self.k0:
          jax.block_until_ready(m)
    else:
      (batch, m), self.ahead = self.ahead, None
    if self.lookahead and not read_now:
      nb = next(self.it)
      state, m_next = self._dispatch(state, nb)
      self.ahead = (nb, m_next)
    m = {key: float(v) for key, v in jax.device_get(m).items()}
    now = time.perf_counter()
    seconds, self.t0 = now - self.t0, now  # step k+1's time starts when step k's metrics arrive
    return state, m, batch, seconds, loss_tokens(self.data, self.s, k, consumed)

  def evaluate(self, state):
    """The held-out metrics (maxlm/eval/bpb.py) and loss by position (maxlm/eval/positions.py);
    the first evaluation of a process says which sources have too little held-out text to
    trust. None for an objective without them (dpo)."""
    if not self.evaluates:
      return {}
    config, stage, mesh = self.config, self.config.stages[self.s], self.parts.mesh

    def nll(batch):
      with mesh:
        return distributed.gather_rows(self.parts.nll(state["params"], mesh_lib.place_batch(
            distributed.host_rows(batch), mesh, config.rules), state.get(moe_state.BIAS)))
    table = bpb.evaluate_table(nll, self.data, stage.seq_len, stage.batch,
                               config.train.eval_tokens)
    if config.run_dir not in _WARNED_SMALL and bpb.small_sources(table):
      _WARNED_SMALL.add(config.run_dir)
      self.log(bpb.small_note(bpb.small_sources(table)))
    by_position = positions.by_position(nll, self.data, stage.seq_len, stage.batch,
                                        config.train.eval_tokens)
    return {**bpb.as_metrics(table), **positions.as_metrics(by_position),
            **self._passkey_metrics(state)}

  def _passkey_metrics(self, state):
    """train.eval_passkey's grid at this stage's lengths, as passkey/... metrics ({} if off)."""
    wanted = self.config.train.eval_passkey
    if not wanted.samples:
      return {}
    stage = self.config.stages[self.s]
    if self._passkey is None:  # the same prompts at every evaluation of the stage
      L = stage.seq_len
      prompt_lengths = [n for n in wanted.lengths if n <= L] or passkey.lengths_up_to(L)
      prompt_lengths += [2 * L] if wanted.extrapolate else []
      prompts = {task: long_eval.passkey_prompts(prompt_lengths, wanted.samples, wanted.seed,
                                                 self.data, self.config, task=task)
                 for task in wanted.tasks}
      fn = jax.jit(passkey.make_predict(self.parts.model, self.config.rules))
      self._passkey = prompts, long_eval.passkey_predictor(fn, self.parts.mesh, self.config)
    prompts, predict = self._passkey
    bias, out = state.get(moe_state.BIAS), {}
    for task, asked in prompts.items():
      grid = passkey.score(lambda batch, where: predict(state["params"], batch, where, bias),
                           asked, stage.seq_len, stage.batch)
      out.update(passkey.as_metrics(grid, task))
    return out


def loss_tokens(data, s, k, consumed):
  """Loss positions per source in global batch k of stage s (from the plan), added to the
  run's consumed tokens; the step's `loss_tokens/<source>` metrics."""
  rows = data.global_batch_pieces(s, k)
  pieces = [p for row in rows for p in row]
  cols = np.array([p[:6] for p in pieces], np.int64)
  block = plan.Block(row_ptr=None, pool=cols[:, 0], doc=cols[:, 1], start=cols[:, 2],
                     end=cols[:, 3], ctx=cols[:, 4], fim=cols[:, 5], order=None)
  loss = ledger.piece_counts(data.index, block)["loss"]
  out = {}
  for i, name in enumerate(data.index.sources):
    n = int(loss[cols[:, 0] == i].sum())
    if n:
      consumed[name] = consumed.get(name, 0) + n
      out[f"loss_tokens/{name}"] = n
  return out

"""`maxlm trace`: which documents made a step's loss, replayed exactly from a checkpoint.

Step K is numbered as metrics.jsonl's `step`: the 0-based global index of the update, so row K
logs the loss of the batch trained on with the parameters after K updates, i.e. those of
checkpoint K, and the update itself produced checkpoint K + 1. Training is deterministic
(batch k of stage s is a pure function of (data, config, s, k); the step is compiled the same
way), so the parameters before step K are rebuilt from the newest checkpoint C <= K by
rerunning the train steps C .. K - 1 (from the seed's initial parameters when no such
checkpoint is left, unless the run started from init.from), the same jitted functions
`maxlm train` runs. Then:
  - the train step on batch K gives the replayed loss, which equals the logged one bit for
    bit on the run's device count (`exact`);
  - the per-position NLL of the same parameters on batch K (the eval step, micro-batch by
    micro-batch under train.grad_accum) is summed per segment, i.e. per document piece.
The logged `loss` is the NLL summed over the step's loss positions over their count: model.z_loss
is part of the gradient but not of it, so the token-weighted mean of the pieces' losses equals
it, up to float32 summation order.

Spikes flagged during training (maxlm/train/spikes.py) are read from metrics.jsonl alone.
"""

import math

import jax
import numpy as np

from maxlm import MaxlmError, config as config_lib, io
from maxlm.ckpt import checkpoint, integrity
from maxlm.data import loader, plan
from maxlm.parallel import mesh as mesh_lib
from maxlm.train import metrics, resume, schedule, spikes, stage as stage_lib, step as step_lib


def open_config(run_dir):
  path = io.join(run_dir, "config.yaml")
  if not io.exists(path):
    raise MaxlmError(f"{run_dir} is not a run dir (no config.yaml); run `maxlm train` first")
  return config_lib.load(path, [f"run_dir={run_dir}"])


def trace(run_dir, g, log=print):
  """The replay of global step g as a JSON-able dict (see the module docstring)."""
  config = open_config(run_dir)
  sched = schedule.Schedule(config)
  try:
    s, k = sched.locate(g)
  except MaxlmError as e:
    raise MaxlmError(f"--{e}") from None
  data, vocab = stage_lib.validate(config)
  if jax.process_count() > 1:
    raise MaxlmError("maxlm trace runs in one process; run it on one host")
  state, at = _state_before(run_dir, config, data, vocab, g, log)
  for h in range(at, g):  # the steps between the checkpoint and g, as training ran them
    state, _ = _train_step(config, data, vocab, state, *sched.locate(h))
  parts = stage_lib.parts(config, s, vocab)
  batch = loader.stage_dataset(data, s)[k]
  state = jax.device_put(state, parts.shardings)
  nll_BxL = _nll(config, parts, state["params"], batch)
  _, m = _train_step(config, data, vocab, state, s, k, batch)
  logged = {r["step"]: r for r in metrics.read_jsonl(run_dir)}.get(g, {})
  out = {"step": g, "stage": s, "stage_step": k, "plan_step": data.plan_step(s, k),
         "from_checkpoint": at, "loss": logged.get("loss", m["loss"]),
         "replayed_loss": m["loss"], "logged": "loss" in logged,
         "exact": logged.get("loss") == m["loss"],
         **_documents(data, s, k, batch, nll_BxL)}
  return out


def _state_before(run_dir, config, data, vocab, g, log):
  """(state, its global step) from the newest checkpoint at or before g that restores, else
  the initial state at step 0."""
  ckpts = checkpoint.Checkpoints(run_dir, config.train.keep, False, log=log, read_only=True)
  try:
    found = ckpts.readable_before(g + 1)
    while found is not None:
      step_no, meta = found
      resume.check_same_model(config, vocab, meta)
      plan.check_resume(meta.get("planner"), step_no)  # another plan: other batches
      try:
        state = resume.restore_state(ckpts, step_no, meta, config, vocab)
        if meta.get("planner"):
          data.planner.seed_snapshot(plan.Snapshot(**meta["planner"]))
        return state, step_no
      except integrity.CorruptCheckpoint as e:
        log(f"{e}; trying the one before")
      found = ckpts.readable_before(step_no)
  finally:
    ckpts.close(rotate=False)
  started = getattr(getattr(config, "init", None), "from_", "")
  if started:
    raise MaxlmError(f"no checkpoint at or before step {g} is left in {run_dir}, and the run "
                     f"started from init.from {started}, not from its seed: step {g} cannot be "
                     "replayed (keep more checkpoints: train.keep)")
  parts = stage_lib.parts(config, 0, vocab)
  return step_lib.init_state(parts.model, parts.opt, parts.mesh, config.rules, config.seed,
                             config.stages[0].seq_len), 0


def _train_step(config, data, vocab, state, s, k, batch=None):
  parts = stage_lib.parts(config, s, vocab)
  state = jax.device_put(state, parts.shardings)
  if batch is None:
    batch = loader.stage_dataset(data, s)[k]
  with parts.mesh:
    state, m = parts.step(state, mesh_lib.place_batch(batch, parts.mesh, config.rules))
  return state, {key: float(v) for key, v in jax.device_get(m).items()}


def _nll(config, parts, params, batch):
  """Per-position NLL [rows, L] (float64), micro-batch by micro-batch as the step runs."""
  rows = len(batch["inputs"])
  micro = rows // config.train.grad_accum
  out = []
  for first in range(0, rows, micro):
    part = {f: v[first:first + micro] for f, v in batch.items()}
    with parts.mesh:
      out.append(np.asarray(jax.device_get(parts.nll(params, mesh_lib.place_batch(
          part, parts.mesh, config.rules))), np.float64))
  return np.concatenate(out)


def _documents(data, s, k, batch, nll_BxL):
  """Per piece, per row and step totals; pieces sorted by mean loss, worst first."""
  rows = data.global_batch_pieces(s, k)
  prov = data.provenance(rows)
  docs, per_row = [], []
  for r, pieces in enumerate(prov):
    seg, mask = batch["segment_ids"][r], batch["loss_mask"][r]
    row_nll = row_tokens = 0
    for j, piece in enumerate(pieces, 1):
      at = seg == j
      n, total = int(mask[at].sum()), float(nll_BxL[r][at].sum())
      docs.append({**piece, "row": r, "loss_tokens": n, "nll": total,
                   "loss": total / n if n else None})
      row_nll, row_tokens = row_nll + total, row_tokens + n
    per_row.append({"row": r, "pieces": len(pieces), "loss_tokens": row_tokens,
                    "loss": row_nll / row_tokens if row_tokens else None})
  docs.sort(key=lambda d: (-(d["loss"] if d["loss"] is not None else -math.inf), d["row"]))
  tokens = sum(d["loss_tokens"] for d in docs)
  nll = math.fsum(d["nll"] for d in docs)
  return {"documents": docs, "rows": per_row, "loss_tokens": tokens,
          "documents_loss": nll / tokens if tokens else None}


def spike_list(run_dir):
  """[{step, stage, stage_step, loss, mean, std, threshold, sigmas}] flagged in metrics.jsonl."""
  if not io.exists(io.join(run_dir, "metrics.jsonl")):
    raise MaxlmError(f"{run_dir} has no metrics.jsonl; run `maxlm train` first")
  return [{"step": g, "stage": r.get("stage"), "stage_step": r.get("stage_step"),
           "loss": r.get("loss"), **r["spike"]} for g, r in spikes.flagged(
               metrics.read_jsonl(run_dir))]


def format_trace(t, top):
  lines = [f"step {t['step']} (stage {t['stage']} step {t['stage_step']}, plan batch "
           f"{t['plan_step']}), replayed from "
           + (f"checkpoint {t['from_checkpoint']}" if t["from_checkpoint"] else "initialization")
           + f": loss {t['replayed_loss']:.6f}, logged "
           + (f"{t['loss']:.6f} ({'bit for bit' if t['exact'] else 'NOT the same'})"
              if t["logged"] else "(not in metrics.jsonl)"),
           f"{t['loss_tokens']:,} loss tokens in {len(t['documents'])} document pieces; their "
           f"token-weighted mean loss {t['documents_loss']:.6f}",
           f"{'loss':>8} {'tokens':>7} {'row':>4}  {'source':<10} {'tokens':<13} "
           f"{'ctx':>4} fim    doc"]
  for d in t["documents"][:top]:  # the id last and whole: ids often differ only at their end
    loss = f"{d['loss']:.4f}" if d["loss"] is not None else "-"
    lines.append(f"{loss:>8} {d['loss_tokens']:>7} {d['row']:>4}  {d['source']:<10} "
                 f"{d['start']:>6}-{d['end']:<6} {d['context']:>4} {str(d['fim']):<6} "
                 f"{d['doc_id']}")
  if len(t["documents"]) > top:
    lines.append(f"... {len(t['documents']) - top} more (--top N, or --json for all)")
  worst = sorted((r for r in t["rows"] if r["loss"] is not None), key=lambda r: -r["loss"])
  lines.append("rows, worst first: " + ", ".join(
      f"{r['row']}: {r['loss']:.4f} ({r['loss_tokens']})" for r in worst[:top]))
  return "\n".join(lines)


def format_spikes(found):
  if not found:
    return "no loss spikes flagged in metrics.jsonl"
  lines = [f"{'step':>7} {'stage':>5} {'loss':>9} {'mean':>9} {'std':>8} {'threshold':>9}"]
  for f in found:
    lines.append(f"{f['step']:>7} {f['stage']:>5} {f['loss']:>9.4f} {f['mean']:>9.4f} "
                 f"{f['std']:>8.4f} {f['threshold']:>9.4f}")
  return "\n".join(lines) + "\nmaxlm trace RUN_DIR --step K shows a step's documents"

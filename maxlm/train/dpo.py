"""DPO (Rafailov et al. 2023) on packed preference pairs: the loss, its metrics and its step.

A batch row holds pairs as adjacent segments (maxlm/data/pairs.py): the chosen answer in
segment k (`roles` 1), the rejected one in segment k + 1 (`roles` 2), both after the same
prompt. A segment's log-probability is the sum of its answer targets' log-probs (loss_mask 1:
the answer and its EOS), summed by SEGMENT ID, so nothing is ever read at a padding position
(segment 0, loss_mask 0) or at "the last position of the row".

  loss = -(1 - eps) log sigmoid(beta z) - eps log sigmoid(-beta z),
  z = (log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected))

with eps the label smoothing (conservative DPO). The reference model is the run's starting
weights (`init.from`), frozen: its log-probs come from a second forward pass in the step, not
from log-probs stored with the data. Why: a forward pass costs about a third of a training step
(tools/bench_dpo.py measures the whole DPO step against a pretraining step), while stored
log-probs would need a pass over the data before training, a file keyed to one plan and one
reference, and would go stale the moment the data, plan or reference changed.

Metrics (means over the step's pairs): dpo_loss, reward_margin (beta z), reward_accuracy
(the fraction with beta z > 0), chosen_logp / rejected_logp (the policy's summed log-probs),
pairs (their count). Per-position log-probs are computed in sequence chunks under
jax.checkpoint, so [B, L, vocab] never exists, and left to autodiff (DPO's weights differ
per segment, which chunked_cross_entropy's scalar custom VJP does not express).
"""

import jax
import jax.numpy as jnp
import flax.linen as nn

from maxlm.model import sharding
from maxlm.train import update

CHOSEN, REJECTED = 1, 2
METRICS = ("dpo_loss", "reward_margin", "reward_accuracy", "chosen_logp", "rejected_logp",
           "pairs")


def token_logprobs(h_BxLxD, head_DxV, targets_BxL, chunk):
  """log p(target) per position [B, L] (float32), in sequence chunks."""
  b, length, d = h_BxLxD.shape
  chunk = min(chunk, length)
  extra = -length % chunk
  if extra:
    h_BxLxD = jnp.pad(h_BxLxD, [(0, 0), (0, extra), (0, 0)])
    targets_BxL = jnp.pad(targets_BxL, [(0, 0), (0, extra)])
  n = h_BxLxD.shape[1] // chunk
  split = lambda x: jnp.moveaxis(x.reshape(b, n, chunk, *x.shape[2:]), 1, 0)

  @jax.checkpoint
  def one(h_BxCxD, t_BxC):
    logits = jnp.einsum("bcd,dv->bcv", h_BxCxD, head_DxV.astype(h_BxCxD.dtype),
                        preferred_element_type=jnp.float32)
    picked = jnp.take_along_axis(logits, t_BxC[..., None], axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)

  logp_NxBxC = jax.lax.map(lambda xs: one(*xs), (split(h_BxLxD), split(targets_BxL)))
  return jnp.moveaxis(logp_NxBxC, 0, 1).reshape(b, -1)[:, :length]


def pair_logprobs(logp_BxL, batch):
  """(chosen_BxS, rejected_BxS, is_pair_BxS): summed answer log-probs of the pair whose chosen
  segment is segment s of row b (S = L + 1 slots: segment ids run 0..L)."""
  seg_BxL, mask_BxL, role_BxL = batch["segment_ids"], batch["loss_mask"], batch["roles"]
  b, length = seg_BxL.shape
  slots = length + 1
  idx = (seg_BxL + slots * jnp.arange(b, dtype=seg_BxL.dtype)[:, None]).reshape(-1)
  summed = jax.ops.segment_sum((logp_BxL * mask_BxL).reshape(-1), idx, b * slots)
  role = jax.ops.segment_max(jnp.where(seg_BxL > 0, role_BxL, 0).reshape(-1), idx, b * slots)
  summed_BxS, role_BxS = summed.reshape(b, slots), role.reshape(b, slots)
  after_BxS = jnp.pad(summed_BxS[:, 1:], [(0, 0), (0, 1)])  # the next segment's sum
  next_role = jnp.pad(role_BxS[:, 1:], [(0, 0), (0, 1)])
  is_pair = (role_BxS == CHOSEN) & (next_role == REJECTED)
  return summed_BxS, after_BxS, is_pair


def dpo_terms(policy, reference, beta, smoothing):
  """(summed loss, metric sums) from pair_logprobs of the policy and the reference."""
  pc, pr, ok = policy
  rc, rr, _ = reference
  w = ok.astype(jnp.float32)
  z = beta * ((pc - rc) - (pr - rr))
  loss = -(1.0 - smoothing) * jax.nn.log_sigmoid(z) - smoothing * jax.nn.log_sigmoid(-z)
  sums = {"dpo_loss": (loss * w).sum(), "reward_margin": (z * w).sum(),
          "reward_accuracy": ((z > 0) * w).sum(), "chosen_logp": (pc * w).sum(),
          "rejected_logp": (pr * w).sum(), "pairs": w.sum()}
  return sums["dpo_loss"], sums


def forward(model, params, batch, rules, chunk):
  """(log p(target) per position [B, L], the step's max logit) of a policy; GRPO's too."""
  with nn.logical_axis_rules(sharding.rules_list(rules)):
    h, head, peak = model.apply({"params": params}, batch["inputs"], batch["positions"],
                                batch["segment_ids"])
  return token_logprobs(h, head, batch["targets"], chunk), peak


def make_train_step(model, opt, schedule, rules, model_cfg, grad_accum, beta, smoothing):
  """step(state, batch, ref_params) like step.make_train_step's step(state, batch); ref_params
  is the frozen reference, outside the state (the checkpoint does not hold it: a resume reads
  it again from init.from). The loss is the mean over the step's pairs."""
  chunk = model_cfg.loss_chunk

  def loss(params, ref_params, micro):
    logp, peak = forward(model, params, micro, rules, chunk)
    ref_logp, _ = forward(model, ref_params, micro, rules, chunk)
    total, sums = dpo_terms(pair_logprobs(logp, micro),
                            jax.lax.stop_gradient(pair_logprobs(ref_logp, micro)), beta,
                            smoothing)
    return total, ({**sums, "max_logit": peak}, None)

  update_fn = update.make_step(loss, opt, schedule, grad_accum, count="pairs")

  def step(state, batch, ref):
    new_state, common, sums, _ = update_fn(state, batch, ref)
    n = jnp.maximum(sums["pairs"], 1.0)
    metrics = {k: sums[k] / n for k in METRICS if k != "pairs"}
    metrics.update(loss=metrics["dpo_loss"], pairs=sums["pairs"], **common,
                   loss_tokens=(batch["loss_mask"] > 0).sum().astype(jnp.float32))
    return new_state, metrics

  return step


def reference_params(config, data, vocab, init_from, model, shardings, seq_len, log=print):
  """The frozen reference: the weights init.from named when the run started (`init_from`, the
  record its checkpoints carry), read again the same way on every start and resume."""
  import dataclasses
  from maxlm import MaxlmError, io
  from maxlm.interop import load as init_lib
  from maxlm.model import build
  if not init_from:
    raise MaxlmError("train.objective=dpo: this run has no init.from record (it started from "
                     "random weights), so it has no reference model; start a new run_dir with "
                     "init.from=RUN_DIR")
  spec = init_from["from"]
  cfg = dataclasses.replace(config, init=dataclasses.replace(config.init, from_=spec))
  name = data.manifest.get("tokenizer")
  ours = io.read_bytes(io.join(config.data.dir, name)) if name else None
  source = init_lib.open_source(cfg, vocab, ours, log=lambda *a: None)
  where = {tuple(getattr(k, "key", k) for k in p): s
           for p, s in jax.tree_util.tree_leaves_with_path(shardings["params"])}

  def put(keys, array):
    return jax.make_array_from_callback(array.shape, where[keys], lambda index: array[index])
  like = build.abstract_params(model, seq_len)
  params = init_lib.params(source, model.cfg, like, put)
  log(f"DPO reference model: {spec} (frozen)")
  return params


def with_reference(step_fn, ref_params):
  """step(state, batch) over the DPO step, its reference bound."""
  return lambda state, batch: step_fn(state, batch, ref_params)

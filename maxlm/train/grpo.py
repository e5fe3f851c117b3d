"""GRPO (Shao et al. 2024) on verifiable rewards: the loss, its jitted update and a stage's step.

Each step of a GRPO stage (`train.objective: grpo`, or `stages.N.objective: grpo`): take the
step's prompts (maxlm/train/rollouts.py), sample `group` completions of each with the current
policy (maxlm/eval/sample.py, seeded from (seed, step)), score them (maxlm/train/rewards.py),
normalize the rewards per group into advantages, pack the rollouts into a normal batch, then
take `inner_steps` optimizer steps on it. Per completion token t, with the log-probs of the
policy (logp), of the policy that sampled (old: the same weights before the first inner step,
so the ratio is exactly 1 there) and of the frozen reference (ref, the init.from weights, as
DPO's; maxlm/train/dpo.py):

  ratio = exp(logp - old);  x = ref - logp;  kl = exp(x) - x - 1          (k3, >= 0)
  loss_t = -(min(ratio A, clip(ratio, 1 - eps, 1 + eps) A) - beta kl)
  loss = sum_t w_t loss_t / sum_t w_t

with A the completion's advantage and w_t = 1 (loss_norm=token: every completion token weighs
the same, DAPO / Dr. GRPO) or 1 / the completion's length (loss_norm=sequence: each completion
weighs the same, the original GRPO). Log-probs are the model's own (temperature 1), whatever
temperature sampled. With beta 0 the reference pass is skipped.

Metrics: grpo_loss (also `loss`), kl (mean k3 over completion tokens), clip_fraction (tokens
whose clipped branch is the one taken), ratio (mean), reward_mean, reward_std, zero_std_groups,
completion_len, truncated (share of completions cut at max_new_tokens), gen_s and train_s
(seconds sampling and training), and at eval steps eval_pass@1 on train.grpo.eval_prompts.
"""

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from maxlm import MaxlmError, io
from maxlm.data import tokenizer
from maxlm.eval import sample as sample_lib
from maxlm.parallel import distributed, mesh as mesh_lib
from maxlm.train import dpo, rewards as rewards_lib, rollouts, schedule, update



def token_terms(logp, old_logp, ref_logp, adv, weight, mask, eps, beta):
  """(weighted loss sum, metric sums) over the completion tokens (mask 1)."""
  ratio = jnp.exp(logp - old_logp)
  clipped = jnp.clip(ratio, 1.0 - eps, 1.0 + eps)
  pg = jnp.minimum(ratio * adv, clipped * adv)
  x = ref_logp - logp
  kl = jnp.exp(x) - x - 1.0
  per_token = -(pg - beta * kl)
  took_clip = ((ratio < 1.0 - eps) & (adv < 0)) | ((ratio > 1.0 + eps) & (adv > 0))
  m = mask.astype(jnp.float32)
  total = (weight * per_token).sum()
  sums = {"grpo_loss": total, "kl": (m * kl).sum(), "clip_fraction": (m * took_clip).sum(),
          "ratio": (m * ratio).sum(), "weight": weight.sum(), "count": m.sum()}
  return total, sums


def make_update(model, opt, schedule, rules, model_cfg, grad_accum, cfg):
  """update(state, batch, old_logp, ref_params, inner) -> (state, metrics, logp before it):
  one optimizer step on a rollout batch (maxlm/train/update.py). At inner == 0 the ratio's
  denominator is the policy itself (old_logp unused); the state's step and rng advance after
  the last inner step only, so the learning-rate schedule counts outer steps."""
  chunk = model_cfg.loss_chunk

  def loss(params, fixed, micro):
    ref, inner = fixed
    logp, peak = dpo.forward(model, params, micro, rules, chunk)
    if cfg.beta > 0:
      ref_logp = jax.lax.stop_gradient(dpo.forward(model, ref, micro, rules, chunk)[0])
    else:
      ref_logp = jax.lax.stop_gradient(logp)
    old = jnp.where(inner == 0, jax.lax.stop_gradient(logp), micro["old"])
    total, sums = token_terms(logp, old, ref_logp, micro["advantages"], micro["weights"],
                              micro["loss_mask"], cfg.clip_eps, cfg.beta)
    return total, ({**sums, "max_logit": peak}, jax.lax.stop_gradient(logp))

  update_fn = update.make_step(loss, opt, schedule, grad_accum, count="weight", floor=1e-9)

  def step(state, batch, old_logp, ref, inner):
    new_state, common, sums, logp = update_fn(state, {**batch, "old": old_logp}, (ref, inner))
    n = jnp.maximum(sums["weight"], 1e-9)
    count = jnp.maximum(sums["count"], 1.0)
    metrics = {"grpo_loss": sums["grpo_loss"] / n, "kl": sums["kl"] / count,
               "clip_fraction": sums["clip_fraction"] / count, "ratio": sums["ratio"] / count,
               **common, "loss_tokens": sums["count"]}
    metrics["loss"] = metrics["grpo_loss"]
    last = inner == cfg.inner_steps - 1
    new_state["step"] = state["step"] + last.astype(state["step"].dtype)
    new_state["rng"] = jnp.where(last, new_state["rng"], state["rng"])
    return new_state, metrics, logp

  return step


class Stage:
  """One GRPO stage of a run: its prompts, verifier, sampler settings and reference model.
  `step(state, k, consumed, read_now)` runs the stage's step k and returns, as
  maxlm/train/planned.py's steps do, (state, metrics, this host's rows of the rollout batch as
  numpy arrays, seconds, the step's `prompt_tokens/<source>` metrics). No planned batches are
  read: `it` and `it_start` are None."""
  it = it_start = None

  def __init__(self, config, data, s, parts, update, ref_params, run_dir, log=print):
    self.config, self.cfg, self.data, self.parts = config, config.train.grpo, data, parts
    self.update, self.ref, self.run_dir, self.log = update, ref_params, run_dir, log
    self.s, self.stage = s, config.stages[s]
    self.offset = schedule.Schedule(config).offset(s)  # global step of the stage's step 0
    self.sp = tokenizer.load(io.read_bytes(io.join(config.data.dir, "tokenizer.model")))
    self.special = data.special
    self.prompts = rollouts.read_prompts(config.data.dir, config.mix_for(s))
    self.ids = [rollouts.encode_prompt(self.sp, p["prompt"], self.special.bos)
                for p in self.prompts]
    self.reward = rewards_lib.verifier(self.cfg.verify)
    rollouts.check_fits(self.prompts, self.sp, self.special.bos, self.cfg.max_new_tokens,
                        self.stage.seq_len)
    self.eval_prompts = (read_eval_prompts(self.cfg.eval_prompts) if self.cfg.eval_prompts
                         else [])

  def sample(self, params, ids, seed, n_samples):
    """Completions [[tokens] x n_samples] per prompt, and their texts."""
    with self.parts.mesh:
      out = sample_lib.sample_batch(
          self.parts.model, params, ids, n_samples=n_samples,
          max_new_tokens=self.cfg.max_new_tokens, temperature=self.cfg.temperature,
          top_k=self.cfg.top_k, top_p=self.cfg.top_p, seed=seed, eos_id=self.special.eos,
          mesh=self.parts.mesh, rules=self.config.rules)
    texts = [[rollouts.completion_text(self.sp, c, self.special) for c in grp] for grp in out]
    return out, texts

  def step(self, state, k, consumed, read_now=True):
    cfg, t0, s = self.cfg, time.perf_counter(), self.s
    g = self.offset + k
    idx = rollouts.step_prompts(len(self.prompts), cfg.prompts, self.config.seed, s, k)
    prompts = [self.prompts[i] for i in idx]
    completions, texts = self.sample(state["params"], [self.ids[i] for i in idx],
                                     rollouts.rollout_seed(self.config.seed, g), cfg.group)
    r = rollouts.score(texts, prompts, self.reward)
    adv, flat = rewards_lib.advantages(r)
    groups = [rollouts.segments(self.ids[i], c) for i, c in zip(idx, completions)]
    batch = rollouts.pack(groups, adv, self.stage.batch, self.stage.seq_len, self.special.pad,
                          cfg.loss_norm)
    t1 = time.perf_counter()
    mesh, batch = self.parts.mesh, distributed.host_rows(batch)
    placed = mesh_lib.place_batch(batch, mesh, self.config.rules)
    old = placed["advantages"]  # any [B, L] float array: unused at inner step 0
    with mesh:
      for inner in range(cfg.inner_steps):
        state, m, old = self.update(state, placed, old, self.ref, jnp.int32(inner))
      m = {key: float(v) for key, v in jax.device_get(m).items()}
    lengths = [len(c) for grp in completions for c in grp]
    reward_mean, reward_std = rewards_lib.moments(r)
    m.update(reward_mean=reward_mean, reward_std=reward_std, zero_std_groups=flat,
             completion_len=float(np.mean(lengths)),
             truncated=float(np.mean([c[-1] != self.special.eos for grp in completions
                                      for c in grp])),
             gen_s=t1 - t0, train_s=time.perf_counter() - t1)
    self._write(rollouts.jsonl_rows(g, prompts, texts, r))
    tokens = _prompt_tokens(prompts, [self.ids[i] for i in idx], cfg.group)
    return state, m, batch, time.perf_counter() - t0, ledger(tokens, consumed)

  def evaluate(self, state):
    """{eval_pass@1}: the held-out prompts, eval_samples each, seeded by the run's seed."""
    if not self.eval_prompts:
      return {}
    return {"eval_pass@1": pass_at_1(self, state["params"], self.eval_prompts,
                                     self.cfg.eval_samples)}

  def _write(self, lines):
    if jax.process_index() == 0:
      with open(os.path.join(self.run_dir, "rollouts.jsonl"), "a") as f:
        f.writelines(lines)


def pass_at_1(stage, params, prompts, samples, seed=None):
  """pass@1 of `samples` completions per prompt (maxlm/eval/verify.py's estimator)."""
  ids = [rollouts.encode_prompt(stage.sp, p["prompt"], stage.special.bos) for p in prompts]
  seed = rollouts.rollout_seed(stage.config.seed, rollouts.EVAL_STEP) if seed is None else seed
  _, texts = stage.sample(params, ids, seed, samples)
  return rewards_lib.pass_at_1(rollouts.score(texts, prompts, stage.reward))


def read_eval_prompts(path):
  from maxlm.eval import verify
  return verify.read_prompts(path)[0]


def _prompt_tokens(prompts, ids, group):
  """Prompt tokens the step's rows hold, per source (each prompt once per completion)."""
  out = {}
  for p, i in zip(prompts, ids):
    out[p["source"] or "prompts"] = out.get(p["source"] or "prompts", 0) + group * len(i)
  return out


def reference(config, data, vocab, init_from, model, shardings, seq_len, log=print):
  """The frozen reference (init.from's weights, as DPO reads them); None when beta is 0."""
  if config.train.grpo.beta == 0:
    return None
  if not init_from:
    raise MaxlmError("train.grpo.beta > 0 needs a reference model: start the run with "
                     "init.from=RUN_DIR, or set train.grpo.beta=0")
  return dpo.reference_params(config, data, vocab, init_from, model, shardings, seq_len,
                              lambda line: log(line.replace("DPO reference", "GRPO reference")))



def ledger(prompt_tokens, consumed):
  """The step's `prompt_tokens/<source>` metrics; adds them to the run's consumed tokens."""
  for name, n in prompt_tokens.items():
    consumed[name] = consumed.get(name, 0) + n
  return {f"prompt_tokens/{name}": n for name, n in prompt_tokens.items()}

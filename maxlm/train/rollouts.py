"""GRPO's rollouts: the prompts of a step, their sampled completions, and the packed batch.

Prompts are the data dir's RL prompts (`{"prompt", "gold"}` records, which `maxlm prepare`
writes to DATA_DIR/prompts.jsonl), restricted to the sources the stage's mix names when it
names any of theirs. Step k of a stage takes `train.grpo.prompts` of them from a keyed
permutation per epoch, so a step's prompts depend only on (seed, stage, k), and each completion
is sampled with a seed from (seed, global step): a resumed run draws the same rollouts.

A rollout batch is a normal batch (docs/batch.md), packed like a preference pair
(maxlm/data/pairs.py): each completion is its own segment, with its own positions from 0,

  [BOS] prompt completion            (the completion ends with the EOS it sampled, if any)

so every completion of a group repeats the group's prompt tokens (shared prompt), the prompt's
targets have loss_mask 0 (masked prompt), the EOS a completion sampled is a target with loss
(EOS learned; a completion cut at max_new_tokens has none), and segment ids keep completions
apart (no completion attends to another; padding is segment 0 and never read). Segments are
best-fit into the stage's `batch` rows of `seq_len`, longest first. Two float arrays ride
along: `advantages` (the completion's group-normalized advantage on its loss positions) and
`weights` (1 per loss position under loss_norm=token, 1 / the completion's length under
loss_norm=sequence; 0 elsewhere). We pack here rather than through maxlm/data/fill.py because
rollouts live in memory for one step and must never be cut, which is what fill's cuts are for.
"""

import json

import numpy as np

from maxlm import MaxlmError
from maxlm.data import assemble, pairs, prepare

FIELDS = assemble.FIELDS + ("advantages", "weights")
EVAL_STEP = 2**40  # the "step" whose seed samples the held-out evaluation


def read_prompts(data_dir, mix):
  """The data dir's RL prompts ([{id, source, prompt, gold}]), those of the mix's sources if
  the mix names any."""
  from maxlm import io
  path = io.join(data_dir, prepare.PROMPTS)
  if not io.exists(path):
    raise MaxlmError(f"train.objective=grpo: {data_dir} has no {prepare.PROMPTS}; prepare "
                     "{\"prompt\", \"gold\"} records into it (docs/rl.md)")
  rows = [_prompt_row(path, n, line) for n, line in enumerate(
      io.read_bytes(path).decode("utf-8", "replace").splitlines(), 1) if line.strip()]
  named = {r["source"] for r in rows} & {k for k, v in (mix or {}).items() if v > 0}
  return [r for r in rows if not named or r["source"] in named]


def _prompt_row(path, n, line):
  """One record of prompts.jsonl, or one line naming the file, the line and what is wrong."""
  try:
    row = json.loads(line)
  except json.JSONDecodeError as e:
    raise MaxlmError(f"{path}:{n}: not JSON ({e.msg}); maxlm prepare writes this file: "
                     "rerun it rather than editing the file") from None
  missing = [k for k in ("id", "source", "prompt", "gold") if not isinstance(row, dict)
             or k not in row]
  if missing:
    raise MaxlmError(f"{path}:{n}: a prompt record needs {', '.join(missing)}; maxlm prepare "
                     "writes this file: rerun it rather than editing the file")
  return row


def step_prompts(n_prompts, per_step, seed, s, k):
  """Indices of the prompts of stage s's step k: epoch e's keyed permutation, in order."""
  out = []
  for j in range(k * per_step, (k + 1) * per_step):
    epoch, at = divmod(j, n_prompts)
    order = np.random.default_rng([seed, 27, s, epoch]).permutation(n_prompts)
    out.append(int(order[at]))
  return out


def rollout_seed(seed, g):
  """The sampler's 64-bit seed of global step g."""
  words = np.random.SeedSequence([seed, 27, g]).generate_state(2, np.uint32)
  return (int(words[0]) << 32) | int(words[1])


def encode_prompt(sp, prompt, bos):
  return [bos] + pairs.prompt_ids(sp, prompt, not isinstance(prompt, str))


def completion_text(sp, tokens, special):
  """The text a verifier reads: cut at the first EOS (and at `<|end|>`, as verify.py does)."""
  ids = [t for t in tokens if t != special.eos]
  return sp.decode(ids).split("<|end|>")[0]


def segments(prompt_ids, completions):
  """[(segment tokens, loss weight per token)] of one group (prompt_ids starts with BOS)."""
  p = len(prompt_ids)
  out = []
  for c in completions:
    seg = np.asarray(list(prompt_ids) + list(c), np.int32)
    weight = np.zeros(len(seg), np.int32)
    weight[p:] = 1
    out.append((seg, weight))
  return out


def pack(groups, advantages, rows, seq_len, pad, loss_norm):
  """The rollout batch: groups [[(tokens, weight)]] and advantages [P, G] -> FIELDS [rows, L]."""
  segs = [(seg, w, float(advantages[i][j])) for i, grp in enumerate(groups)
          for j, (seg, w) in enumerate(grp)]
  room = [seq_len] * rows
  placed = [[] for _ in range(rows)]
  for n, idx in sorted(((len(s[0]) - 1, i) for i, s in enumerate(segs)), key=lambda t: -t[0]):
    fits = [r for r in range(rows) if room[r] >= n]
    if not fits:
      total = sum(len(s[0]) - 1 for s in segs)
      raise MaxlmError(f"GRPO rollouts ({len(segs)} completions, {total:,} positions) do not "
                       f"fit the stage's batch of {rows} rows x {seq_len}: raise the stage's "
                       "batch, or lower train.grpo.prompts / group / max_new_tokens")
    r = min(fits, key=lambda r: (room[r], r))
    placed[r].append(idx)
    room[r] -= n
  out = {f: np.zeros((rows, seq_len), np.float32 if f in ("advantages", "weights") else np.int32)
         for f in FIELDS}
  for r, members in enumerate(placed):
    at = 0
    for k, idx in enumerate(sorted(members), 1):
      seg, weight, adv = segs[idx]
      n, mask = len(seg) - 1, weight[1:]
      sl = slice(at, at + n)
      out["inputs"][r, sl], out["targets"][r, sl] = seg[:-1], seg[1:]
      out["segment_ids"][r, sl], out["positions"][r, sl] = k, np.arange(n)
      out["loss_mask"][r, sl] = mask
      out["advantages"][r, sl] = adv * mask
      out["weights"][r, sl] = mask / (mask.sum() if loss_norm == "sequence" else 1.0)
      at += n
    out["inputs"][r, at:] = pad
    out["targets"][r, at:] = pad
  return out


def score(groups_text, prompts, reward):
  """Rewards [P, G] of the completions' texts."""
  return np.array([[reward(t, p["gold"], p["prompt"]) for t in texts]
                   for texts, p in zip(groups_text, prompts)], np.float64)


def jsonl_rows(g, prompts, groups_text, rewards_PxG):
  """rollouts.jsonl lines of one step: step, prompt id, completion, reward."""
  return [json.dumps({"step": g, "prompt_id": p["id"], "completion": t, "reward": float(r)})
          + "\n" for p, texts, rs in zip(prompts, groups_text, rewards_PxG)
          for t, r in zip(texts, rs)]


def check_fits(prompts, sp, bos, max_new_tokens, seq_len):
  """A prompt whose segment cannot fit a row is one error."""
  longest = max(len(encode_prompt(sp, p["prompt"], bos)) for p in prompts)
  if longest + max_new_tokens - 1 > seq_len:
    raise MaxlmError(f"GRPO: the longest prompt is {longest} tokens (with BOS); with "
                     f"train.grpo.max_new_tokens={max_new_tokens} a completion segment needs "
                     f"{longest + max_new_tokens - 1} positions, more than seq_len={seq_len}")


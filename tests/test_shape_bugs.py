"""The five classic shape bugs of LM training data, each as a test that shows the failure it
prevents: the checker accepts what maxlm assembles and rejects the buggy variant.

1. targets not shifted;  2. prompt tokens in an SFT or DPO loss;  3. a missing EOT after a
document or an assistant turn;  4. chosen and rejected with different prompts;  5. the
reward / log-prob read at a padding position.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from maxlm.data import assemble, pairs, plan
from maxlm.train import dpo

import datagen

S = datagen.SPECIAL
CHAT_END = S.chat_end
# a chat document: <user> \n q q <end> <assistant> \n a a <end>; no loss on [0, 7)
CHAT = np.array([8, 12, 30, 31, CHAT_END, 9, 12, 40, 41, CHAT_END], np.int32)


def _stage(extra_docs=()):
  """Documents, a chat, and two pairs with different prompts, planned and assembled."""
  docs = datagen.make_docs([20, 13, 30, 17, 25], seed=3) + [("src", CHAT, [], [], [(0, 7)])]
  docs += list(extra_docs)
  mem = datagen.with_pairs(datagen.MemoryStore(docs), {2: (6, 11), 4: (4, 9)})
  cfg = datagen.make_config([{"seq_len": 64, "batch": 3, "steps": 2}],
                            {"overlap": 0, "shuffle_rows": 1, "block_rows": 6})
  planner = plan.Planner(mem.index, cfg)
  rows = planner.rows(0, 0, planner.stage_rows(0))
  arrays = [assemble.row_arrays(mem, S, 0, r, 64) for r in rows]
  return mem, rows, {f: np.stack([a[f] for a in arrays]) for f in assemble.FIELDS}


def _segments(mem, rows):
  """(row, positions, doc, expected loss mask, role) per segment, from the plan alone."""
  out = []
  for r, pieces in enumerate(rows):
    at = 0
    for piece in pieces:
      doc = piece[1]
      tokens = mem.tokens[doc]
      p, c = mem.index.pair_of(doc)
      if p:
        for role, answer in ((pairs.CHOSEN, c), (pairs.REJECTED, len(tokens) - p - c)):
          n = 1 + p + answer  # targets: the prompt's p, the answer's, its EOS
          out.append((r, np.arange(at, at + n), doc, [0] * p + [1] * (answer + 1), role))
          at += n
        continue
      n = len(tokens) + 1  # BOS + doc + EOS, minus one (no cuts here)
      mask = [1] * n
      for a, b in mem.index.no_loss(doc):
        mask[a:b] = [0] * (b - a)
      if mem.index.is_chat[doc]:
        mask[-1] = 0  # a chat's EOS: its last turn's <end> already ended it
      out.append((r, np.arange(at, at + n), doc, mask, 0))
      at += n
  return out


def check_loss_only_on_answers(batch, segs):
  for r, at, _, mask, _ in segs:
    assert batch["loss_mask"][r][at].tolist() == mask, "the loss is on answers only"


def check_eot(batch, segs, mem):
  for r, at, doc, _, role in segs:
    tgt, mask = batch["targets"][r][at], batch["loss_mask"][r][at]
    assert tgt[-1] == S.eos, "every document and answer ends with EOS"
    if mem.index.is_chat[doc]:
      assert tgt[-2] == CHAT_END and mask[-2] == 1, "an assistant turn ends with <end>, learned"
    else:
      assert mask[-1] == 1, "the EOS is learned"


def test_1_targets_are_shifted_inside_each_segment():
  _, _, batch = _stage()
  datagen.check_batch_rules(batch)
  unshifted = dict(batch, targets=batch["inputs"].copy())  # the bug: targets == inputs
  with pytest.raises(AssertionError, match="targets are next inputs"):
    datagen.check_batch_rules(unshifted)


def test_2_prompt_tokens_carry_no_loss_in_sft_and_dpo():
  mem, rows, batch = _stage()
  segs = _segments(mem, rows)
  assert {s[4] for s in segs} == {0, 1, 2} and any(mem.index.is_chat[s[2]] for s in segs)
  check_loss_only_on_answers(batch, segs)
  datagen.check_pair_rules(batch)
  everything = dict(batch, loss_mask=(batch["segment_ids"] > 0).astype(np.int32))  # the bug
  with pytest.raises(AssertionError, match="the loss is on answers only"):
    check_loss_only_on_answers(everything, segs)
  with pytest.raises(AssertionError, match="the target after BOS is prompt"):
    datagen.check_pair_rules(everything)
  # and DPO's log-probs do not move when the prompt's do
  rng = np.random.default_rng(0)
  logp = -rng.random(batch["targets"].shape).astype(np.float32)
  prompt = (batch["roles"] > 0) & (batch["loss_mask"] == 0)
  moved = np.where(prompt, logp - 5.0, logp)
  a, b = dpo.pair_logprobs(jnp.asarray(logp), batch), dpo.pair_logprobs(jnp.asarray(moved), batch)
  assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
  c = dpo.pair_logprobs(jnp.asarray(moved), everything)
  assert not np.allclose(np.asarray(c[0])[np.asarray(a[2])], np.asarray(a[0])[np.asarray(a[2])])


def test_3_every_document_and_assistant_turn_ends_with_a_learned_eot():
  mem, rows, batch = _stage()
  segs = _segments(mem, rows)
  check_eot(batch, segs, mem)
  dropped = {f: v.copy() for f, v in batch.items()}  # the bug: EOS never appended
  for r, at, *_ in segs:
    dropped["targets"][r][at[-1]] = S.pad
    dropped["loss_mask"][r][at[-1]] = 0
  with pytest.raises(AssertionError, match="ends with EOS"):
    check_eot(dropped, segs, mem)
  no_end = {f: v.copy() for f, v in batch.items()}  # the bug: the turn's <end> not learned
  for r, at, doc, *_ in segs:
    if mem.index.is_chat[doc]:
      no_end["loss_mask"][r][at[-2]] = 0
  with pytest.raises(AssertionError, match="assistant turn ends with <end>"):
    check_eot(no_end, segs, mem)


def test_4_chosen_and_rejected_share_one_prompt():
  mem, rows, batch = _stage()
  datagen.check_pair_rules(batch)
  # the bug: a pair assembled from two prompts (the rejected answer after another prompt)
  one, other = mem.tokens[2], mem.tokens[4]
  (c_seg, c_w, _), _ = pairs.segments(one, 6, 11, S)
  _, (r_seg, r_w, _) = pairs.segments(other, 4, 9, S)
  row = {f: np.zeros(64, np.int32) for f in assemble.FIELDS}
  at = 0
  for k, (seg, w, role) in enumerate(((c_seg, c_w, 1), (r_seg, r_w, 2)), 1):
    n = len(seg) - 1
    row["inputs"][at:at + n], row["targets"][at:at + n] = seg[:-1], seg[1:]
    row["segment_ids"][at:at + n], row["positions"][at:at + n] = k, np.arange(n)
    row["loss_mask"][at:at + n], row["roles"][at:at + n] = w[1:], role
    at += n
  mixed = {f: v[None] for f, v in row.items()}
  datagen.check_batch_rules(mixed)  # a well-formed batch otherwise
  with pytest.raises(AssertionError, match="share their prompt"):
    datagen.check_pair_rules(mixed)


def test_5_log_probs_come_from_segment_ids_never_from_padding():
  _, _, batch = _stage()
  pad = batch["segment_ids"] == 0
  assert pad.any(axis=1).all(), "every row ends in padding here"
  rng = np.random.default_rng(1)
  logp = -rng.random(batch["targets"].shape).astype(np.float32)
  garbage = np.where(pad, -1e4, logp)  # what a padding position may hold
  a = dpo.pair_logprobs(jnp.asarray(logp), batch)
  b = dpo.pair_logprobs(jnp.asarray(garbage), batch)
  assert np.asarray(a[2]).sum() > 0
  for x, y in zip(a, b):
    assert np.array_equal(x, y)
  # the bug: a sequence log-prob read as the cumulative sum at the row's last position (or at
  # "length - 1" of an unpacked, padded row) picks up padding
  naive = (garbage * batch["loss_mask"] + np.where(pad, garbage, 0)).sum(axis=1)
  ours = np.asarray(a[0]).sum(axis=1) + np.asarray(a[1]).sum(axis=1)
  rows_with_pairs = np.asarray(a[2]).any(axis=1)
  assert not np.allclose(naive[rows_with_pairs], ours[rows_with_pairs])
  # and each pair's sums are exactly those of its own segments
  for r, s in zip(*np.nonzero(np.asarray(a[2]))):
    for sid, got in ((s, a[0][r, s]), (s + 1, a[1][r, s])):
      here = batch["segment_ids"][r] == sid
      assert float(got) == pytest.approx(float((logp[r] * batch["loss_mask"][r])[here].sum()))

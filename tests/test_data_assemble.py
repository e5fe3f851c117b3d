import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

from maxlm.data import assemble, fim, ledger, plan

import datagen


def assemble_stage(mem, cfg, s):
  planner = plan.Planner(mem.index, cfg)
  L = cfg.stages[s].seq_len
  rows = planner.rows(s, 0, planner.stage_rows(s))
  arrays = [assemble.row_arrays(mem, datagen.SPECIAL, cfg.seed, r, L) for r in rows]
  batch = {f: np.stack([a[f] for a in arrays]) for f in assemble.FIELDS}
  return planner, rows, batch


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=25),
       L=st.sampled_from([16, 32, 64, 128]), overlap=st.integers(0, 7),
       fim_rate=st.sampled_from([0.0, 0.7]), chat=st.booleans(), seed=st.integers(0, 5))
def test_rows_obey_the_batch_contract_and_ledger(lengths, L, overlap, fim_rate, chat, seed):
  chats = {0: [(0, min(3, lengths[0]))]} if chat else None
  mem = datagen.MemoryStore(datagen.make_docs(lengths, seed=seed, chats=chats))
  cfg = datagen.make_config([{"seq_len": L, "batch": 3, "steps": 4}],
                            {"overlap": overlap, "fim": {"rate": fim_rate}, "shuffle_rows": 4,
                             "block_rows": 12}, seed)
  planner, rows, batch = assemble_stage(mem, cfg, 0)
  datagen.check_batch_rules(batch)
  for r, pieces in enumerate(rows):
    seg = batch["segment_ids"][r]
    assert seg.max() == len(pieces)
    for k, p in enumerate(pieces, 1):
      _, doc, start, end, ctx, mode = p
      where = np.flatnonzero(seg == k)
      inp, tgt = batch["inputs"][r][where], batch["targets"][r][where]
      segment = np.concatenate([inp, tgt[-1:]])
      bos, eos = start == 0, end == len(mem.tokens[doc])
      assert (segment[0] == datagen.SPECIAL.bos) == bos
      assert (segment[-1] == datagen.SPECIAL.eos) == eos
      inner = segment[int(bos):len(segment) - int(eos)]
      assert (inner[:ctx] == mem.tokens[doc][start - ctx:start]).all()
      body = inner[ctx:]
      if mode:
        body = fim.undo(body, mode, *fim.split_points(cfg.seed, doc, start, end - start))
      assert (body == mem.tokens[doc][start:end]).all(), "the body round-trips"
      mask = batch["loss_mask"][r][where]
      assert mask[:max(ctx - 1, 0)].sum() == 0, "context targets carry no loss"
  # the ledger, computed from the plan alone, equals what the batches contain
  st_led = ledger.stage_ledger(planner, 0)
  src = st_led["sources"]["src"]
  assert src["loss"] == batch["loss_mask"].sum()
  assert src["positions"] == (batch["segment_ids"] > 0).sum()
  assert st_led["padding"] == (batch["segment_ids"] == 0).sum()
  assert src["bos"] == (batch["inputs"] == datagen.SPECIAL.bos).sum()
  assert src["eos"] == (batch["targets"] == datagen.SPECIAL.eos).sum()
  assert src["fim_markers"] == np.isin(batch["inputs"], [4, 5, 6]).sum() + np.isin(
      batch["targets"][np.arange(len(rows))[:, None], _last_of_segment(batch)], [4, 5, 6]).sum()


def _last_of_segment(batch):
  """Column of each row's last non-padding position (targets there are seen only as targets)."""
  used = (batch["segment_ids"] > 0).sum(axis=1)
  return np.maximum(used - 1, 0)[:, None]


def test_two_documents_cannot_see_each_other_and_loss_is_exact():
  mem = datagen.MemoryStore([("a", np.array([11, 12, 13], np.int32), [], [], []),
                             ("a", np.array([21, 22], np.int32), [], [], [])])
  cfg = datagen.make_config([{"seq_len": 8, "batch": 1, "steps": 1}],
                            {"overlap": 0, "lookahead": 4, "shuffle_rows": 1, "block_rows": 1})
  _, rows, batch = assemble_stage(mem, cfg, 0)
  b, e = datagen.SPECIAL.bos, datagen.SPECIAL.eos
  (pieces,) = rows
  order = [p[1] for p in pieces]
  docs = {0: [b, 11, 12, 13, e], 1: [b, 21, 22, e]}
  want_inputs = [t for d in order for t in docs[d][:-1]]
  want_targets = [t for d in order for t in docs[d][1:]]
  n = len(want_inputs)
  assert batch["inputs"][0][:n].tolist() == want_inputs
  assert batch["targets"][0][:n].tolist() == want_targets
  assert batch["segment_ids"][0].tolist() == [1] * len(docs[order[0]][:-1]) + [2] * len(
      docs[order[1]][:-1]) + [0] * (8 - n)
  assert batch["loss_mask"][0].sum() == 4 + 3, "every target of both documents, EOS included"
  assert 21 not in batch["targets"][0][:len(docs[order[0]]) - 1]
  from maxlm.data.show import visibility
  vis = visibility(batch["segment_ids"][0])
  first = len(docs[order[0]]) - 1
  assert not vis[first:, :first].any() and not vis[:first, first:].any()


def test_chat_prompt_targets_carry_no_loss():
  # tokens: <user> \n q q <end> <assistant> \n a a <end> ; no-loss: [0,5) and [5,7)
  toks = np.array([8, 12, 30, 31, 10, 9, 12, 40, 41, 10], np.int32)
  mem = datagen.MemoryStore([("chat", toks, [], [], [(0, 5), (5, 7)])])
  cfg = datagen.make_config([{"seq_len": 16, "batch": 1, "steps": 1}],
                            {"overlap": 0, "shuffle_rows": 1, "block_rows": 1})
  planner, _, batch = assemble_stage(mem, cfg, 0)
  used = batch["segment_ids"][0] > 0
  counted = batch["targets"][0][used & (batch["loss_mask"][0] == 1)]
  assert counted.tolist() == [40, 41, 10], "assistant content and its end marker only"
  assert ledger.stage_ledger(planner, 0)["sources"]["chat"]["loss"] == 3

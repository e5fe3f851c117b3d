import dataclasses
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from maxlm import MaxlmError
from maxlm.data import chunk, plan

import datagen


def plan_all(planner):
  """Every stage's blocks: {(s, b): Block}."""
  return {(s, b): planner.block(s, b) for s in range(len(planner.config.stages))
          for b in range(planner.num_blocks(s))}


def coverage(planner, blocks):
  """Per-document token coverage counts of planned + still pending pieces."""
  idx = planner.index
  cov = [np.zeros(n, np.int64) for n in idx.length]
  pieces = [(int(blk.doc[k]), int(blk.start[k]), int(blk.end[k]))
            for blk in blocks.values() for k in range(len(blk.doc))]
  for pool in planner.pools:
    pieces += [(p[plan.DOC], p[plan.START], p[plan.END])
               for p in list(pool.window.values()) + list(pool.cut_queue)]
  for d, a, b in pieces:
    cov[d][a:b] += 1
  return cov


def expected_coverage(pool, doc):
  """Full epochs so far, plus one if the current epoch's cursor has passed the document."""
  done = max(pool.epoch, 0)
  current = (doc in set(pool.epoch_docs(pool.epoch, np.arange(pool.cursor)).tolist())
             if pool.epoch >= 0 else False)
  return done + int(current)


stage_st = st.tuples(st.sampled_from([16, 32, 64, 128, 256]), st.integers(1, 4),
                     st.integers(1, 12))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 700), min_size=1, max_size=40),
       stages=st.lists(stage_st, min_size=1, max_size=3), n_sources=st.integers(1, 3),
       overlap=st.integers(0, 7), lookahead=st.integers(1, 10), fim_rate=st.sampled_from([0, .5]),
       seed=st.integers(0, 3), data=st.data())
def test_every_body_token_exactly_once_per_epoch(lengths, stages, n_sources, overlap, lookahead,
                                                 fim_rate, seed, data):
  sources = [f"s{data.draw(st.integers(0, n_sources - 1))}" for _ in lengths]
  bounds = {i: data.draw(st.sets(st.integers(1, max(1, n - 1)), max_size=5))
            for i, n in enumerate(lengths)}
  mem = datagen.MemoryStore(datagen.make_docs(lengths, sources, seed, bounds))
  cfg = datagen.make_config(
      [{"seq_len": L, "batch": b, "steps": k} for L, b, k in stages],
      {"overlap": overlap, "lookahead": lookahead, "shuffle_rows": 4, "block_rows": 8,
       "fim": {"rate": fim_rate}}, seed)
  planner = plan.Planner(mem.index, cfg)
  blocks = plan_all(planner)
  cov = coverage(planner, blocks)
  for pool in planner.pools:
    for d in pool.docs.tolist():
      assert (cov[d] == expected_coverage(pool, d)).all(), (d, cov[d])
  for (s, _), blk in blocks.items():
    L = cfg.stages[s].seq_len
    for r in range(len(blk.row_ptr) - 1):
      a, b = blk.row_ptr[r], blk.row_ptr[r + 1]
      n = mem.index.length[blk.doc[a:b]]
      used = sum(chunk.positions(int(blk.start[k] == 0), int(blk.ctx[k]),
                                 int(blk.end[k] - blk.start[k]), int(blk.end[k] == n[k - a]),
                                 int(blk.fim[k])) for k in range(a, b))
      assert 0 < used <= L
      assert all(blk.ctx[k] == min(overlap, blk.start[k]) or blk.start[k] == 0
                 for k in range(a, b))
      assert all(blk.fim[k] == 0 or blk.ctx[k] == 0 for k in range(a, b))


def worst_quota_drift(lengths, quotas, L, lookahead, seed):
  """Over every row, the most any source got ahead of and behind its quota share of body
  tokens, in units of the largest piece so far."""
  names = [f"s{i}" for i in range(len(quotas))]
  sources = [names[i % len(names)] for i in range(len(lengths))]
  mem = datagen.MemoryStore(datagen.make_docs(lengths, sources, seed))
  cfg = datagen.make_config([{"seq_len": L, "batch": 4, "steps": 30}],
                            {"mix": dict(zip(names, quotas)), "lookahead": lookahead,
                             "shuffle_rows": 8, "block_rows": 40, "overlap": 4}, seed)
  planner = plan.Planner(mem.index, cfg)
  q = planner.quotas[0]
  taken, largest, ahead, behind = np.zeros(len(names)), 1, 0.0, 0.0
  for b in range(planner.num_blocks(0)):
    blk = planner.block(0, b)
    for r in np.argsort(blk.order):  # in packing order (rows are shuffled afterwards)
      a, e = blk.row_ptr[r], blk.row_ptr[r + 1]
      body = (blk.end[a:e] - blk.start[a:e]).astype(np.int64)
      np.add.at(taken, blk.pool[a:e], body)
      largest = max(largest, int(body.max()))
      drift = (taken - q * taken.sum()) / largest
      ahead, behind = max(ahead, drift.max()), max(behind, -drift.min())
  return ahead, behind


quota_case = dict(lengths=st.lists(st.integers(1, 900), min_size=6, max_size=60),
                  L=st.sampled_from([64, 128, 512]), lookahead=st.integers(1, 16),
                  seed=st.integers(0, 9))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(quota=st.floats(0.02, 0.98), **quota_case)
def test_two_sources_stay_within_one_piece_of_quota_at_every_row(quota, lengths, L, lookahead,
                                                                 seed):
  ahead, behind = worst_quota_drift(lengths, [quota, 1 - quota], L, lookahead, seed)
  assert ahead <= 1.0 and behind <= 1.0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(quotas=st.lists(st.floats(0.05, 1.0), min_size=3, max_size=4), **quota_case)
def test_more_sources_stay_near_quota_at_every_row(quotas, lengths, L, lookahead, seed):
  # No source ever gets a piece ahead (a row opens with a source not ahead of its share); how
  # far one falls behind is checked by construction, save a forced row opening (worst seen in
  # 300 random cases: 1.02 pieces).
  ahead, behind = worst_quota_drift(lengths, quotas, L, lookahead, seed)
  assert ahead <= 1.0 and behind <= 1.5


def test_block_is_pure_function_of_stage_and_index():
  mem = datagen.MemoryStore(datagen.make_docs(list(range(5, 400, 7)), ["a", "b"] * 28 + ["a"], 1))
  cfg = datagen.make_config([{"seq_len": 64, "batch": 4, "steps": 25},
                             {"seq_len": 128, "batch": 2, "steps": 20}],
                            {"mix": {"a": 1, "b": 3}, "shuffle_rows": 4, "block_rows": 12, "overlap": 8})
  sequential = plan.Planner(mem.index, cfg)
  expected = plan_all(sequential)
  for (s, b) in [(1, 2), (0, 3), (1, 0), (0, 0), (1, 3)]:  # jump around, fresh and reused
    fresh = plan.Planner(mem.index, cfg)
    for planner in (fresh, sequential):
      got = planner.block(s, b)
      for f in ("row_ptr", "pool", "doc", "start", "end", "ctx", "fim", "order"):
        assert np.array_equal(getattr(got, f), getattr(expected[(s, b)], f)), (s, b, f)
  snap = sequential.snapshot(1, 2)
  restored = plan.Planner(mem.index, cfg)
  restored.seed_snapshot(snap)
  assert np.array_equal(restored.block(1, 2).doc, expected[(1, 2)].doc)
  assert restored._state == (1, 3)  # planned from the snapshot, not from stage 0


def test_stage_continues_pool_cursors():
  lengths = [100] * 30
  mem = datagen.MemoryStore(datagen.make_docs(lengths))
  one = datagen.make_config([{"seq_len": 128, "batch": 2, "steps": 5}],
                            {"lookahead": 1, "shuffle_rows": 1, "block_rows": 10})
  two = datagen.make_config([{"seq_len": 128, "batch": 2, "steps": 5},
                             {"seq_len": 256, "batch": 2, "steps": 2}],
                            {"lookahead": 1, "shuffle_rows": 1, "block_rows": 10})
  first = plan.Planner(mem.index, one).block(0, 0).doc.tolist()
  both = plan.Planner(mem.index, two)
  second = both.block(1, 0).doc.tolist()
  assert both.block(0, 0).doc.tolist() == first
  assert not set(first) & set(second), "stage 1 must not re-read stage 0's documents"


def test_snapshot_survives_json_and_a_fresh_planner_plans_only_from_it():
  mem = datagen.MemoryStore(datagen.make_docs([40 + (i * 53) % 500 for i in range(90)],
                                              ["a", "b", "c"] * 30, 4))
  cfg = datagen.make_config([{"seq_len": 128, "batch": 4, "steps": 40},
                             {"seq_len": 256, "batch": 2, "steps": 30}],
                            {"mix": {"a": 1, "b": 2, "c": 1}, "shuffle_rows": 4,
                             "block_rows": 8, "overlap": 8, "lookahead": 5,
                             "fim": {"rate": 0.5}}, 3)
  sequential = plan.Planner(mem.index, cfg)
  want = {(s, b): sequential.block(s, b) for s, b in [(0, 17), (1, 6)]}
  for s, b in want:
    saved = json.loads(json.dumps(dataclasses.asdict(sequential.snapshot(s, b))))
    assert saved["version"] == plan.VERSION
    fresh = plan.Planner(mem.index, cfg)
    fresh.seed_snapshot(plan.Snapshot(**saved))
    fresh.warm(s)  # a snapshot of stage s is known: nothing planned
    assert fresh._state is None
    assert np.array_equal(fresh.block(s, b).doc, want[(s, b)].doc)
    assert fresh._state == (s, b + 1)


def test_a_snapshot_of_another_plan_version_is_refused():
  assert plan.VERSION == 3
  with pytest.raises(MaxlmError, match="checkpoint 40 was planned with data plan v1; this "
                                       r"maxlm \(.*\) plans v3.*start over"):
    plan.check_resume({"stage": 0, "block": 1, "pools": [], "taken": [], "largest": 1}, 40)
  with pytest.raises(MaxlmError, match="data plan v1"):
    plan.check_resume(None, 40)
  with pytest.raises(MaxlmError, match="checkpoint 7 was planned with data plan v2; .* plans v3"):
    plan.check_resume({"version": 2}, 7)
  plan.check_resume({"version": plan.VERSION}, 40)
  planner = plan.Planner(datagen.MemoryStore(datagen.make_docs([10] * 4)).index,
                         datagen.make_config([{"seq_len": 32, "batch": 2, "steps": 2}]))
  with pytest.raises(MaxlmError, match="v2 cannot seed plan v3"):
    planner.seed_snapshot(plan.Snapshot(0, 0, [], [], 1, version=2))


def test_the_planner_holds_no_per_document_state():
  mem = datagen.MemoryStore(datagen.make_docs([3 + i % 7 for i in range(3 * plan.CHUNK)],
                                              ["a", "b"] * (3 * plan.CHUNK // 2)))
  cfg = datagen.make_config([{"seq_len": 64, "batch": 8, "steps": 400}],
                            {"shuffle_rows": 8, "block_rows": 64, "overlap": 4})
  planner = plan.Planner(mem.index, cfg)
  for b in range(planner.num_blocks(0)):
    planner.block(0, b)
  for pool in planner.pools:
    assert np.shares_memory(pool.docs, mem.index.pool_docs)  # a view, not a copy
    assert pool.epoch >= 1 and len(pool._chunk[2]) <= plan.CHUNK
  # an epoch's order, read position by position, is each pool's documents once
  pool = planner.pools[0]
  order = np.concatenate([pool.epoch_docs(1, np.arange(a, min(a + 1000, pool.n)))
                          for a in range(0, pool.n, 1000)])
  assert np.array_equal(np.sort(order), np.sort(pool.docs))
  assert len(planner._recent) <= plan.KEEP_SNAPSHOTS


def test_the_plan_is_pinned():
  # Batches are a pure function of (data, config, stage, step) under plan.VERSION: a change
  # here changes every run's batches and needs a new version (plan.check_resume). Documents
  # longer than a row with boundaries every 7 tokens, so rows are also filled by cuts (v3).
  mem = datagen.MemoryStore(datagen.make_docs([5 + (i * 37) % 200 for i in range(30)],
                                              ["a", "b"] * 15, 1,
                                              {i: range(3, 200, 7) for i in range(30)}))
  cfg = datagen.make_config([{"seq_len": 64, "batch": 2, "steps": 4}],
                            {"shuffle_rows": 2, "block_rows": 8, "overlap": 4,
                             "fim": {"rate": 0.5}}, 7)
  blk = plan.Planner(mem.index, cfg).block(0, 0)
  assert blk.doc.tolist() == PINNED_DOCS
  assert blk.start.tolist() == PINNED_STARTS
  assert blk.end.tolist() == PINNED_ENDS
  assert blk.fim.tolist() == PINNED_FIM


PINNED_DOCS = [22, 1, 28, 11, 0, 10, 7, 7, 10, 7, 9, 10, 6, 9, 10, 9]
PINNED_STARTS = [0, 0, 0, 0, 0, 0, 45, 0, 45, 59, 87, 59, 0, 0, 87, 45]
PINNED_ENDS = [19, 42, 41, 12, 5, 45, 59, 45, 59, 64, 138, 87, 27, 45, 129, 59]
PINNED_FIM = [0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 0, 0]


def test_ledger_counts_each_document_once_per_stage():
  from maxlm.data import ledger
  mem = datagen.MemoryStore(datagen.make_docs([5 + (i * 61) % 300 for i in range(37)],
                                              ["a", "b", "c"] * 12 + ["a"], 2))
  cfg = datagen.make_config([{"seq_len": 64, "batch": 4, "steps": 30},
                             {"seq_len": 128, "batch": 2, "steps": 9}],
                            {"shuffle_rows": 4, "block_rows": 8, "overlap": 4})
  planner = plan.Planner(mem.index, cfg)
  led = ledger.ledger(planner)
  for s, st in enumerate(led["stages"]):
    blocks = [planner.block(s, b) for b in range(planner.num_blocks(s))]
    for i, name in enumerate(mem.index.sources):
      docs = {int(d) for blk in blocks for d in blk.doc[blk.pool == i]}
      assert st["sources"][name]["documents"] == len(docs), (s, name)

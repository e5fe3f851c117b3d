import numpy as np

from maxlm.data import chunk, fill, ledger, plan

import datagen


def packed_rows(planner, s=0):
  """Every row of stage s in packing order: [(doc, start, end, ctx, positions)]."""
  idx, rows = planner.index, []
  for b in range(planner.num_blocks(s)):
    blk = planner.block(s, b)
    for r in np.argsort(blk.order):
      row = []
      for k in range(blk.row_ptr[r], blk.row_ptr[r + 1]):
        doc, a, e, ctx = int(blk.doc[k]), int(blk.start[k]), int(blk.end[k]), int(blk.ctx[k])
        n = int(idx.length[doc])
        row.append((doc, a, e, ctx, chunk.positions(int(a == 0), ctx, e - a, int(e == n),
                                                     int(blk.fim[k]))))
      rows.append(row)
  return rows


def long_documents(every, n_docs=40, seed=0):
  lengths = [300 + (i * 97) % 900 for i in range(n_docs)]
  bounds = {i: range(every, n, every) for i, n in enumerate(lengths)} if every else None
  return datagen.MemoryStore(datagen.make_docs(lengths, ["a"] * n_docs, seed, bounds))


def test_rows_of_long_documents_are_filled_to_the_slack():
  mem = long_documents(every=5)
  L, overlap = 128, 8
  cfg = datagen.make_config([{"seq_len": L, "batch": 8, "steps": 20}],
                            {"overlap": overlap, "shuffle_rows": 8, "block_rows": 40})
  planner = plan.Planner(mem.index, cfg)
  rows = packed_rows(planner)
  assert len(rows) * L < 0.8 * sum(mem.index.length)  # the epoch never runs dry
  left = [L - sum(p[4] for p in row) for row in rows]
  # a fill cut ends within 4 tokens of the room (a boundary every 5); a row stops filling only
  # when its room could not hold min_fill tokens after a piece's context
  assert max(left) < planner.min_fill + overlap + 5
  assert sum(left) / (len(rows) * L) < 0.02
  fills = [p for row in rows for p in row[1:] if p[2] < mem.index.length[p[0]]]
  assert fills and all(p[2] % 5 == 0 for p in fills), "fill cuts end on a boundary"
  led = ledger.stage_ledger(planner, 0)
  assert led["sources"]["a"]["in_word"] == 0
  assert led["padding"] == sum(left)


def test_without_boundaries_a_fill_cut_goes_inside_a_word_and_the_ledger_counts_it():
  mem = long_documents(every=0)
  L = 128
  cfg = datagen.make_config([{"seq_len": L, "batch": 8, "steps": 20}],
                            {"overlap": 8, "shuffle_rows": 8, "block_rows": 40})
  planner = plan.Planner(mem.index, cfg)
  rows = packed_rows(planner)
  cut = sum(1 for row in rows for p in row if p[2] < mem.index.length[p[0]])
  assert ledger.stage_ledger(planner, 0)["sources"]["a"]["in_word"] == cut > 0
  slack = chunk.slack(L)
  # only a room over 4 slacks is filled inside a word
  assert all(p[4] > 4 * slack for row in rows for p in row[1:]
             if p[2] < mem.index.length[p[0]])


def test_the_ledger_counts_in_word_cuts_as_the_index_records_boundaries():
  mem = datagen.MemoryStore(datagen.make_docs(
      [50 + (i * 61) % 400 for i in range(30)], ["a", "b"] * 15, 3,
      {i: range(7, 450, 11 + i % 5) for i in range(0, 30, 2)}))
  cfg = datagen.make_config([{"seq_len": 64, "batch": 4, "steps": 30}],
                            {"overlap": 4, "shuffle_rows": 4, "block_rows": 40})
  planner = plan.Planner(mem.index, cfg)
  want = {"a": 0, "b": 0}
  for b in range(planner.num_blocks(0)):
    blk = planner.block(0, b)
    for k in range(len(blk.doc)):
      doc, end = int(blk.doc[k]), int(blk.end[k])
      if end < mem.index.length[doc] and end not in mem.index.bounds(doc)[0].tolist():
        want[mem.index.sources[blk.pool[k]]] += 1
  got = ledger.stage_ledger(planner, 0)["sources"]
  assert {name: got[name]["in_word"] for name in want} == want
  assert want["a"] < want["b"], "documents with boundaries are cut inside words less"


def test_a_fill_cut_leaves_the_rest_of_the_piece_in_its_place():
  mem = long_documents(every=5, n_docs=6)
  cfg = datagen.make_config([{"seq_len": 128, "batch": 1, "steps": 4}],
                            {"overlap": 8, "lookahead": 4, "shuffle_rows": 1, "block_rows": 4})
  planner = plan.Planner(mem.index, cfg)
  planner._goto(0, 0)
  pool = planner.pools[0]
  pool.fill()
  before = list(pool.window.items())
  seq, head, rest = pool.fill_cut(60)
  assert (seq, head[fill.START]) == (before[0][0], before[0][1][fill.START])
  assert head[fill.SIZE] <= 60 and head[fill.END] == rest[fill.START]
  assert rest[fill.CTX] == min(8, rest[fill.START]) and rest[fill.END] == before[0][1][fill.END]
  pool.put_back(seq, rest)
  assert list(pool.window) == [s for s, _ in before] and pool.head() == (seq, rest)
  assert pool.by_size == sorted((p[fill.SIZE], -s) for s, p in pool.window.items())

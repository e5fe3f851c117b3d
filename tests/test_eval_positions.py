"""Held-out loss by position (maxlm/eval/positions.py): buckets, which documents fill them,
the same tokens at every stage."""

import numpy as np

from maxlm import config as config_lib
from maxlm.data import assemble, loader
from maxlm.eval import positions

import datagen


def test_buckets_are_powers_of_four_from_64_ending_at_the_stage_length():
  assert positions.buckets(128) == [(0, 64), (64, 128)]
  assert positions.buckets(1024) == [(0, 64), (64, 256), (256, 1024)]
  assert positions.buckets(4096)[-1] == (1024, 4096)
  big = positions.buckets(2**20)
  assert len(big) == 8 and big[-2:] == [(65536, 262144), (262144, 2**20)]


def _row(seq_len, segments):
  """A hand-built row: segments [(targets, loss-masked leading positions)] one after another."""
  batch = {f: np.zeros((1, seq_len), np.int32) for f in assemble.FIELDS}
  at = 0
  for k, (n, masked) in enumerate(segments, 1):
    batch["segment_ids"][0, at:at + n] = k
    batch["positions"][0, at:at + n] = np.arange(n)
    batch["loss_mask"][0, at + masked:at + n] = 1
    at += n
  return batch


def test_a_bucket_counts_only_documents_that_fill_it():
  seq_len = 400
  batch = _row(seq_len, [(300, 0), (50, 0), (40, 10)])
  # nll: 1 per position of the long document, 100 on the short ones (which must not count)
  nll = np.where(batch["segment_ids"][0] == 1, 1.0, 100.0)
  nll = nll + 0.001 * batch["positions"][0]
  spans = positions.buckets(seq_len)
  nll_sum, count = np.zeros((2, len(spans))), np.zeros((2, len(spans)), np.int64)
  pieces = [(0, 7, 0, 299, 0, 0), (1, 8, 0, 49, 0, 0), (1, 9, 0, 39, 0, 0)]
  positions.add_row(nll, batch, 0, pieces, spans, nll_sum, count)
  got = positions.table(["a", "b"], spans, nll_sum, count)
  assert list(got) == ["a"]  # source b's documents are shorter than 64: they fill nothing
  assert got["a"]["0-64"] == {"tokens": 64, "loss": 1.0 + 0.001 * np.mean(np.arange(64))}
  assert got["a"]["64-256"]["tokens"] == 192
  assert np.isclose(got["a"]["64-256"]["loss"], 1.0 + 0.001 * np.mean(np.arange(64, 256)))
  assert "256-400" not in got["a"]  # 300 targets do not reach position 399


def test_loss_masked_context_is_not_counted():
  batch = _row(128, [(100, 20)])
  spans = positions.buckets(128)
  nll_sum, count = np.zeros((1, 2)), np.zeros((1, 2), np.int64)
  positions.add_row(np.ones(128), batch, 0, [(0, 0, 0, 99, 20, 0)], spans, nll_sum, count)
  assert count.tolist() == [[44, 0]]  # positions 20..63; 100 targets do not fill 64-128


def _data(tmp_path, lengths, sources, seq_len=256):
  docs = datagen.make_docs(lengths, sources, seed=3)
  data_dir = datagen.write_data_dir(tmp_path / "d", docs, val_fraction=0.5)
  cfg = datagen.make_config([{"seq_len": seq_len, "batch": 2, "steps": 1}], {"dir": data_dir})
  return loader.Data(cfg)


def _position_nll(batch):
  """A stand-in model whose loss at a target is its position: bucket losses are known."""
  return batch["positions"].astype(np.float64) * (batch["loss_mask"] > 0)


def test_the_same_documents_and_tokens_fill_a_bucket_at_every_stage(tmp_path):
  lengths = [30, 900, 70, 3000, 200, 1500, 40, 5000, 600, 2500, 10, 800]
  data = _data(tmp_path, lengths, ["p", "q"] * 6)
  short = positions.by_position(_position_nll, data, 256, 2, 100_000)
  long = positions.by_position(_position_nll, data, 1024, 2, 100_000)
  assert "64-256" in short["q"] and "64-256" not in short["p"]  # p holds out short documents
  for source, cells in short.items():
    for bucket in cells:
      assert cells[bucket] == long[source][bucket]
      start, end = map(int, bucket.split("-"))
      assert np.isclose(cells[bucket]["loss"], (start + end - 1) / 2)
  index = data.index
  for s, name in enumerate(index.sources):
    val = [d for d in range(len(index.length)) if index.split[d] == 1 and index.source[d] == s]
    filling = sum(int(index.length[d]) + 1 >= 1024 for d in val)
    if filling:
      assert long[name]["256-1024"]["tokens"] == 768 * filling


def test_documents_are_the_longest_held_out_within_the_budget(tmp_path):
  data = _data(tmp_path, [100, 900, 300, 2000, 50, 700, 20, 1000], ["p"] * 8)
  index = data.index
  val = sorted((int(index.length[d]) for d in range(8) if index.split[d] == 1), reverse=True)
  docs = positions.documents(index, val[0] + val[1])[0]
  assert sorted((int(index.length[d]) for d in docs), reverse=True) == val[:2]
  assert len(positions.documents(index, 1)[0]) == 1  # at least one
  table = positions.by_position(_position_nll, data, 256, 2, val[0] + val[1])
  assert positions.from_metrics(positions.as_metrics(table)) == {
      n: {b: e["loss"] for b, e in cells.items()} for n, cells in table.items()}


def test_every_evaluation_logs_loss_by_position_per_source(tmp_path_factory, data_dir):
  """Training's evaluations (maxlm/train/loop.py) write val_pos_loss/<source>/<bucket>."""
  from maxlm.train import loop, metrics
  from smallrun import small_config
  tmp = tmp_path_factory.mktemp("positions")
  cfg = config_lib.load(str(small_config(tmp, data_dir)))
  loop.train(cfg, log=lambda *_: None)
  evals = [r for r in metrics.read_jsonl(cfg.run_dir) if "val_loss" in r]
  by_stage = {r["stage"]: positions.from_metrics(r) for r in evals}
  assert sorted(by_stage) == list(range(len(cfg.stages)))
  for s, stage in enumerate(cfg.stages):
    names = [positions.bucket_name(*b) for b in positions.buckets(stage.seq_len)]
    for source in ("prose", "code"):
      assert list(by_stage[s][source]) == names[:len(by_stage[s][source])]
      assert all(np.isfinite(v) for v in by_stage[s][source].values())


def test_plot_draws_one_curve_per_stage_against_log_position():
  from maxlm.train import plot, plot_positions
  rows = [{"step": 0, "stage": 0, "loss": 5.0},
          {"step": 1, "stage": 0, "loss": 4.0, "val_loss": 4.0,
           **positions.as_metrics({"a": {"0-64": {"tokens": 30, "loss": 4.0},
                                         "64-256": {"tokens": 10, "loss": 3.0}},
                                   "b": {"0-64": {"tokens": 10, "loss": 2.0}}})},
          {"step": 2, "stage": 1, "loss": 3.5, "val_loss": 3.0,
           **positions.as_metrics({"a": {"0-64": {"tokens": 30, "loss": 3.0},
                                         "64-256": {"tokens": 10, "loss": 2.5},
                                         "256-1024": {"tokens": 5, "loss": 2.0}}})}]
  assert plot_positions.curves(rows) == {
      0: [(0, 64, (4.0 * 30 + 2.0 * 10) / 40), (64, 256, 3.0)],
      1: [(0, 64, 3.0), (64, 256, 2.5), (256, 1024, 2.0)]}
  fig = plot.figure(rows, {0: "s256 (L=256)", 1: "s1024 (L=1024)"})
  (ax,) = [a for a in fig.axes if a.get_title(loc="left") == plot_positions.TITLE]
  assert [line.get_label() for line in ax.lines] == ["s256 (L=256)", "s1024 (L=1024)"]
  assert ax.get_xscale() == "log" and list(ax.lines[1].get_ydata()) == [3.0, 2.5, 2.0]
  assert not plot_positions.present(rows[:1])

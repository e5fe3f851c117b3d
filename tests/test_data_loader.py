import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import yaml

from maxlm import config
from maxlm.data import assemble, loader

import datagen


@pytest.fixture(scope="module")
def cfg_path(tmp_path_factory):
  root = tmp_path_factory.mktemp("loader")
  rng = np.random.default_rng(3)
  lengths = rng.lognormal(np.log(60), 1.0, 300).astype(int) + 1
  sources = ["prose" if i % 3 else "code" for i in range(len(lengths))]
  bounds = {i: range(20, int(n), 37) for i, n in enumerate(lengths)}
  data_dir = datagen.write_data_dir(root / "data", datagen.make_docs(lengths, sources, 3, bounds))
  path = root / "cfg.yaml"
  path.write_text(yaml.safe_dump({
      "seed": 5, "data": {"dir": data_dir, "mix": {"prose": 0.7, "code": 0.3}, "overlap": 8,
                          "shuffle_rows": 4, "block_rows": 16, "fim": {"rate": 0.3}},
      "stages": [{"seq_len": 64, "batch": 4, "steps": 12},
                 {"seq_len": 128, "batch": 4, "steps": 6}]}))
  return str(path)


def read(cfg_path, s, first, count, **kw):
  data = loader.Data(config.load(cfg_path))
  it = loader.iterator(data, s, start_step=first, **kw)
  return [next(it) for _ in range(count)]


def same(a, b):
  return all(np.array_equal(x[f], y[f]) for x, y in zip(a, b) for f in assemble.FIELDS)


def test_batches_follow_the_contract(cfg_path):
  for s in (0, 1):
    for batch in read(cfg_path, s, 0, 3):
      datagen.check_batch_rules(batch)


RESUME = textwrap.dedent("""
    import sys, numpy as np
    from maxlm import config
    from maxlm.data import loader
    cfg_path, ckpt, out = sys.argv[1:]
    data = loader.Data(config.load(cfg_path))
    it = loader.restore_iterator(ckpt, loader.iterator(data, 1))
    np.savez(out, **loader.stack([next(it) for _ in range(3)]))
""")


def test_restart_in_fresh_process_is_bitwise_identical(cfg_path, tmp_path):
  data = loader.Data(config.load(cfg_path))
  it = loader.iterator(data, 1)
  for _ in range(2):
    next(it)
  loader.save_iterator(str(tmp_path / "ckpt"), it)
  uninterrupted = [next(it) for _ in range(3)]
  out = tmp_path / "resumed.npz"
  subprocess.run([sys.executable, "-c", RESUME, cfg_path, str(tmp_path / "ckpt"), str(out)],
                 check=True)
  with np.load(out) as resumed:
    for f in assemble.FIELDS:
      assert resumed[f].tobytes() == loader.stack(uninterrupted)[f].tobytes(), f
  assert same(read(cfg_path, 1, 2, 3), uninterrupted), "resuming by step alone matches too"


def test_host_count_does_not_change_the_global_batch(cfg_path):
  whole = read(cfg_path, 0, 5, 3)
  halves = [read(cfg_path, 0, 5, 3, host=h, hosts=2) for h in (0, 1)]
  quarters = [read(cfg_path, 0, 5, 3, host=h, hosts=4) for h in range(4)]
  for k in range(3):
    for f in assemble.FIELDS:
      assert np.array_equal(np.concatenate([h[k][f] for h in halves]), whole[k][f])
      assert np.array_equal(np.concatenate([q[k][f] for q in quarters]), whole[k][f])


def test_where_a_previous_run_stopped_does_not_matter(cfg_path):
  data = loader.Data(config.load(cfg_path))
  late = loader.stage_dataset(data, 1)[4]  # a fresh planner jumping straight to stage 1
  warm = loader.Data(config.load(cfg_path))
  for k in range(12):
    loader.stage_dataset(warm, 0)[k]
  assert same([late], [loader.stage_dataset(warm, 1)[4]])


def test_provenance_matches_rows(cfg_path):
  data = loader.Data(config.load(cfg_path))
  prov = json.loads(loader.provenance_json(data, 0, [2]))
  batch = loader.stage_dataset(data, 0)[2]
  for r, pieces in enumerate(prov[0]):
    assert len(pieces) == batch["segment_ids"][r].max()
    for p in pieces:
      assert p["source"] in ("prose", "code") and p["end"] > p["start"] >= p["context"] >= 0


@pytest.mark.slow
def test_worker_count_does_not_change_batches(cfg_path):
  assert same(read(cfg_path, 0, 3, 4, workers=2), read(cfg_path, 0, 3, 4, workers=0))


def test_without_the_document_mask_a_row_is_one_segment(cfg_path):
  """data.document_mask=false (the mask ablation) changes only what a token may see: the same
  tokens, targets and loss, one segment per row, positions running across the row."""
  data = loader.Data(config.load(cfg_path, ["data.document_mask=false"]))
  merged = next(loader.iterator(data, 0))
  (masked,) = read(cfg_path, 0, 0, 1)
  for f in ("inputs", "targets", "loss_mask", "roles"):
    np.testing.assert_array_equal(merged[f], masked[f])
  used = masked["segment_ids"] > 0
  assert (masked["segment_ids"].max(axis=1) > 1).any()  # rows of several documents
  np.testing.assert_array_equal(merged["segment_ids"], used.astype(np.int32))
  width = used.shape[1]
  np.testing.assert_array_equal(merged["positions"], np.where(used, np.arange(width), 0))


def test_the_document_mask_ablation_is_for_lm_stages_only(cfg_path):
  with pytest.raises(config.ConfigError, match="document_mask=false with a dpo/grpo"):
    config.load(cfg_path, ["data.document_mask=false", "train.objective=grpo"])

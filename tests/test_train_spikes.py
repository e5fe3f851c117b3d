import json
import math
import shutil

import numpy as np
import pytest

from maxlm import MaxlmError, config as config_lib
from maxlm.data import loader
from maxlm.train import metrics, spikes

import datagen
from smallrun import small_config


def test_a_spike_is_flagged_against_its_stages_trailing_window():
  rng = np.random.default_rng(0)
  losses = list(4.0 - 0.01 * np.arange(40) + rng.normal(0, 0.02, 40))
  losses[30] += 1.0  # the spike
  det = spikes.Detector(window=10, sigmas=6.0)
  flags = [det.observe(0, x) for x in losses]
  assert [i for i, f in enumerate(flags) if f] == [30]
  window = np.array(losses[20:30])
  assert flags[30]["mean"] == pytest.approx(window.mean())
  assert flags[30]["threshold"] == pytest.approx(window.mean() + 6 * window.std())
  # a new stage starts an empty window: its first steps are never flagged
  assert det.observe(1, 100.0) is None and det.state() == {"stage": 1, "losses": [100.0]}
  # non-finite losses are not flagged and stay out of the window
  det = spikes.Detector(window=3, sigmas=1.0, state={"stage": 0, "losses": [1.0, 1.1, 0.9]})
  assert det.observe(0, math.nan) is None and det.losses == [1.0, 1.1, 0.9]
  assert det.observe(0, 2.0)["sigmas"] > 1


def test_a_resumed_detector_flags_what_an_uninterrupted_one_does():
  rng = np.random.default_rng(1)
  losses = list(3.0 + rng.normal(0, 0.05, 60))
  for at in (25, 26, 47):
    losses[at] += 0.6
  whole = spikes.Detector(8, 4.0)
  want = [whole.observe(0, x) for x in losses]
  assert [i for i, f in enumerate(want) if f]  # the series has spikes
  for cut in (5, 25, 26, 40):
    first = spikes.Detector(8, 4.0)
    got = [first.observe(0, x) for x in losses[:cut]]
    saved = json.loads(json.dumps(first.state()))  # as checkpoint metadata holds it
    second = spikes.Detector(8, 4.0, saved)
    got += [second.observe(0, x) for x in losses[cut:]]
    assert got == want, cut


def test_spike_config_keys_are_checked():
  base = {"stages": [{"seq_len": 8, "batch": 1, "steps": 1}]}
  for bad in ({"spike_window": -1}, {"spike_sigmas": 0}):
    with pytest.raises(config_lib.ConfigError, match="train.spike"):
      config_lib.from_dict({**base, "train": bad})


def _config(tmp, data_dir, overrides=(), **train):
  tmp.mkdir(exist_ok=True)
  return config_lib.load(str(small_config(tmp, data_dir, **train)), list(overrides))


def _train_rows(cfg, **kw):
  from maxlm.train import loop
  loop.train(cfg, log=lambda *_: None, **kw)
  return {r["step"]: r for r in metrics.read_jsonl(cfg.run_dir)}


def _strip(row):
  return {k: v for k, v in row.items() if k not in ("tokens_per_s", "mfu")}


def test_spikes_and_skips_are_resume_exact_in_training(tmp_path, data_dir):
  """A tiny run with a spike rule tight enough to fire on ordinary noise, and a skip range:
  killed (stop_after) and resumed, every row is the uninterrupted run's, spike flags
  included; the recipe (move later checkpoints aside, add a skip) equals a run that had the
  skip from the start."""
  train = {"spike_window": 2, "spike_sigmas": 0.5, "keep": 20}
  skip = ["data.skip_steps=[[3, 5]]"]
  full = _config(tmp_path / "a", data_dir, skip, **train)
  want = _train_rows(full)
  assert any("spike" in r for r in want.values()), "the tight rule flags something"
  parted = _config(tmp_path / "b", data_dir, skip, **train)
  _train_rows(parted, stop_after=4)
  got = _train_rows(parted)
  assert {g: _strip(r) for g, r in got.items()} == {g: _strip(r) for g, r in want.items()}
  assert [g for g, _ in spikes.flagged(metrics.read_jsonl(parted.run_dir))] == [
      g for g, r in sorted(want.items()) if "spike" in r]
  # the recipe: a run without the skip (here stopped at step 6: the recipe needs a checkpoint
  # after step 3, not the whole schedule), its checkpoints after step 3 moved aside, resumed
  plain = _config(tmp_path / "c", data_dir, **train)
  before = _train_rows(plain, stop_after=6)
  assert sorted(before) == list(range(6))
  assert before[3]["fingerprint"] != want[3]["fingerprint"]
  ckpt_dir = tmp_path / "c" / "run" / "checkpoints"
  for step in [p for p in ckpt_dir.iterdir() if p.name.isdigit() and int(p.name) > 3]:
    shutil.move(str(step), str(tmp_path / f"aside-{step.name}"))
  with pytest.raises(MaxlmError, match="skip_steps"):  # from a checkpoint after the start
    late = _config(tmp_path / "c", data_dir, ["data.skip_steps=[[2, 5]]"], **train)
    _train_rows(late)
  from maxlm.train import loop
  again = _config(tmp_path / "c", data_dir, skip, **train)
  assert loop.train(again, log=lambda *_: None)["resumed_from"] == 3
  after = {r["step"]: r for r in metrics.read_jsonl(again.run_dir)}  # the last row of a step
  assert {g: _strip(after[g]) for g in after} == {g: _strip(want[g]) for g in want}


def test_skip_steps_shift_the_batches_and_extend_the_stage_plan(tmp_path):
  lengths = (np.random.default_rng(2).lognormal(np.log(30), 0.7, 300).astype(int) + 2).tolist()
  sources = ["a" if i % 3 else "b" for i in range(len(lengths))]
  data_dir = datagen.write_data_dir(tmp_path / "d", datagen.make_docs(lengths, sources))
  data = {"dir": data_dir, "overlap": 4, "shuffle_rows": 4, "block_rows": 8}
  stages = lambda n0: [{"seq_len": 32, "batch": 4, "steps": n0}, {"seq_len": 32, "batch": 4,
                                                                  "steps": 5}]
  skipped = loader.Data(datagen.make_config(stages(8), {**data, "skip_steps": [[2, 4], [7, 9]]}))
  # the same plan without skips: stage 0 three batches longer (2 in it, 1 of [7, 9))
  longer = loader.Data(datagen.make_config(stages(11), data))
  plain = loader.Data(datagen.make_config(stages(8), data))
  ds_skip, ds_long = loader.stage_dataset(skipped, 0), loader.stage_dataset(longer, 0)
  assert [skipped.plan_step(0, k) for k in range(8)] == [0, 1, 4, 5, 6, 8, 9, 10]
  for k in range(8):
    j = skipped.plan_step(0, k)
    for f in ds_skip[k]:
      assert (ds_skip[k][f] == ds_long[j][f]).all()
    assert skipped.global_batch_pieces(0, k) == longer.global_batch_pieces(0, j)
    if j < 8:
      assert skipped.global_batch_pieces(0, k) == plain.global_batch_pieces(0, j)
  # [7, 9) reaches one step into stage 1 (global step 8 is its step 0)
  assert [skipped.plan_step(1, k) for k in range(3)] == [1, 2, 3]
  host = loader.stage_dataset(skipped, 1, host=1, hosts=2)
  assert (host[0]["inputs"] == loader.stage_dataset(skipped, 1)[0]["inputs"][2:]).all()
  with pytest.raises(config_lib.ConfigError, match="after the schedule"):
    loader.Data(datagen.make_config(stages(8), {**data, "skip_steps": [[13, 20]]}))
  for bad in ([[4, 2]], [[1, 5], [4, 6]], [[1, 2, 3]]):
    with pytest.raises(config_lib.ConfigError, match="skip_steps"):
      datagen.make_config(stages(8), {**data, "skip_steps": bad})

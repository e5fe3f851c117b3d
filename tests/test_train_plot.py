"""`maxlm plot`: the panels, the smoothing, the stage labels and the per-source curves, read
off the matplotlib figure (not pixels)."""

import json

import numpy as np
import pytest
import yaml

from maxlm import MaxlmError
from maxlm.train import plot


def _run_dir(tmp_path, resumed=True):
  rng = np.random.default_rng(0)
  rows = []
  for g in range(60):  # steps 0 and 40 compile (first of a stage): slow
    stage = 0 if g < 40 else 1
    row = {"step": g, "stage": stage, "stage_step": g if stage == 0 else g - 40,
           "loss": 6 - g / 20 + rng.normal(0, 0.5), "lr": 1e-3, "grad_norm": 1.0,
           "param_norm": 10.0, "max_logit": 3.0, "tokens_per_s": 1000.0, "mfu": 0.3}
    if g in (0, 40):
      row.update(tokens_per_s=10.0, mfu=0.003)
    if g == 33:
      row.update(loss=9.0, spike={"mean": 4.5, "std": 0.5, "threshold": 6.0, "sigmas": 9.0})
    if g % 20 == 19:
      row.update({"val_loss": 4.0, "val_bpb": 1.5, "val_loss/prose": 4.2, "val_bpb/prose": 1.6,
                  "val_loss/code": 3.8, "val_bpb/code": 1.3, "val_tokens/prose": 20_000,
                  "val_tokens/code": 812, "val_bytes/prose": 61_000, "val_bytes/code": 2_400})
    rows.append(row)
  if resumed:  # a kill after step 30, resumed from 25: steps 25..30 logged twice
    rows = rows[:31] + [{**rows[25], "tokens_per_s": 10.0, "mfu": 0.003}] + rows[26:]
  rows.insert(10, {"step": 9, "event": "spike"})  # a row that is not a step
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  (tmp_path / "config.yaml").write_text(yaml.safe_dump({"stages": [
      {"name": "short", "seq_len": 128, "batch": 16}, {"name": "", "seq_len": 1024,
                                                         "batch": 2}]}))
  return tmp_path


def test_panels_stage_labels_and_per_source_curves(tmp_path):
  run = _run_dir(tmp_path)
  rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  fig = plot.figure(rows, plot.stage_labels(str(run)))
  axes = {ax.get_title(loc="left"): ax for ax in fig.axes if ax.get_title(loc="left")}
  assert list(axes)[:len(plot.PANELS)] == [plot.TITLES[p] for p in plot.PANELS]
  loss = axes["training loss"]
  raw, smooth = loss.get_lines()[:2]
  assert raw.get_alpha() < 0.5 and len(raw.get_xdata()) == 60  # each step once
  assert smooth.get_label().startswith("EMA over")
  assert np.std(np.diff(smooth.get_ydata()[:40])) < np.std(np.diff(raw.get_ydata()[:40])) / 2
  texts = [t.get_text().strip() for t in loss.texts]
  assert texts == ["short (L=128)", "stage 1 (L=1024)"]
  spikes = loss.get_lines()[2]
  assert list(spikes.get_xdata()) == [33] and list(spikes.get_ydata()) == [9.0]
  assert spikes.get_label().startswith("spike")
  assert [line.get_xdata()[0] for line in loss.get_lines()[3:]] == [39.5]  # the boundary
  for title in ("held-out loss per token", "held-out bits per byte"):
    labels = [t.get_text() for t in axes[title].get_legend().get_texts()]
    assert labels == ["all sources", "code (small: 812 tokens)", "prose"]
  bpb = {line.get_label(): line.get_ydata() for line in axes["held-out bits per byte"].lines}
  assert list(bpb["code (small: 812 tokens)"]) == [1.3, 1.3, 1.3]  # one curve across stages
  assert list(bpb["prose"]) == [1.6, 1.6, 1.6]
  mfu = [t.get_text() for t in axes["MFU and tokens/s"].get_legend().get_texts()]
  assert mfu == ["MFU %", "tokens/s"]
  mfu_line = axes["MFU and tokens/s"].lines[0]
  assert list(mfu_line.get_ydata()) == pytest.approx([30] * 57)  # 0, 40 and the resumed 25
  assert {0, 25, 40}.isdisjoint(mfu_line.get_xdata())  # compiled: left out


def test_save_writes_a_png_and_says_when_there_is_nothing(tmp_path):
  (tmp_path / "run").mkdir()
  run = _run_dir(tmp_path / "run", resumed=False)
  out = tmp_path / "curves.png"
  plot.save(str(run), str(out))
  assert out.read_bytes()[:4] == b"\x89PNG"
  (tmp_path / "empty").mkdir()
  with pytest.raises(MaxlmError, match="no metrics.jsonl yet"):
    plot.save(str(tmp_path / "empty"), str(out))


def test_a_source_whose_scored_text_changed_is_flagged():
  rows = [{"step": 1, "val_tokens/a": 30_000}, {"step": 2, "val_tokens/a": 30_000},
          {"step": 3, "val_tokens/b": 9_999}, {"step": 4, "val_tokens/b": 12_000}]
  assert plot.source_label(rows, "a") == "a"
  assert plot.source_label(rows, "b") == "b (scored text changed)"
  assert plot.source_label(rows[2:3], "b") == "b (small: 9,999 tokens)"
  assert plot.source_label([{"step": 1, "val_loss/c": 2.0}], "c") == "c"  # an older run


def test_ema_is_bias_corrected_and_skips_nan():
  assert plot.ema([2.0, 2.0, 2.0], 10) == [2.0, 2.0, 2.0]
  out = plot.ema([float("nan"), 1.0, 3.0], 1)
  assert np.isnan(out[0]) and out[1:] == [1.0, 3.0]
  assert plot.smoothing_span(10) == 1 and plot.smoothing_span(1000) == 100

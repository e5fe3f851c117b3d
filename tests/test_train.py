import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from maxlm import MaxlmError, config as config_lib
from maxlm.train import metrics, optimizer, plot

from limits import HANG_S
from smallrun import ROOT, maxlm, small_config  # the data_dir fixture: tests/conftest.py
import xlaflags


def test_schedule_is_continuous_and_decay_skips_norms():
  train = config_lib.TrainConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
  lr = optimizer.lr_schedule(train, 100)
  values = [float(lr(i)) for i in range(100)]
  assert values[10] == pytest.approx(1.0) and values[0] == pytest.approx(0.1)
  assert values[-1] == pytest.approx(0.1, abs=0.01) and max(values) <= 1.0
  assert all(abs(a - b) < 0.11 for a, b in zip(values, values[1:])), "no jumps at stages"
  wsd = optimizer.lr_schedule(config_lib.TrainConfig(lr=1.0, warmup_steps=10,
                                                     schedule="wsd", decay_fraction=0.2), 100)
  assert float(wsd(50)) == pytest.approx(1.0) and float(wsd(99)) < 0.2
  params = {"embedding": 0, "head": 0, "layers": {"attention_norm": {"scale": 0},
                                                  "mlp": {"gate_up": {"kernel": 0}}}}
  mask = optimizer.decay_mask(params, decay_embeddings=False)
  assert mask == {"embedding": False, "head": False,
                  "layers": {"attention_norm": {"scale": False}, "mlp": {"gate_up": {"kernel": True}}}}


def test_event_files_are_valid_tfrecords(tmp_path):
  assert metrics.crc32c(b"123456789") == 0xE3069283
  w = metrics.Writer(str(tmp_path))
  w.write(7, {"loss": 2.5, "fingerprint": "abc"})
  w.close()
  (events,) = tmp_path.glob("events.out.tfevents.*")
  assert metrics.read_events(str(events)) == [(0, {}), (7, {"loss": 2.5})]


def test_train_resume_and_plot(tmp_path, data_dir):
  from maxlm.train import loop
  cfg = config_lib.load(str(small_config(tmp_path, data_dir)))
  first = loop.train(cfg, stop_after=4, log=lambda *_: None)
  assert first["stopped"] and first["step"] == 4
  shutil.copytree(cfg.run_dir, tmp_path / "moved")
  rest = loop.train(cfg, log=lambda *_: None)
  assert rest["resumed_from"] == 4 and not rest["stopped"] and rest["step"] == 11
  rows = metrics.read_jsonl(cfg.run_dir)
  for key in ("step", "stage", "loss", "lr", "grad_norm", "param_norm", "max_logit",
              "tokens_per_s", "mfu", "loss_tokens/prose", "loss_tokens/code"):
    assert key in rows[-1], key
  assert any("val_bpb" in r and "val_loss" in r for r in rows)
  assert [r["stage"] for r in rows] == [0] * 6 + [1] * 5
  plot.save(cfg.run_dir, str(tmp_path / "curves.png"))
  assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
  other = config_lib.load(str(small_config(tmp_path, data_dir)), ["model.d_ff=96"])
  with pytest.raises(MaxlmError, match="another model .d_ff 64 there, 96 here"):
    loop.train(other, log=lambda *_: None)

  # resumed on another mesh: the same batches, losses equal to tolerance
  moved = config_lib.load(str(small_config(tmp_path, data_dir)), [
      f"run_dir={tmp_path / 'moved'}", "stages.0.mesh.data=2", "stages.0.mesh.fsdp=4"])
  assert loop.train(moved, log=lambda *_: None)["resumed_from"] == 4
  want = {r["step"]: r for r in rows if r["step"] >= 4}
  got = {r["step"]: r for r in metrics.read_jsonl(moved.run_dir) if r["step"] >= 4}
  assert sorted(got) == sorted(want) == list(range(4, 11))
  for step, row in got.items():
    assert row["fingerprint"] == want[step]["fingerprint"]
    assert row["loss"] == pytest.approx(want[step]["loss"], rel=1e-4)


def test_a_source_no_stage_trains_on_is_named_at_train_eval_and_plot(tmp_path, data_dir, here):
  """data.mix leaves 'code' out: train says so (data.strict=true refuses), eval marks it."""
  from maxlm.train import loop
  path = small_config(tmp_path, data_dir)
  proc = here("train", path, "data.mix={prose: 1}", "data.strict=true")
  assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
  assert "no stage's mix names source 'code': not trained on" in proc.stderr
  said = []
  cfg = config_lib.load(str(path), ["data.mix={prose: 1}", "stages.1.mix={prose: 2}"])
  loop.train(cfg, stop_after=1, log=said.append)
  assert [line for line in said if "'code'" in line] == [
      "warning: no stage's mix names source 'code': not trained on (add it to data.mix, a "
      "source of preference pairs to a dpo stage's mix, or prepare without it; "
      "data.strict=true makes this an error)"]
  proc = here("eval", cfg.run_dir, "--json")
  assert proc.returncode == 0, proc.stderr
  out = json.loads(proc.stdout)
  assert {n: e["trained"] for n, e in out["sources"].items()} == {"prose": True, "code": False}
  assert out["not_trained"] == ["code"]
  text = here("eval", cfg.run_dir).stdout
  assert "\ncode*!" in text and "! not trained on: no stage's mix names code" in text
  assert plot.untrained(cfg.run_dir, ["code", "prose"]) == ["code"]
  assert plot.source_label([], "code", ["code"]) == "code (not trained on)"


def test_config_errors_come_before_compiling(tmp_path, data_dir):
  path = small_config(tmp_path, data_dir)
  (tmp_path / "a_file").write_text("")
  for overrides, message in (
      (["stages.0.mesh.data=3"], "stages.0.mesh"),
      (["stages.1.attention=gpu"], "set stages.1.attention=auto"),
      (["data.dir=/nowhere"], "run `maxlm prepare INPUT... --out /nowhere` first"),
      (["modle.size=tiny"], "did you mean 'model'"),
      (["model.vocab_size=10"], "smaller than the tokenizer"),
      ([f"run_dir={tmp_path / 'a_file' / 'run'}"], "is not writable"),
      (["stages.0.attention=splash", "stages.0.block_q=24"], "multiples of 128"),
      (["stages.0.seq_len=40", "stages.0.mesh.data=1", "stages.0.mesh.context=8"],
       "2 x context = 16"),
      (["stages.1.mesh.data=1", "stages.1.mesh.fsdp=4", "stages.1.mesh.tensor=2"],
       "stages.1.mesh: parameter layers/attention/key/kernel has 1 along 'kv_heads', which the "
       "mesh splits 2 ways (tensor)")):
    proc = maxlm("train", path, *overrides)
    assert proc.returncode == 2 and message in proc.stderr, (overrides, proc.stderr)
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1
  assert not (tmp_path / "run" / "checkpoints").exists()


def test_sigterm_saves_and_exits_zero(tmp_path, data_dir):
  path = small_config(tmp_path, data_dir, checkpoint_every=1000)
  # paused after step 2 until the signal lands (maxlm/train/pause.py): it cannot finish first
  env = {**os.environ, "MAXLM_PAUSE_AFTER": f"2:{tmp_path / 'never'}"}
  proc = subprocess.Popen([sys.executable, "-m", "maxlm.cli", "train", str(path)], cwd=ROOT,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  run_dir = tmp_path / "run"
  while proc.poll() is None and len(metrics.read_jsonl(str(run_dir))) < 3:
    time.sleep(0.05)
  assert proc.poll() is None, proc.communicate()
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=HANG_S)
  assert proc.returncode == 0, err
  assert "SIGTERM" in out
  steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
  assert steps == [len(metrics.read_jsonl(str(run_dir)))] == [4]  # saved where it stopped


def test_corrupt_latest_checkpoint_falls_back(tmp_path, data_dir):
  path = small_config(tmp_path, data_dir)
  assert maxlm("train", path).returncode == 0
  ckpts = tmp_path / "run" / "checkpoints"
  latest = max(int(p.name) for p in ckpts.iterdir() if p.name.isdigit())
  for f in (ckpts / str(latest) / "state").rglob("*"):
    if f.is_file() and f.stat().st_size > 0:
      f.write_bytes(b"\x00garbage" * 3)
  rerun = maxlm("train", path)
  assert rerun.returncode == 0, rerun.stderr
  assert f"checkpoint {latest} is unreadable" in rerun.stdout
  assert "resumed from checkpoint" in rerun.stdout


@pytest.mark.slow
def test_loss_falls_well_below_uniform_on_the_demo_corpus(tmp_path, demo_data):
  manifest = json.loads((demo_data / "manifest.json").read_text())
  env = {**os.environ, "XLA_FLAGS": xlaflags.flags()}  # one CPU device, as a user
  proc = maxlm("train", "configs/demo.yaml", f"data.dir={demo_data}",
               f"run_dir={tmp_path / 'run'}", "train.eval_every=0", "model.size=tiny",
               "stages.2.steps=4", env=env)  # its first two stages, and a taste of the third
  assert proc.returncode == 0, proc.stderr
  losses = [r["loss"] for r in metrics.read_jsonl(str(tmp_path / "run"))]
  uniform = np.log(manifest["vocab_size"])
  assert np.mean(losses[:3]) > 0.9 * uniform
  assert np.mean(losses[-10:]) < 0.75 * uniform, (np.mean(losses[-10:]), uniform)

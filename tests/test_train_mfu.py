"""MFU is per device: the train loop divides by (per-device peak x device count), from one
peak table (maxlm/parallel/peaks.py)."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import yaml

from maxlm import config as config_lib
from maxlm.model import build
from maxlm.parallel import peaks

import datagen
import xlaflags

ROOT = pathlib.Path(__file__).resolve().parents[1]
L, ROWS_PER_DEVICE, PEAK = 32, 2, 1e9

# Runs the loop with every step taking exactly one second and a fixed per-device peak, so the
# MFU it logs is the formula's, not this machine's timing.
SCRIPT = """
import itertools, json, sys, types
from maxlm import config as config_lib
from maxlm.parallel import peaks
from maxlm.train import loop, metrics, planned
clock = itertools.count()
planned.time = types.SimpleNamespace(perf_counter=lambda: float(next(clock)))
peaks.per_device = lambda dtype, device=None: (PEAK, "test")
cfg = config_lib.load(sys.argv[1], sys.argv[2:])
loop.train(cfg, log=lambda *_: None)
print(json.dumps(metrics.read_jsonl(cfg.run_dir)))
"""


def _run(tmp, data_dir, devices):
  raw = {"seed": 0, "run_dir": str(tmp / f"run{devices}"),
         "data": {"dir": data_dir, "overlap": 0, "shuffle_rows": 8, "block_rows": 64},
         "stages": [{"seq_len": L, "batch": ROWS_PER_DEVICE * devices, "steps": 2}],
         "model": {"size": "tiny", "dtype": "float32", "remat": "none", "d_model": 32,
                   "n_heads": 2, "n_kv_heads": 1, "head_dim": 16, "d_ff": 64,
                   "loss_chunk": 32, "vocab_size": 1024},
         "train": {"checkpoint_every": 100, "eval_every": 0}}
  path = tmp / f"cfg{devices}.yaml"
  path.write_text(yaml.safe_dump(raw))
  env = {**os.environ, "XLA_FLAGS": xlaflags.flags(devices)}
  proc = subprocess.run([sys.executable, "-c", SCRIPT.replace("PEAK", repr(PEAK)), str(path)],
                        capture_output=True, text=True, cwd=ROOT, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.splitlines()[-1]), path


def test_mfu_is_the_same_for_the_same_work_per_device_on_1_and_4_devices(tmp_path):
  # documents of L - 1 tokens: [BOS] + body + [EOS] fills one row exactly, so every row
  # of every batch attends alike and FLOPs per token are the same on both runs
  data_dir = datagen.write_data_dir(tmp_path / "data", datagen.make_docs([L - 1] * 64))
  one, path = _run(tmp_path, data_dir, 1)
  four, _ = _run(tmp_path, data_dir, 4)
  cfg = config_lib.load(str(path))
  per_token = build.flops_per_token(cfg.model, L, (L + 1) / 2)
  for a, b in zip(one, four):
    assert a["tokens_per_s"] == ROWS_PER_DEVICE * L  # one second a step
    assert b["tokens_per_s"] == 4 * ROWS_PER_DEVICE * L
    assert a["mfu"] == pytest.approx(per_token * ROWS_PER_DEVICE * L / PEAK)
    assert b["mfu"] == pytest.approx(a["mfu"])  # not 4x: the peak counts every device
  assert len(one) == len(four) == 2


def test_peak_table():
  assert peaks.datasheet("NVIDIA H200", "bfloat16") == 989.4e12
  assert peaks.datasheet("NVIDIA H100 80GB HBM3", "float32") == 494.7e12  # TF32
  assert peaks.datasheet("NVIDIA H100 PCIe", "bfloat16") == 756e12
  assert peaks.datasheet("TPU v5 lite", "float32") == 197e12  # one bf16 pass by default
  assert peaks.datasheet("TPU v5", "bfloat16") == 459e12
  assert peaks.datasheet("cpu", "float32") is None
  assert peaks.mfu(100.0, 10, 2.0, 50.0, 5) == pytest.approx(2.0)


def test_cpu_peak_is_measured_per_device():
  peak, source = peaks.per_device("bfloat16")
  assert source == "measured" and np.isfinite(peak) and peak > 0

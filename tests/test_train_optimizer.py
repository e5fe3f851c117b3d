"""maxlm/train/optimizer.py: the learning-rate schedule, WSD's decay above all."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from maxlm import config as config_lib
from maxlm.train import optimizer


def lrs(total, **train):
  schedule = optimizer.lr_schedule(config_lib.TrainConfig(**train), total)
  return np.asarray(schedule(jnp.arange(total)), np.float64)


def test_wsd_decays_over_its_share_of_the_whole_run_not_of_the_steps_after_warmup():
  # 20 of 100 steps decay: steps 80..99. Over the 50 steps after warmup it would be 90..99.
  lr = lrs(100, lr=1.0, min_lr_ratio=0.1, warmup_steps=50, schedule="wsd", decay_fraction=0.2)
  assert lr[79] == pytest.approx(1.0)
  assert lr[80] < 1.0
  assert lr[99] == pytest.approx(0.1)


def test_wsd_decay_never_starts_before_warmup_reaches_peak():
  # 90% of 20 steps would start decaying at step 2; warmup reaches peak at step 15.
  lr = lrs(20, lr=1.0, min_lr_ratio=0.0, warmup_steps=15, schedule="wsd", decay_fraction=0.9)
  assert lr[15] == pytest.approx(1.0) and lr[14] < 1.0
  assert lr[16] < 1.0 and lr[19] == pytest.approx(0.0, abs=1e-7)


def test_wsd_with_no_decay_fraction_still_ends_at_the_floor():
  lr = lrs(10, lr=1.0, min_lr_ratio=0.5, warmup_steps=2, schedule="wsd", decay_fraction=0.0)
  assert lr[8] == pytest.approx(1.0) and lr[9] == pytest.approx(0.5)


@settings(max_examples=60)
@given(total=st.integers(2, 300), warmup=st.integers(0, 400),
       decay_fraction=st.floats(0, 1), min_lr_ratio=st.floats(0, 1),
       schedule=st.sampled_from(["wsd", "cosine"]))
def test_lr_never_rises_after_warmup_and_wsd_ends_at_the_floor(total, warmup, decay_fraction,
                                                               min_lr_ratio, schedule):
  lr = lrs(total, lr=1.0, min_lr_ratio=min_lr_ratio, warmup_steps=warmup, schedule=schedule,
           decay_fraction=decay_fraction)
  peak_at = min(warmup, total - 1)
  assert lr[peak_at] == pytest.approx(1.0)
  assert np.all(np.diff(lr[peak_at:]) <= 1e-6), lr
  assert np.all(lr[peak_at:] >= min_lr_ratio - 1e-6)
  if schedule == "wsd" and peak_at < total - 1:
    assert lr[-1] == pytest.approx(min_lr_ratio, abs=1e-6)

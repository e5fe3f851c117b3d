"""tools/parity_torch.py: maxlm's training steps against transformers' Llama trained by
torch's AdamW from the same weights on the same batches (the `hf` extra), and the pieces of the
reference it writes out itself (the schedule, the decay group) against maxlm's optimizer."""

import dataclasses
import importlib.util
import pathlib

import numpy as np
import pytest

from maxlm import config as config_lib
from maxlm.interop import layout
from maxlm.train import optimizer

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("parity_torch", ROOT / "tools" / "parity_torch.py")
parity_torch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(parity_torch)


@pytest.mark.parametrize("train, total", [
    ({"warmup_steps": 5}, 20),
    ({"warmup_steps": 0, "min_lr_ratio": 0.0}, 7),
    ({"warmup_steps": 50}, 12),  # warmup longer than the run: cut to total - 1
    ({"warmup_steps": 3, "schedule": "wsd", "decay_fraction": 0.25}, 23),
    ({"warmup_steps": 2, "schedule": "wsd", "decay_fraction": 0.0}, 9),
    ({"warmup_steps": 50, "schedule": "wsd", "decay_fraction": 0.2}, 100),
    ({"warmup_steps": 15, "schedule": "wsd", "decay_fraction": 0.9}, 20),  # cut at warmup's end
    ({"warmup_steps": 50, "schedule": "wsd"}, 12),
])
def test_reference_schedule_equals_maxlms(train, total):
  cfg = config_lib.TrainConfig(**{**train, "lr": 2e-3})
  schedule = optimizer.lr_schedule(cfg, total)
  ours = np.array([float(schedule(k)) for k in range(total)])
  theirs = np.array([parity_torch.reference_lr(cfg, total, k) for k in range(total)])
  assert np.allclose(ours, theirs, rtol=1e-5, atol=0), (ours, theirs)  # optax: float32
  assert theirs.max() == pytest.approx(2e-3)


@pytest.mark.parametrize("decay_embeddings", [False, True])
def test_maxlms_decay_mask_is_every_matrix_but_embedding_and_head(decay_embeddings):
  import jax
  from maxlm.model import build
  config = parity_torch.make_config("unused", "unused", 1)
  model_cfg = dataclasses.replace(config.model, vocab_size=64)
  model = build.model_for(dataclasses.replace(config, model=model_cfg), 0, vocab_size=64)
  params = jax.eval_shape(lambda: build.init_params_abstract(model))
  train = dataclasses.replace(config.train, decay_embeddings=decay_embeddings)
  skip = () if decay_embeddings else ("model.embed_tokens.weight", "lm_head.weight")
  matrices = {n for n, shape in layout.hf_shapes(model_cfg).items()
              if len(shape) == 2 and n not in skip}
  assert parity_torch.maxlm_decayed(params, model_cfg, train) == matrices


def test_training_steps_equal_transformers_adamw(demo_data, tmp_path):
  pytest.importorskip("torch", reason="torch not installed (pip install -e '.[hf]')")
  pytest.importorskip("transformers", reason="transformers not installed (pip install -e "
                                             "'.[hf]')")
  result = parity_torch.run(3, str(tmp_path), str(demo_data), log=lambda *_: None)
  assert result["steps"] == 3 and result["decay_masks_equal"]
  assert result["decayed_tensors"] == 14  # q, k, v, o, gate, up, down of 2 layers
  assert result["max_rel_loss_diff"] < 1e-4, result
  assert result["max_rel_grad_norm_diff"] < 1e-4, result
  assert result["max_rel_lr_diff"] < 1e-5, result
  assert result["max_rel_param_diff"] < 1e-4, result
  # the comparison sees a wrong decay group (embedding and head decayed too): 3 warmup steps of
  # lr * weight_decay shrink them by ~3e-4 where maxlm's did not
  import dataclasses
  config = parity_torch.make_config(demo_data, tmp_path / "run", 3)
  wrong = dataclasses.replace(config.train, decay_embeddings=True)
  rows, final, decayed = parity_torch.run_torch(tmp_path / "step0", wrong, 3,
                                                parity_torch.batches(config, 3))
  assert {"model.embed_tokens.weight", "lm_head.weight"} < decayed
  off = parity_torch.compare(rows, rows, config.train.clip, str(tmp_path / "run"), final)
  assert off["max_rel_param_diff"] > 1e-4 and off["worst_param"] in (
      "model.embed_tokens.weight", "lm_head.weight")

"""The small training run and model the train and eval tests share: ROOT (the repository),
small_config (a two-stage run of a tiny model on a data dir, as a config file), maxlm (the CLI
in a subprocess from ROOT) and tiny_model (a built and initialized tiny model on one device).
The data dir those runs train on is the `data_dir` fixture of tests/conftest.py."""

import pathlib
import subprocess
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]


def small_config(tmp, data_dir, **train):
  raw = {
      "seed": 0, "run_dir": str(tmp / "run"),
      "data": {"dir": data_dir, "mix": {"prose": 0.5, "code": 0.5}, "overlap": 4,
               "shuffle_rows": 8, "block_rows": 64, "fim": {"rate": 0.2, "sources": ["code"]}},
      "stages": [{"seq_len": 32, "batch": 8, "steps": 6}, {"seq_len": 64, "batch": 8, "steps": 5}],
      "model": {"size": "tiny", "dtype": "float32", "remat": "none", "d_model": 32,
                "n_heads": 2, "n_kv_heads": 1, "head_dim": 16, "d_ff": 64, "loss_chunk": 32},
      "train": {"lr": 0.01, "warmup_steps": 2, "checkpoint_every": 3, "eval_every": 4,
                "eval_tokens": 256, **train}}
  path = tmp / "cfg.yaml"
  path.write_text(yaml.safe_dump(raw))
  return path


def maxlm(*args, **kw):
  return subprocess.run([sys.executable, "-m", "maxlm.cli", *map(str, args)],
                        capture_output=True, text=True, cwd=ROOT, **kw)


def tiny_model(seq_len=32, seed=3):
  """(cfg, mesh, model, params) of a tiny float32 model on one device, initialized from
  `seed` for rows of `seq_len`."""
  import jax  # pylint: disable=import-outside-toplevel

  from maxlm import config as config_lib  # pylint: disable=import-outside-toplevel
  from maxlm.config import MeshConfig  # pylint: disable=import-outside-toplevel
  from maxlm.model import build  # pylint: disable=import-outside-toplevel
  from maxlm.parallel import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  cfg = config_lib.from_dict({
      "model": {"size": "tiny", "vocab_size": 64, "dtype": "float32", "d_model": 32,
                "n_heads": 2, "n_kv_heads": 1, "head_dim": 16, "d_ff": 64},
      "stages": [{"seq_len": seq_len, "batch": 1, "steps": 1, "attention": "reference"}]})
  mesh = mesh_lib.make_mesh(MeshConfig(1, 1, 1, 1), jax.devices()[:1])
  model = build.model_for(cfg, 0, mesh)
  return cfg, mesh, model, build.init_params(model, jax.random.key(seed), mesh, cfg.rules,
                                             seq_len)

import subprocess
import sys

import pytest

from maxlm import config

BASE = {"seed": 1, "data": {"dir": "d"}, "stages": [{"seq_len": 64, "batch": 2, "steps": 3}]}


def load(tmp_path, raw, overrides=()):
  import yaml
  path = tmp_path / "c.yaml"
  path.write_text(yaml.safe_dump(raw))
  return config.load(str(path), overrides)


def test_yaml_and_dotted_overrides(tmp_path):
  cfg = load(tmp_path, BASE, ["seed=7", "data.dir=/x", "stages.0.seq_len=128",
                              "data.mix.code=0.5", "data.fim.sources=[code]"])
  assert cfg.seed == 7 and cfg.data.dir == "/x" and cfg.stages[0].seq_len == 128
  assert cfg.data.mix == {"code": 0.5} and cfg.data.fim.sources == ("code",)
  assert config.from_dict(config.to_dict(cfg)) == cfg


@pytest.mark.parametrize("overrides, message", [
    (["data.overlp=3"], "unknown key 'data.overlp'; did you mean 'data.overlap'"),
    (["sed=3"], "unknown key 'sed'; did you mean 'seed'"),
    (["seed=abc"], "seed: expected int, got 'abc'"),
    (["data.overlap=-1"], "data.overlap: expected an integer >= 0, got -1"),
    (["data.fim.rate=2"], r"data.fim.rate: expected a number in \[0.0, 1.0\], got 2.0"),
    (["stages.0.steps=0"], "stages.0: set exactly one of steps or tokens"),
    (["stages.3.batch=1"], "stages.3: expected an index 0..0"),
    (["data.mix.code=0"], "data.mix.code: expected a quota > 0"),
    (["seed"], "expected key=value"),
    (["data.block_rows=100", "data.shuffle_rows=64"], "must be a multiple of"),
])
def test_bad_values_name_the_key(tmp_path, overrides, message):
  with pytest.raises(config.ConfigError, match=message):
    load(tmp_path, BASE, overrides)


def test_tokens_budget_rounds_up_to_steps(tmp_path):
  cfg = load(tmp_path, BASE, ["stages.0.steps=0", "stages.0.tokens=1000"])
  assert cfg.stages[0].num_steps == 8  # ceil(1000 / (64 * 2))


def test_cli_config_error_is_one_line_exit_2(tmp_path):
  import yaml
  path = tmp_path / "c.yaml"
  path.write_text(yaml.safe_dump(BASE))
  proc = subprocess.run([sys.executable, "-m", "maxlm.cli", "ledger", str(path), "data.ovrlap=1"],
                        capture_output=True, text=True)
  assert proc.returncode == 2
  assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
  assert "data.ovrlap" in proc.stderr and "data.overlap" in proc.stderr


def test_shipped_configs_load():
  cfg = config.load("configs/demo.yaml")
  assert len(cfg.stages) >= 3 and len(cfg.data.mix) >= 2
  assert [s.seq_len for s in cfg.stages] == sorted(s.seq_len for s in cfg.stages)


def test_production_schedule_loads_and_fits_1024_chips():
  from maxlm.parallel import mesh as mesh_lib
  cfg = config.load("configs/schedule_4k_1m.yaml")
  assert [s.seq_len for s in cfg.stages] == [4096, 16384, 65536, 1048576]
  assert cfg.model.n_layers == 32 and cfg.model.d_model == 4096
  for stage in cfg.stages:
    shape = dict(zip(config.MESH_AXES, mesh_lib.mesh_shape(stage.mesh, 1024)))
    assert stage.batch % (shape["data"] * shape["fsdp"]) == 0
    assert stage.seq_len % (2 * shape["context"]) == 0
  assert cfg.stages[-1].mesh.context == -1 and cfg.stages[-1].rope.scaling == "yarn"

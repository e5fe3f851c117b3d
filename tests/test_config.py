import dataclasses
import re
import subprocess
import sys
import textwrap
import typing

import pytest
import yaml

from maxlm import MaxlmError, config

import datagen

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
    (["data.fim.rate=2"], r"data.fim.rate: expected a number in \[0, 1\], got 2.0"),
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
  v4 = config.load("configs/v4_tiny.yaml")
  assert v4.model.mqa.enabled and v4.model.mhc.streams == 4 and v4.train.optimizer == "muon"
  assert sorted(set(v4.model.mqa.compress)) == [v4.model.mqa.csa_rate, v4.model.mqa.hca_rate]


def test_production_schedule_loads_and_fits_1024_chips():
  from maxlm.parallel import mesh as mesh_lib
  cfg = config.load("configs/schedule_4k_1m.yaml")
  assert [s.seq_len for s in cfg.stages] == [4096, 16384, 65536, 65536, 1048576]
  assert [s.sparse.mode for s in cfg.stages] == ["dense", "dense", "indexer_warmup", "sparse",
                                                 "sparse"]
  assert cfg.model.n_layers == 32 and cfg.model.d_model == 4096
  for stage in cfg.stages:
    shape = dict(zip(config.MESH_AXES, mesh_lib.mesh_shape(stage.mesh, 1024)))
    assert stage.batch % (shape["data"] * shape["fsdp"]) == 0
    assert stage.seq_len % (2 * shape["context"]) == 0
    assert (stage.seq_len // (2 * shape["context"])) % stage.sparse.block == 0
  assert cfg.stages[-1].mesh.context == -1 and cfg.stages[-1].rope.scaling == "yarn"


def load_text(tmp_path, text, overrides=()):
  path = tmp_path / "c.yaml"
  path.write_text(textwrap.dedent(text))
  return config.load(str(path), overrides)


@pytest.mark.parametrize("override, key, value", [
    ("train.lr=1e-3", "lr", 1e-3), ("train.eps=1e-300", "eps", 1e-300),
    ("train.clip=1E5", "clip", 1e5), ("train.b1=.5", "b1", 0.5),
    ("train.weight_decay=+1.5e-2", "weight_decay", 0.015), ("train.lr=1.e-4", "lr", 1e-4),
    ("train.min_lr_ratio=-.0", "min_lr_ratio", 0.0), ("train.lr=1", "lr", 1.0),
])
def test_yaml_1_2_floats_in_overrides(tmp_path, override, key, value):
  cfg = load(tmp_path, BASE, [override])
  assert getattr(cfg.train, key) == value and type(getattr(cfg.train, key)) is float


def test_yaml_1_2_floats_in_files_and_numeric_looking_strings(tmp_path):
  cfg = load_text(tmp_path, """
      data: {dir: d, mix: {prose: 6e-1, code: .4}}
      model: {z_loss: 1e-4, norm_eps: 1E-6}
      train: {lr: 3e-4, eps: 1e-8}
      stages:
        - {name: 1e3, seq_len: 64, batch: 2, tokens: 1e3}
        - {name: 1.50, seq_len: 64, batch: 2, steps: 2}
      """)
  assert cfg.data.mix == {"prose": 0.6, "code": 0.4} and cfg.train.lr == 3e-4
  assert cfg.model.z_loss == 1e-4 and cfg.model.norm_eps == 1e-6 and cfg.train.eps == 1e-8
  assert [s.name for s in cfg.stages] == ["1e3", "1.50"]  # as written, not 1000.0 / 1.5
  assert cfg.stages[0].tokens == 1000 and type(cfg.stages[0].tokens) is int
  cfg = load(tmp_path, BASE, ["stages.0.name=2e3", "data.mix={1e3: 1}"])
  assert cfg.stages[0].name == "2e3" and cfg.data.mix == {"1e3": 1.0}
  assert config.from_dict(config.to_dict(cfg)) == cfg
  assert yaml.safe_load(yaml.safe_dump(config.to_dict(cfg)))  # plain types only


def test_duplicate_keys_name_the_key_and_both_lines(tmp_path):
  top = """\
      seed: 1
      data: {dir: d}
      stages: [{seq_len: 64, batch: 2, steps: 3}]
      seed: 2
      """
  with pytest.raises(config.ConfigError, match=r"c.yaml: duplicate key 'seed' at lines 1 and 4"):
    load_text(tmp_path, top)
  nested = """\
      data:
        dir: d
        mix:
          prose: 1
          code: 1
          prose: 2
      stages:
        - {seq_len: 64, batch: 2, steps: 3}
        - {seq_len: 64, batch: 2, steps: 3, batch: 4}
      """
  with pytest.raises(config.ConfigError, match=r"duplicate key 'data.mix.prose' at lines 4 and 6"):
    load_text(tmp_path, nested)
  with pytest.raises(config.ConfigError, match=r"duplicate key 'stages.1.batch' at lines 9 and 9"):
    load_text(tmp_path, nested.replace("prose: 2", "other: 2"))
  with pytest.raises(config.ConfigError, match=r"=\{a: 1, a: 2\}'?: duplicate key 'data.mix.a'"):
    load(tmp_path, BASE, ["data.mix={a: 1, a: 2}"])


@pytest.mark.parametrize("overrides, message", [
    (["train.clip=-1"], r"train.clip: expected a number > 0, got -1.0"),
    (["train.clip=0"], r"train.clip: expected a number > 0, got 0.0"),
    (["train.eps=0"], r"train.eps: expected a number > 0"),
    (["train.weight_decay=-0.1"], r"train.weight_decay: expected a number >= 0, got -0.1"),
    (["train.b1=1"], r"train.b1: expected a number in \[0, 1\), got 1.0"),
    (["train.b2=1"], r"train.b2: expected a number in \[0, 1\), got 1.0"),
    (["model.init_std=0"], r"model.init_std: expected a number > 0"),
    (["model.z_loss=-1e-4"], r"model.z_loss: expected a number >= 0, got -0.0001"),
    (["model.norm_eps=-1"], r"model.norm_eps: expected a number > 0, got -1.0"),
    (["seed=-1"], r"seed: expected an integer in \[0, 4294967295\], got -1"),
    (["seed=4294967296"], r"seed: expected an integer in \[0, 4294967295\], got 4294967296"),
    (["train.lr=.inf"], r"train.lr: expected a finite number, got inf"),
    (["train.lr=-.inf"], r"train.lr: expected a finite number, got -inf"),
    (["train.lr=.nan"], r"train.lr: expected a finite number, got nan"),
    (["train.lr=1e400"], r"train.lr: expected a finite number, got inf"),
    ([f"train.lr=1{'0' * 400}"], r"train.lr: expected a finite number, got inf"),
    (["train.lr=-1e-3"], r"train.lr: expected a number > 0, got -0.001"),
    (["data.mix={prose: .inf}"], r"data.mix.prose: expected a finite number, got inf"),
    (["stages.0.mix={prose: .nan}"], r"stages.0.mix.prose: expected a finite number, got nan"),
    (["data.mix={prose:0.5}"], r"data.mix: 'prose:0.5' reads as one key without a value; YAML "
     r"needs a space after the colon: \{prose: 0.5\}"),
    (["stages.0.rope.theta=.inf"], r"stages.0.rope.theta: expected a finite number, got inf"),
    (["stages.0.rope.theta=0"], r"stages.0.rope.theta: expected a number > 0, got 0.0"),
    (["stages.0.rope.factor=.inf"], r"stages.0.rope.factor: expected a finite number"),
    (["stages.0.rope.factor=0.5"], r"stages.0.rope.factor: expected a number >= 1, got 0.5"),
    (["stages.0.rope.original_length=0"], r"rope.original_length: expected an integer >= 1,"),
    (["stages.0.steps=-5", "stages.0.tokens=100"], r"stages.0.steps: expected an integer >= 0"),
    (["stages.0.tokens=-5"], r"stages.0.tokens: expected an integer >= 0"),
    (["stages.0.steps=.inf"], r"stages.0.steps: expected int, got inf"),
])
def test_ranges_name_the_key_and_what_is_allowed(tmp_path, overrides, message):
  with pytest.raises(config.ConfigError, match=message):
    load(tmp_path, BASE, overrides)


def float_keys(cls, prefix=""):
  """Dotted keys of every float field, descending into dataclasses (stages: stage 0)."""
  hints = typing.get_type_hints(cls)
  for f in dataclasses.fields(cls):
    hint, key = hints[f.name], f"{prefix}{f.name}"
    if hint is float:
      yield key
    elif dataclasses.is_dataclass(hint):
      yield from float_keys(hint, key + ".")
    elif typing.get_origin(hint) is tuple and dataclasses.is_dataclass(typing.get_args(hint)[0]):
      yield from float_keys(typing.get_args(hint)[0], key + ".0.")


FLOAT_KEYS = list(float_keys(config.Config))


@pytest.mark.parametrize("key", FLOAT_KEYS)
@pytest.mark.parametrize("bad", [".inf", "-.inf", ".nan"])
def test_no_float_field_takes_inf_or_nan(tmp_path, key, bad):
  with pytest.raises(config.ConfigError, match=f"{re.escape(key)}: expected a finite number"):
    load(tmp_path, BASE, [f"{key}={bad}"])


def test_every_numeric_field_documents_its_range():
  import inspect
  assert len(FLOAT_KEYS) > 15
  numeric = re.compile(r"^  (\w+): (int|float|dict\[str, float\])( \| None)? = ")
  lines = [line for line in inspect.getsource(config).splitlines() if numeric.match(line)]
  assert len(lines) > 40
  for line in lines:
    comment = line.partition("  # ")[2]
    assert re.search(r"[<>]=? ?-?\d|\[|\.\.", comment), f"no documented range: {line.strip()}"


@pytest.fixture
def two_source_dir(tmp_path):
  docs = datagen.make_docs([40] * 6, ["prose", "code"] * 3)
  return datagen.write_data_dir(tmp_path / "data", docs)


def test_unknown_fim_source_names_the_known_sources(tmp_path, two_source_dir):
  from maxlm.data import loader
  raw = {**BASE, "data": {"dir": two_source_dir}}
  loader.Data(load(tmp_path, raw, ["data.fim.sources=[code]"]))  # known: fine
  with pytest.raises(config.ConfigError,
                     match=r"data.fim.sources: unknown source 'nosuch'; the data has: prose, code"):
    loader.Data(load(tmp_path, raw, ["data.fim.sources=[code, nosuch]"]))
  for key in ("data.mix", "stages.0.mix"):  # mix names: checked by the planner
    with pytest.raises(MaxlmError, match=r"unknown source 'nosuch'; the data has: prose, code"):
      loader.Data(load(tmp_path, raw, [f"{key}={{nosuch: 1}}"]))


def test_binary_or_bom_files_and_yaml_1_1_integers(tmp_path):
  from maxlm import config as config_lib, typed_yaml
  bom = tmp_path / "bom.yaml"
  bom.write_bytes(b"\xef\xbb\xbfseed: 3\nstages: [{seq_len: 32, batch: 8, steps: 1}]\n")
  assert config_lib.load(str(bom)).seed == 3
  binary = tmp_path / "bin.yaml"
  binary.write_bytes(b"\x7fELF\x02\x01\x01\x00\xff\xfe")
  with pytest.raises(typed_yaml.ConfigError, match="not a UTF-8 text file"):
    config_lib.load(str(binary))
  for text, value in (("010", "010"), ("1:30", "1:30"), ("0b101", "0b101"), ("0x10", 16),
                      ("12", 12), ("-3", -3)):
    assert typed_yaml.parse(f"a: {text}")[0]["a"] == value, text
  with pytest.raises(typed_yaml.ConfigError, match=r"stages.0.seq_len: expected an integer in "
                                                   r"\[8, 16777216\]"):
    config_lib.load(str(bom), ["stages.0.seq_len=99999999999999999999999"])


@pytest.mark.parametrize("overrides, message", [
    (["model.attention.window=64", "stages.0.sparse.mode=indexer_warmup"],
     "stages.0.sparse.mode=indexer_warmup with model.attention.window"),
    (["model.moe.experts=4", "model.moe.balance=bias", "train.objective=grpo",
      "init.from=runs/x"], "model.moe.balance=bias with a dpo/grpo stage"),
    (["model.moe.experts=4", "model.moe.balance=bias", "stages.0.objective=dpo",
      "init.from=runs/x"], "model.moe.balance=bias with a dpo/grpo stage"),
    (["model.moe.experts=4", "model.moe.every=3", "stages.0.objective=grpo"],
     "model.moe.every: 3 leaves no MoE layer"),
    (["model.attention.window=16", "model.attention.global_every=1"],
     "model.attention.global_every: 1 makes every layer global"),
    (["model.moe.experts=6", "stages.0.mesh.expert=4"],
     "stages.0.mesh.expert=4: model.moe.experts=6 do not split over it"),
    (["model.moe.experts=4", "model.moe.hash_layers=3"],
     "model.moe.hash_layers: 3 is more than the 2 MoE layers"),
    (["model.mhc.streams=17"], "model.mhc.streams: expected an integer in [0, 16]"),
    (["train.optimizer=sgd"], "train.optimizer: expected adamw or muon"),
    (["model.mqa.q_lora=32", "model.mqa.out_groups=2", "stages.0.sparse.mode=indexer_warmup"],
     "only CSA layers have an indexer, and model.mqa.compress names none"),
    (["model.mqa.q_lora=32", "model.mqa.out_groups=2", "model.mqa.compress=[4, 3]"],
     "model.mqa.compress: 3 is none of 0, csa_rate=4, hca_rate=128"),
    (["model.mqa.q_lora=32", "model.mqa.out_groups=3"],
     "model.mqa.out_groups: must divide model.n_heads"),
])
def test_model_families_refuse_what_they_cannot_do_in_one_line(overrides, message):
  with pytest.raises(config.ConfigError) as e:
    config.load("configs/demo.yaml", overrides)
  assert message in str(e.value) and "\n" not in str(e.value)
  config.load("configs/demo.yaml", [o for o in overrides  # without the culprit: fine
                                    if not any(k in o for k in ("objective", "sparse", "every", "mesh",
                                                                "hash_layers", "streams",
                                                                "optimizer", "mqa"))])


def test_a_retired_key_still_loads_with_a_warning_and_is_dropped(tmp_path):
  """Configs (and checkpoints' saved configs) written before train.eval_rows retired."""
  path = tmp_path / "old.yaml"
  path.write_text("stages: [{seq_len: 32, batch: 2, steps: 1}]\ntrain: {eval_rows: 4}\n")
  with pytest.warns(FutureWarning, match="train.eval_rows is retired and ignored"):
    cfg = config.load(str(path))
  assert "eval_rows" not in config.to_dict(cfg)["train"]
  raw = {"stages": [{"seq_len": 32, "batch": 2, "steps": 1}], "train": {"eval_rows": 4}}
  assert config.to_dict(config.from_dict(raw)) == config.to_dict(cfg)


def test_a_rules_override_changes_that_rule_alone(tmp_path):
  """docs/config.md: "Set one with e.g. rules.mlp=[tensor]"; it replaced the whole table, so
  every other logical axis was replicated."""
  path = tmp_path / "c.yaml"
  path.write_text("stages: [{seq_len: 32, batch: 2, steps: 1}]\nrules: {embed: [fsdp, context]}\n")
  for cfg in (config.load(str(path)), config.load(str(path), ["rules.mlp=[tensor]"])):
    assert cfg.rules["embed"] == ("fsdp", "context")
    assert {k: v for k, v in cfg.rules.items() if k not in ("embed", "mlp")} == {
        k: v for k, v in config.DEFAULT_RULES.items() if k not in ("embed", "mlp")}
  assert config.load(str(path), ["rules.mlp=[tensor]"]).rules["mlp"] == ("tensor",)

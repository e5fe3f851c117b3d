"""maxlm export and init.from for the model families (maxlm/interop/families.py, planned.py):
mixture-of-experts and local/global models as Ministral, Qwen2-MoE and GLM-4-MoE folders, the
layer plan's groups mapped to per-layer tensors and back bit for bit, the settings no class
holds refused in one line, and logits against transformers itself on packed rows."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from interop_helpers import checkpoint_state, flat, load_back
from safetensors.numpy import load_file, save_file

from maxlm import MaxlmError, config as config_lib
from maxlm.interop import families, hf_config, layout, load, parity, tensor_map

MODEL = {"d_model": 32, "n_layers": 6, "n_heads": 4, "n_kv_heads": 2, "head_dim": 8, "d_ff": 48}
MOE = {"experts": 4, "top_k": 2, "shared_experts": 1, "d_ff": 16, "first_dense": 1}
CASES = {  # name: (model keys, the class's model_type)
    "window": ({"attention": {"window": 6, "global_every": 3}}, "ministral"),
    "window_all_local": ({"attention": {"window": 5}}, "ministral"),
    "moe_softmax_tied_no_shared": ({"moe": {**MOE, "shared_experts": 0, "score": "softmax",
                                            "balance": "aux_loss"},
                                    "tied_embeddings": True}, "qwen2_moe"),
    # the moe_demo shape: 8 experts, top-2, one shared, MoE every 2nd layer, local/global
    "moe_window": ({"moe": {"experts": 8, "top_k": 2, "shared_experts": 1, "d_ff": 16,
                            "every": 2, "score": "softmax", "balance": "none"},
                    "attention": {"window": 6, "global_every": 3}}, "qwen2_moe"),
    "moe_sigmoid_bias": ({"moe": {**MOE, "shared_experts": 2, "score": "sigmoid",
                                  "balance": "bias", "norm_topk": False}}, "glm4_moe"),
}
STAGE = {"seq_len": 64, "batch": 1, "steps": 1, "attention": "blockwise", "block_q": 16,
         "block_k": 16}


def _needs_transformers():
  pytest.importorskip("torch", reason="torch not installed (pip install -e '.[hf]')")
  pytest.importorskip("transformers", reason="transformers not installed (pip install -e "
                                             "'.[hf]')")


def _config(keys, **model):
  return parity.config_for({**MODEL, **keys, **model}, [STAGE])


def _random(name, **model):
  config = _config(CASES[name][0], **model)
  m, params = parity.random_params(config)
  bias = parity.random_bias(m) if config.model.moe.balance == "bias" else None
  return config, m, params, bias




def test_families_pick_the_class_and_refuse_in_one_line():
  for name, (keys, kind) in CASES.items():
    assert families.family(_config(keys).model) == kind, name
  assert families.family(_config({}).model) == "llama"
  for keys, key in (({"moe": {**MOE, "score": "sigmoid"}, "attention": {"window": 4}},
                     "model.attention.window"),
                    ({"moe": {**MOE, "score": "sigmoid", "every": 2}}, "model.moe.every")):
    with pytest.raises(hf_config.CannotExpress) as e:
      families.family(_config(keys).model)
    assert key in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("scan", [True, False])
def test_layout_makes_every_hf_tensor_once_and_inverts(name, scan):
  config, _, _, _ = _random(name, scan_layers=scan)
  cfg = config.model
  biased = cfg.moe.balance == "bias"
  made, rng = {}, np.random.default_rng(0)
  for leaf in layout.leaves(cfg):
    array = None if leaf.path is None else rng.standard_normal(leaf.shape).astype(np.float32)
    for row, i in enumerate(leaf.layer_ids()) if leaf.per_layer else [(None, None)]:
      part = array if row is None else array[row]
      tensors = leaf.to_hf(part)
      assert tuple(tensors) == leaf.names
      full = {tensor_map.hf_layer_name(i, n) if i is not None else n: t for n, t in tensors.items()}
      assert not set(full) & set(made)
      made.update(full)
      if leaf.path is not None:
        assert np.array_equal(leaf.from_hf(tensors.__getitem__), part)
  assert {n: t.shape for n, t in made.items()} == layout.hf_shapes(cfg, biased)
  assert all(t.flags.c_contiguous for t in made.values())
  moe_layers = families.moe_layers(cfg)
  assert any(f"model.layers.{moe_layers[-1]}.mlp.experts.{cfg.moe.experts - 1}.down_proj.weight"
             == n for n in made) if moe_layers else True


@pytest.mark.parametrize("name", list(CASES))
def test_export_then_import_is_bitwise(name, tmp_path):
  config, m, params, bias = _random(name)
  parity.random_folder(tmp_path, config, params, bias)
  hf = json.loads((tmp_path / "config.json").read_text())
  assert hf["model_type"] == CASES[name][1]
  assert hf["architectures"] == [families.CLASSES[CASES[name][1]]]
  loaded = load_back(config, tmp_path, params, bias)
  want, got = flat(params), flat(loaded[0])
  assert want.keys() == got.keys()
  for key in want:
    assert got[key].dtype == want[key].dtype and np.array_equal(got[key], want[key]), key
  if bias is not None:
    for key, value in flat(bias).items():
      assert np.array_equal(flat(loaded[1])[key], value), key




def test_moe_export_refusals_and_import_checks(tmp_path):
  # a softmax model with a nonzero selection bias: Qwen2-MoE would route otherwise
  config, m, params, _ = _random("moe_softmax_tied_no_shared",
                                 moe={**MOE, "score": "softmax", "balance": "bias"})
  with pytest.raises(hf_config.CannotExpress) as e:
    parity.random_folder(tmp_path / "biased", config, params, parity.random_bias(m))
  assert "model.moe.balance" in str(e.value) and "\n" not in str(e.value)
  # a zero bias changes nothing, so it exports
  zero = jax.tree_util.tree_map(np.zeros_like, parity.random_bias(m))
  (tmp_path / "zero").mkdir()
  parity.random_folder(tmp_path / "zero", config, params, zero)
  # a gated shared expert (a real Qwen2-MoE) is not maxlm's
  config, m, params, bias = _random("moe_window")
  folder = tmp_path / "qwen"
  folder.mkdir()
  parity.random_folder(folder, config, params, bias)
  load_back(config, folder, params, bias)
  weights = load_file(str(folder / "model.safetensors"))
  weights["model.layers.1.mlp.shared_expert_gate.weight"][0, 3] = 0.5
  save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(MaxlmError, match="shared_expert_gate.weight is not 0") as e:
    load_back(config, folder, params, bias)
  assert "\n" not in str(e.value)
  # another layer plan than the folder's is named by its key
  for model, key in (({"attention": {"window": 6, "global_every": 2}},
                      "model.attention.global_every"),
                     ({"attention": {"window": 7, "global_every": 3}}, "model.attention.window"),
                     ({"moe": {**CASES["moe_window"][0]["moe"], "top_k": 3}}, "model.moe.top_k"),
                     ({"moe": {**CASES["moe_window"][0]["moe"], "every": 3}},
                      "model.moe.first_dense / every")):
    other = _config({**CASES["moe_window"][0], **model})
    with pytest.raises(MaxlmError) as e:
      load_back(other, folder, params, bias)
    assert key in str(e.value) and "\n" not in str(e.value), str(e.value)
  # a sigmoid model reads GLM-4-MoE folders, not Qwen2-MoE ones
  other = _config({"moe": {**MOE, "score": "sigmoid"}})
  with pytest.raises(MaxlmError, match="reads Glm4MoeForCausalLM folders"):
    load_back(other, folder, params, bias)


@pytest.mark.parametrize("name", list(CASES))
def test_logits_equal_transformers(name, tmp_path):
  _needs_transformers()
  config, m, params, bias = _random(name)
  parity.random_folder(tmp_path, config, params, bias)
  rng = np.random.default_rng(1)
  one = [rng.integers(0, 256, 64).tolist()]
  packed = [rng.integers(0, 256, 23).tolist(), rng.integers(0, 256, 41).tolist()]
  assert parity.max_difference(m, params, tmp_path, one, 64, bias) < 1e-4
  assert parity.max_difference(m, params, tmp_path, packed, 64, bias) < 1e-4


def test_parity_sees_a_wrong_window_and_a_dropped_bias(tmp_path):
  """The checks above can fail: the same weights with another window, or without the bias,
  give other logits."""
  _needs_transformers()
  rng = np.random.default_rng(2)
  docs = [rng.integers(0, 256, 64).tolist()]
  config, m, params, bias = _random("moe_window")
  (tmp_path / "w").mkdir()
  parity.random_folder(tmp_path / "w", config, params, bias)
  hf = json.loads((tmp_path / "w" / "config.json").read_text())
  (tmp_path / "w" / "config.json").write_text(json.dumps({**hf, "sliding_window": 8}))
  assert parity.max_difference(m, params, tmp_path / "w", docs, 64) > 1e-3
  config, m, params, bias = _random("moe_sigmoid_bias")
  (tmp_path / "b").mkdir()
  parity.random_folder(tmp_path / "b", config, params, bias)
  assert parity.max_difference(m, params, tmp_path / "b", docs, 64, None) > 1e-3


def _write_config(path, data_dir, run_dir, model):
  import yaml
  raw = {"seed": 0, "run_dir": str(run_dir),
         "data": {"dir": str(data_dir), "mix": {"prose": 0.6, "code": 0.4}, "overlap": 4,
                  "shuffle_rows": 8, "block_rows": 64},
         "stages": [{"seq_len": 32, "batch": 8, "steps": 3, "attention": "blockwise",
                     "block_q": 16, "block_k": 16}],
         "model": {"size": "tiny", "dtype": "float32", "remat": "none", **MODEL,
                   "n_layers": 4, "loss_chunk": 32, **model},
         "train": {"lr": 0.01, "warmup_steps": 1, "checkpoint_every": 3, "eval_every": 0}}
  path.write_text(yaml.safe_dump(raw))
  return config_lib.load(str(path))


TRAINED = {  # name: model keys of a run trained 3 steps
    # GLM-4-MoE: sigmoid, the balancing bias moves; a dense layer then a scanned MoE group
    "sigmoid_bias": {"moe": {**MOE, "score": "sigmoid", "balance": "bias", "bias_rate": 0.01}},
    # Qwen2-MoE with local/global layers in groups; a bias that never moves exports
    "softmax_window": {"moe": {**MOE, "first_dense": 0, "every": 2, "score": "softmax",
                               "balance": "bias",
                               "bias_rate": 0.0},
                       "attention": {"window": 8, "global_every": 2}},
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, demo_data):
  from maxlm.train import loop
  out = {}
  for name, model in TRAINED.items():
    tmp = tmp_path_factory.mktemp(name)
    cfg = _write_config(tmp / "cfg.yaml", demo_data, tmp / "run", model)
    loop.train(cfg, log=lambda _: 0)
    out[name] = (tmp, cfg)
  return out




@pytest.mark.parametrize("name", list(TRAINED))
def test_trained_run_exports_and_imports_bit_for_bit(trained, name, tmp_path):
  from maxlm.interop import export
  tmp, cfg = trained[name]
  out = tmp_path / "hf"
  export.export(cfg.run_dir, str(out), log=lambda _: 0)
  state = checkpoint_state(cfg.run_dir, 3)
  vocab = json.loads((out / "config.json").read_text())["vocab_size"]
  model_cfg = dataclasses.replace(cfg.model, vocab_size=vocab)
  raw = {**config_lib.to_dict(cfg), "init": {"from": str(out)}}
  source = load.open_source(config_lib.from_dict(raw), vocab, None, log=lambda _: 0)
  got = flat(load.params(source, model_cfg, state["params"]))
  want = flat(state["params"])
  assert got.keys() == want.keys() and any("group_" in k for k in want)
  for key in want:
    assert np.array_equal(got[key], want[key]), key
  bias = load.moe_bias(source, model_cfg, state["moe_bias"])
  for key, value in flat(state["moe_bias"]).items():
    assert np.array_equal(flat(bias)[key], value), key
  moved = any(np.any(v != 0) for v in flat(state["moe_bias"]).values())
  assert moved == (name == "sigmoid_bias")
  _needs_transformers()  # and the export means what the run trained
  from maxlm.model import build
  model = build.model_for(cfg, 0, vocab_size=vocab)
  rng = np.random.default_rng(3)
  docs = [rng.integers(0, vocab, n).tolist() for n in (11, 21)]
  assert parity.max_difference(model, state["params"], out, docs, 32, state["moe_bias"]) < 1e-4


def test_a_moved_bias_with_softmax_is_refused_by_export(trained, tmp_path):
  """A checkpoint's bias is read before any tensor is written: with Qwen2-MoE (softmax), one
  that moved is refused in one line and nothing is exported."""
  from maxlm.interop import export, run_reader
  _, cfg = trained["softmax_window"]
  run = run_reader.RunCheckpoint(cfg.run_dir, log=lambda _: 0)
  read = run.array
  run.array = lambda leaf: read(leaf) + np.float32(leaf.collection == "moe_bias")
  hf = families.config_json(run.config, run.meta, run.vocab, parity.tok_lib.DEFAULT_SPECIAL,
                            "float32")
  with pytest.raises(hf_config.CannotExpress) as e:
    export.write_model(str(tmp_path), hf, parity.tok_lib.DEFAULT_SPECIAL, run)
  assert "model.moe.balance" in str(e.value) and "\n" not in str(e.value)
  assert not list(tmp_path.glob("*.safetensors"))


def test_training_from_an_moe_export_starts_from_its_bias(trained, tmp_path):
  """init.from an export places the parameters and the balancing bias (GLM-4-MoE's
  e_score_correction_bias): with the bias held still (bias_rate 0), the first checkpoint's is
  the exported run's, not a fresh zero one."""
  from maxlm.interop import export
  from maxlm.train import loop
  tmp, cfg = trained["sigmoid_bias"]
  out = tmp_path / "hf"
  export.export(cfg.run_dir, str(out), log=lambda _: 0)
  raw = config_lib.to_dict(cfg)
  raw.update(run_dir=str(tmp_path / "sft"), init={"from": str(out)})
  raw["train"] = {**raw["train"], "checkpoint_every": 1}
  raw["model"]["moe"] = {**raw["model"]["moe"], "bias_rate": 0.0}
  lines = []
  loop.train(config_lib.from_dict(raw), stop_after=1, log=lines.append)
  assert any(f"parameters from init.from {out} (hf)" in line for line in lines)
  before = flat(checkpoint_state(cfg.run_dir, 3)["moe_bias"])
  after = flat(checkpoint_state(str(tmp_path / "sft"), 1)["moe_bias"])
  assert before.keys() == after.keys() and any(np.any(v != 0) for v in before.values())
  for key, value in before.items():
    assert np.array_equal(after[key], value), key


def test_bfloat16_export_keeps_the_router_and_its_bias_float32(trained, tmp_path):
  import ml_dtypes
  from maxlm.interop import export
  _, cfg = trained["sigmoid_bias"]
  export.export(cfg.run_dir, str(tmp_path / "bf16"), dtype="bfloat16", log=lambda _: 0)
  weights = load_file(str(tmp_path / "bf16" / "model.safetensors"))
  kinds = {n: w.dtype for n, w in weights.items()}
  assert kinds["model.layers.1.mlp.gate.weight"] == np.float32
  assert kinds["model.layers.1.mlp.gate.e_score_correction_bias"] == np.float32
  assert kinds["model.layers.1.mlp.experts.0.down_proj.weight"] == ml_dtypes.bfloat16
  assert kinds["model.layers.0.mlp.down_proj.weight"] == ml_dtypes.bfloat16
  from maxlm.model import layers
  layer_1 = layers.per_layer(checkpoint_state(cfg.run_dir, 3)["params"], cfg.model)[1]
  assert np.array_equal(weights["model.layers.1.mlp.gate.weight"],
                        layer_1["moe"]["router"]["kernel"].T)

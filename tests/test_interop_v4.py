"""A DeepSeek-V4 model (model.mqa + model.mhc + V4's experts) as transformers'
DeepseekV4ForCausalLM (maxlm/interop/deepseek_v4.py): every tensor made once and read back bit
for bit, logits equal to transformers' on single documents and on a packed row, and what the
class cannot hold refused in one line."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from interop_helpers import checkpoint_state, flat, load_back
from safetensors.numpy import load_file, save_file

from maxlm import MaxlmError, config as config_lib
from maxlm.data import tokenizer as tok_lib
from maxlm.interop import families, hf_config, layout, load, parity, tensor_map
from maxlm.train import metrics

MQA = {"q_lora": 12, "rope_dim": 8, "out_groups": 2, "out_lora": 6, "window": 5,
       "csa_rate": 4, "hca_rate": 8, "index_heads": 8, "index_dim": 8, "index_top_k": 3}
MOE = {"experts": 4, "top_k": 2, "shared_experts": 1, "d_ff": 16, "score": "sqrt_softplus",
       "route_scale": 1.5, "swiglu_limit": 10.0}
CASES = {  # name: (model.mqa.compress, model.moe.hash_layers, balance)
    "window_only": ([0], 0, "bias"),
    "csa_hca_hash": ([0, 4, 8, 4], 1, "bias"),
    "hca_hash_unbiased": ([8, 8, 0, 8], 2, "none"),
}
STAGE = {"seq_len": 64, "batch": 1, "steps": 1}


def _config(name, **model):
  compress, hashed, balance = CASES[name]
  keys = {"d_model": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 1, "head_dim": 16,
          "d_ff": 48, "mqa": {**MQA, "compress": compress}, "mhc": {"streams": 4},
          "moe": {**MOE, "hash_layers": hashed, "balance": balance}}
  mode = "sparse" if MQA["csa_rate"] in compress else "dense"  # CSA's top k, as transformers
  return parity.config_for({**keys, **model}, [{**STAGE, "sparse": {"mode": mode}}])


def _random(name, **model):
  config = _config(name, **model)
  m, params = parity.random_params(config)
  # the indexer's ReLU scores tie at 0 where every head's product is negative, and the two
  # top-k break ties differently: positive head weights make a tie unlikely
  params = jax.tree_util.tree_map_with_path(
      lambda p, x: np.abs(x) if "index_weights" in jax.tree_util.keystr(p) else x, params)
  bias = parity.random_bias(m) if config.model.moe.balance == "bias" else None
  return config, m, params, bias




@pytest.mark.parametrize("name", list(CASES))
def test_layout_makes_every_hf_tensor_once_and_inverts(name):
  config, _, _, bias = _random(name)
  cfg = config.model
  made, rng = {}, np.random.default_rng(0)
  for leaf in layout.leaves(cfg, biased=bias is not None):
    array = None if leaf.path is None else rng.standard_normal(leaf.shape).astype(np.float32)
    for row, i in enumerate(leaf.layer_ids()) if leaf.per_layer else [(None, None)]:
      part = array if row is None else array[row]
      tensors = leaf.to_hf(part)
      full = {tensor_map.hf_layer_name(i, n) if i is not None else n: t
              for n, t in tensors.items()}
      assert not set(full) & set(made)
      made.update(full)
      if leaf.path is not None and not (leaf.collection == "moe_bias" and not tensors):
        assert np.array_equal(leaf.from_hf(tensors.__getitem__), part), leaf.path
  assert {n: t.shape for n, t in made.items()} == layout.hf_shapes(cfg, bias is not None)


@pytest.mark.parametrize("name", list(CASES))
def test_logits_equal_transformers_and_import_is_bitwise(name, tmp_path):
  pytest.importorskip("torch", reason="torch not installed (pip install -e '.[hf]')")
  pytest.importorskip("transformers", reason="transformers not installed (pip install -e "
                                             "'.[hf]')")
  config, m, params, bias = _random(name)
  parity.random_folder(tmp_path, config, params, bias)
  hf = json.loads((tmp_path / "config.json").read_text())
  assert hf["architectures"] == ["DeepseekV4ForCausalLM"]
  rng = np.random.default_rng(1)
  one = [rng.integers(0, 256, 64).tolist()]
  packed = [rng.integers(0, 256, 23).tolist(), rng.integers(0, 256, 41).tolist()]
  assert parity.max_difference(m, params, tmp_path, one, 64, bias) < 1e-4
  assert parity.max_difference(m, params, tmp_path, packed, 64, bias) < 1e-4
  loaded_params, loaded_bias = load_back(config, tmp_path, params, bias)
  want, got = flat(params), flat(loaded_params)
  assert want.keys() == got.keys()
  for key in want:
    assert np.array_equal(got[key], want[key]), key
  if bias is not None:
    for key, value in flat(bias).items():  # a hash layer's unused bias reads back as 0
      expected = 0 * value if _hashed_bias(config, key) else value
      assert np.array_equal(flat(loaded_bias)[key], expected), key


def test_batched_greedy_sampling_equals_transformers_generate(tmp_path):
  """The sampler's V4 path (a forward over the rows so far per token, eval/sample.py) on two
  left-padded prompts of different lengths continues them as transformers' generate does, with
  its own caches of compressed entries, over windows and entries that close while sampling."""
  torch = pytest.importorskip("torch", reason="torch not installed (pip install -e '.[hf]')")
  transformers = pytest.importorskip("transformers")
  from maxlm.eval import sample
  config, m, params, bias = _random("csa_hca_hash")
  parity.random_folder(tmp_path, config, params, bias)
  rng = np.random.default_rng(2)
  prompts = [rng.integers(0, 256, 7).tolist(), rng.integers(0, 256, 12).tolist()]
  tokens, lengths, _ = sample.generate_arrays(m, params, prompts, n_samples=1,
                                              max_new_tokens=20, temperature=0.0,
                                              collections={"moe_bias": bias})
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
  for prompt, ours in zip(prompts, tokens):
    with torch.no_grad():
      out = hf.eval().generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                               eos_token_id=None)
    assert ours.tolist() == out[0, len(prompt):].tolist()


def _hashed_bias(config, key):
  """Whether `key` (a keystr of the bias tree) is a hash layer's bias, which no tensor holds."""
  return any(leaf.collection == "moe_bias" and not leaf.names
             and key == jax.tree_util.keystr(tuple(jax.tree_util.DictKey(k) for k in leaf.path))
             for leaf in layout.leaves(config.model, biased=True))




def test_what_the_class_cannot_hold_is_refused_in_one_line():
  for model, key in (({"mhc": {"streams": 0}}, "model.mhc.streams"),
                     ({"moe": {**MOE, "first_dense": 1}}, "model.moe.first_dense"),
                     ({"moe": {**MOE, "shared_experts": 2}}, "model.moe.shared_experts"),
                     ({"moe": {**MOE, "score": "sigmoid"}}, "model.moe.score"),
                     ({"tied_embeddings": True}, "model.tied_embeddings")):
    with pytest.raises(hf_config.CannotExpress) as e:
      families.family(_config("csa_hca_hash", **model).model)
    assert key in str(e.value) and "\n" not in str(e.value)


def test_import_names_the_key_that_differs_and_checks_the_hash_table(tmp_path):
  config, m, params, bias = _random("csa_hca_hash")
  parity.random_folder(tmp_path, config, params, bias)
  for model, key in (({"mqa": {**MQA, "compress": [0, 4, 4, 4]}}, "model.mqa.compress"),
                     ({"mqa": {**MQA, "compress": [0, 4, 8, 4], "window": 7}},
                      "model.mqa.window"),
                     ({"moe": {**MOE, "hash_layers": 2}}, "model.moe.hash_layers")):
    other = _config("csa_hca_hash", **model)
    with pytest.raises(MaxlmError) as e:
      load_back(other, tmp_path, params, bias)
    assert key in str(e.value) and "\n" not in str(e.value), str(e.value)
  weights = load_file(str(tmp_path / "model.safetensors"))
  table = weights["model.layers.0.ffn.gate.tid2eid"]
  table[5] = table[5][::-1] + 1
  save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(MaxlmError, match="hash layer sends tokens to other experts"):
    load_back(config, tmp_path, params, bias)


@pytest.fixture(scope="module")
def v4_run(demo_data, tmp_path_factory):
  """configs/v4_tiny.yaml shrunk, trained with Muon and a moving bias through its CSA
  indexer's stages: dense (1 step), indexer_warmup (4), sparse (1); a checkpoint at the end of
  each."""
  from maxlm.train import loop
  cfg = config_lib.load("configs/v4_tiny.yaml", [
      f"data.dir={demo_data}", f"run_dir={tmp_path_factory.mktemp('v4') / 'run'}",
      "model.n_layers=2", "model.d_model=64", "model.moe.experts=4", "model.moe.d_ff=64",
      "model.mqa.compress=[4, 32]", "model.mqa.index_top_k=8", "train.checkpoint_every=100",
      "train.eval_every=0", "train.warmup_steps=0",
      "stages=[{seq_len: 64, batch: 8, steps: 1}, {seq_len: 64, batch: 8, steps: 4, sparse: "
      "{mode: indexer_warmup}}, {seq_len: 64, batch: 8, steps: 1, sparse: {mode: sparse}}]"])
  for stop in (1, 4, 1):
    loop.train(cfg, stop_after=stop, log=lambda _: 0)
  return cfg


def test_the_csa_indexer_warms_up_alone_then_selects(v4_run):
  """CSA's indexer (maxlm/model/mqa.py) reports nothing while dense; in warm-up it reports its
  KL to the heads' attention and it alone moves: every other parameter (Muon's and AdamW's
  halves alike) is bit for bit the dense stage's; sparse, a query attends at most its top 8
  entries. (That the KL's gradient lowers it: tests/test_model_compressed_blocks.py.)"""
  rows = metrics.read_jsonl(v4_run.run_dir)
  assert [r["stage"] for r in rows] == [0, 1, 1, 1, 1, 2]
  assert "indexer_kl" not in rows[0]
  warm, sparse = rows[1:5], rows[5]
  assert all(0 < r["indexer_kl"] < 10 for r in warm) and 0 < sparse["indexer_kl"] < 10
  assert all(r["selected_keys"] > 0 for r in warm) and 0 < sparse["selected_keys"] <= 8
  dense_end, warm_end = (flat(checkpoint_state(v4_run.run_dir, s)["params"]) for s in (1, 5))
  indexer = {k for k in dense_end
             if any(n in k for n in ("index_q", "index_weights", "index_compressor"))}
  assert indexer and all(not np.array_equal(dense_end[k], warm_end[k]) for k in indexer)
  for key in set(dense_end) - indexer:
    np.testing.assert_array_equal(dense_end[key], warm_end[key], err_msg=key)


def test_a_trained_v4_run_exports_loads_in_transformers_and_generates_alike(v4_run, demo_data,
                                                                            tmp_path, here):
  """The run above: `maxlm export` writes a folder transformers loads, its greedy continuation
  is `maxlm generate`'s, and `init.from` reads the export back bit for bit."""
  pytest.importorskip("torch", reason="torch not installed (pip install -e '.[hf]')")
  transformers = pytest.importorskip("transformers")
  import torch
  cfg = v4_run
  here("export", cfg.run_dir, "--out", tmp_path / "hf")
  prompt = "The river"
  ours = here("generate", cfg.run_dir, "--prompt", prompt, "--temperature", "0",
              "--max-tokens", "16").stdout.strip()
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"),
                                                         dtype=torch.float32).eval()
  ids = tokenizer(prompt, return_tensors="pt").input_ids
  with torch.no_grad():
    out = hf.generate(ids, max_new_tokens=16, do_sample=False)
  sp = tok_lib.load((demo_data / "tokenizer.model").read_bytes())  # what generate decodes with
  theirs = prompt + sp.decode(out[0, ids.shape[1]:].tolist())
  assert ours == theirs.strip() and len(ours) > len(prompt)
  state = checkpoint_state(cfg.run_dir, 6)
  vocab = json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"]
  model_cfg = dataclasses.replace(cfg.model, vocab_size=vocab)
  raw = {**config_lib.to_dict(cfg), "init": {"from": str(tmp_path / "hf")}}
  source = load.open_source(config_lib.from_dict(raw), vocab, None, log=lambda _: 0)
  for got, want in ((load.params(source, model_cfg, state["params"]), state["params"]),
                    (load.moe_bias(source, model_cfg, state["moe_bias"]), state["moe_bias"])):
    got, want = flat(got), flat(want)
    for key in want:
      expected = 0 * want[key] if _hashed_bias(cfg, key) else want[key]
      assert np.array_equal(got[key], expected), key
  assert any(np.any(v != 0) for v in flat(state["moe_bias"]).values())




def test_an_mtp_block_is_exported_only_to_v4_and_otherwise_starts_afresh(tmp_path):
  """DeepseekV4ForCausalLM's folder holds the MTP block as mtp.0.* (transformers skips them)
  and init.from reads it back; a Llama folder leaves it out, and init.from then keeps the
  run's own initial MTP parameters."""
  config, m, params, bias = _random("csa_hca_hash", mtp={"depth": 1, "weight": 0.3})
  assert "mtp" in params
  (tmp_path / "v4").mkdir()
  parity.random_folder(tmp_path / "v4", config, params, bias)
  assert any(n.startswith("mtp.0.") for n in load_file(str(tmp_path / "v4" /
                                                           "model.safetensors")))
  loaded, _ = load_back(config, tmp_path / "v4", params, bias)
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(loaded["mtp"]),
                                                  jax.tree.leaves(params["mtp"])))
  llama = parity.config_for({"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                             "head_dim": 8, "d_ff": 48, "mtp": {"depth": 1}},
                            [{"seq_len": 32, "batch": 1, "steps": 1}])
  _, llama_params = parity.random_params(llama)
  (tmp_path / "llama").mkdir()
  parity.random_folder(tmp_path / "llama", llama, llama_params)
  assert not any(n.startswith("mtp.") for n in load_file(str(tmp_path / "llama" /
                                                             "model.safetensors")))
  raw = {**config_lib.to_dict(llama), "init": {"from": str(tmp_path / "llama")}}
  notes = []
  source = load.open_source(config_lib.from_dict(raw), 256, None, log=notes.append)
  assert any("no MTP block" in n for n in notes)
  fresh = {tuple(getattr(k, "key", k) for k in p): np.full(x.shape, 7.0, np.float32)
           for p, x in jax.tree_util.tree_leaves_with_path(llama_params)}
  got = load.params(source, llama.model, llama_params, fresh=fresh.__getitem__)
  assert all(np.all(x == 7.0) for x in jax.tree.leaves(got["mtp"]))
  assert np.array_equal(got["embedding"], llama_params["embedding"])
  with pytest.raises(MaxlmError, match="holds no mtp.0."):
    load.params(source, llama.model, llama_params)

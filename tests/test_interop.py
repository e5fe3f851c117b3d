"""maxlm export and init.from (maxlm/interop): the folder transformers reads, the round trip,
the checks on init.from, and (where torch and transformers are installed: the `hf` extra)
logits, greedy continuations and tokenizer ids against transformers itself."""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import yaml
from safetensors import safe_open

from maxlm import MaxlmError, config as config_lib
from maxlm.data import tokenizer as tok_lib
from maxlm.interop import export, hf_config, layout, load, parity, run_reader, tensor_map

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL = {"size": "tiny", "dtype": "float32", "remat": "none", "d_model": 32, "n_layers": 3,
         "n_heads": 4, "n_kv_heads": 2, "head_dim": 8, "d_ff": 64, "loss_chunk": 32}
YARN = {"scaling": "yarn", "factor": 2.0, "original_length": 32, "theta": 5000.0}


def write_config(path, data_dir, run_dir, **extra):
  raw = {"seed": 0, "run_dir": str(run_dir),
         "data": {"dir": str(data_dir), "mix": {"prose": 0.6, "code": 0.4}, "overlap": 4,
                  "shuffle_rows": 8, "block_rows": 64},
         "stages": [{"seq_len": 32, "batch": 8, "steps": 4, "attention": "blockwise",
                     "block_q": 16, "block_k": 16, "mesh": {"data": 2, "fsdp": 4}},
                    {"seq_len": 64, "batch": 8, "steps": 2, "attention": "blockwise",
                     "block_q": 16, "block_k": 16, "rope": YARN}],
         "model": MODEL, "train": {"lr": 0.01, "warmup_steps": 1, "checkpoint_every": 3,
                                   "eval_every": 0, "eval_tokens": 64}}
  for key, value in extra.items():
    raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
  path.write_text(yaml.safe_dump(raw))
  return path


def quiet(*_):
  pass


@pytest.fixture(scope="module")
def trained(tmp_path_factory, demo_data):
  """A 3-layer GQA run trained 6 steps through a plain stage with its parameters sharded 4
  ways (fsdp: checkpoints 3 and 4 hold them in shards) and a YaRN stage, and its export
  (sharded: ~100 KB per file)."""
  from maxlm.train import loop
  tmp = tmp_path_factory.mktemp("interop")
  cfg = config_lib.load(str(write_config(tmp / "cfg.yaml", demo_data, tmp / "run")))
  loop.train(cfg, log=quiet)
  out = tmp / "hf"
  export.export(cfg.run_dir, str(out), shard_bytes=100_000, log=quiet)
  return tmp, cfg, out


def test_export_writes_a_llama_folder(trained):
  tmp, cfg, out = trained
  hf = json.loads((out / "config.json").read_text())
  manifest = json.loads((pathlib.Path(cfg.data.dir) / "manifest.json").read_text())
  assert hf["architectures"] == ["LlamaForCausalLM"] and hf["model_type"] == "llama"
  assert (hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"],
          hf["num_key_value_heads"], hf["head_dim"], hf["intermediate_size"]) == (32, 3, 4, 2, 8,
                                                                                 64)
  assert hf["vocab_size"] == manifest["vocab_size"] and hf["tie_word_embeddings"] is False
  assert hf["rms_norm_eps"] == 1e-5 and hf["rope_theta"] == 5000.0
  assert hf["rope_scaling"]["rope_type"] == "yarn" and hf["rope_scaling"]["factor"] == 2.0
  assert hf["rope_scaling"]["original_max_position_embeddings"] == 32
  assert hf["max_position_embeddings"] == 64  # factor x original: transformers 4.x reads it
  assert (hf["bos_token_id"], hf["eos_token_id"]) == (tok_lib.BOS, tok_lib.EOS)
  assert hf["maxlm"] == {"stage": 1, "seq_len": 64, "global_step": 6}
  gen = json.loads((out / "generation_config.json").read_text())
  assert gen["eos_token_id"] == tok_lib.EOS and gen["do_sample"] is False
  modes = {p.suffix: p.stat().st_mode & 0o777 for p in out.iterdir() if p.is_file()}
  assert modes[".safetensors"] == modes[".json"]  # readable by whoever reads the configs
  index = json.loads((out / "model.safetensors.index.json").read_text())
  files = sorted(set(index["weight_map"].values()))
  assert len(files) > 1 and files == sorted(p.name for p in out.glob("model-*.safetensors"))
  model_cfg = run_reader.RunCheckpoint(cfg.run_dir, log=quiet).model_cfg
  shapes = layout.hf_shapes(model_cfg)
  assert set(index["weight_map"]) == set(shapes) and "lm_head.weight" in shapes
  total = 0
  for file in files:
    with safe_open(str(out / file), framework="np") as f:
      for name in f.keys():
        assert index["weight_map"][name] == file
        array = f.get_tensor(name)
        assert array.shape == shapes[name] and array.dtype == np.float32
        total += array.nbytes
  assert index["metadata"]["total_size"] == total
  tok = json.loads((out / "tokenizer_config.json").read_text())
  assert tok["add_bos_token"] and not tok["add_eos_token"] and not tok["add_prefix_space"]
  assert (out / "tokenizer.model").read_bytes() == (
      pathlib.Path(cfg.data.dir) / "tokenizer.model").read_bytes()
  assert not list(tmp.glob("hf.tmp-*"))


@pytest.mark.parametrize("scan, tied", [(True, False), (False, True)])
def test_layout_makes_every_llama_tensor_once_and_inverts(scan, tied):
  import dataclasses
  cfg = dataclasses.replace(config_lib.ModelConfig(), vocab_size=50, n_layers=3,
                            scan_layers=scan, tied_embeddings=tied)
  made, rng = {}, np.random.default_rng(0)
  for leaf in layout.leaves(cfg):
    array = rng.standard_normal(leaf.shape).astype(np.float32)
    for i in range(leaf.shape[0]) if leaf.per_layer else [None]:
      part = array[i] if i is not None else array
      tensors = leaf.to_hf(part)
      assert tuple(tensors) == leaf.names
      full = {tensor_map.hf_layer_name(i, n) if i is not None else n: t for n, t in tensors.items()}
      assert not set(full) & set(made)
      made.update(full)
      assert np.array_equal(leaf.from_hf(tensors.__getitem__), part)
  assert {n: t.shape for n, t in made.items()} == layout.hf_shapes(cfg)
  assert all(t.flags.c_contiguous for t in made.values())  # safetensors writes memory as is


def test_trained_stage_of_a_boundary_checkpoint():
  assert hf_config.trained_stage({"stage": 1, "stage_step": 0}, 2) == 0
  assert hf_config.trained_stage({"stage": 1, "stage_step": 3}, 2) == 1
  assert hf_config.trained_stage({"stage": 0, "stage_step": 0}, 2) == 0


def _params_for(cfg, source, **model):
  import dataclasses
  import jax
  from maxlm.model import build
  config = config_lib.from_dict({**config_lib.to_dict(cfg), "model": {
      **config_lib.to_dict(cfg)["model"], **model}})
  vocab = source_vocab(cfg)
  m = build.model_for(config, 0, vocab_size=vocab)
  like = jax.eval_shape(lambda: build.init_params_abstract(m))
  return load.params(source, dataclasses.replace(config.model, vocab_size=vocab), like)


def source_vocab(cfg):
  return json.loads((pathlib.Path(cfg.data.dir) / "manifest.json").read_text())["vocab_size"]


def _checkpoint_params(run_dir, step):
  import jax
  import orbax.checkpoint as ocp
  state = ocp.PyTreeCheckpointer().restore(os.path.join(run_dir, "checkpoints", str(step),
                                                        "state"))
  return jax.tree_util.tree_map(np.asarray, state["params"])


def _flat(tree):
  import jax
  return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def test_round_trip_is_bitwise(trained, tmp_path):
  tmp, cfg, out = trained
  tokenizer = (pathlib.Path(cfg.data.dir) / "tokenizer.model").read_bytes()
  want = _flat(_checkpoint_params(cfg.run_dir, 6))
  from_export = load.open_source(config_lib.load(str(tmp / "cfg.yaml"), [f"init.from={out}"]),
                                 source_vocab(cfg), tokenizer, log=quiet)
  assert from_export.record["kind"] == "hf"
  got = _flat(_params_for(cfg, from_export))
  assert got.keys() == want.keys()
  for key in want:
    assert got[key].dtype == want[key].dtype and np.array_equal(got[key], want[key]), key
  # a scanned run starts an unrolled one from checkpoint 3, layer by layer
  source = load.open_source(config_lib.load(str(tmp / "cfg.yaml"), [
      f"init.from={cfg.run_dir}@3"]), source_vocab(cfg), tokenizer, log=quiet)
  assert source.record == {"from": f"{cfg.run_dir}@3", "kind": "maxlm",
                           "path": cfg.run_dir, "step": 3, "global_step": 3}
  unrolled = _params_for(cfg, source, scan_layers=False)
  stacked = _checkpoint_params(cfg.run_dir, 3)["layers"]
  for i in range(3):
    for path, array in _flat(unrolled[f"layer_{i}"]).items():
      assert np.array_equal(array, _flat(stacked)[path][i]), (i, path)
  # bfloat16: every weight rounded to nearest, once
  half = tmp_path / "bf16"
  export.export(cfg.run_dir, str(half), dtype="bfloat16", log=quiet)
  assert json.loads((half / "config.json").read_text())["torch_dtype"] == "bfloat16"
  with safe_open(str(half / "model.safetensors"), framework="np") as f:
    q = f.get_tensor("model.layers.1.self_attn.q_proj.weight")
  assert q.dtype == ml_dtypes.bfloat16
  full = want["['layers']['attention']['query']['kernel']"][1].reshape(32, 32).T
  assert np.array_equal(q, full.astype(ml_dtypes.bfloat16))


@pytest.mark.slow
def test_training_from_init_records_it_and_a_checkpoint_wins(trained, tmp_path):
  from maxlm.train import loop
  tmp, cfg, out = trained
  path = write_config(tmp_path / "sft.yaml", cfg.data.dir, tmp_path / "sft",
                      init={"from": str(out)})
  sft = config_lib.load(str(path))
  lines = []
  first = loop.train(sft, stop_after=2, log=lines.append)
  assert first["stopped"] and any(f"parameters from init.from {out} (hf)" in l for l in lines)
  meta = json.loads((tmp_path / "sft" / "checkpoints" / "2" / "meta" / "metadata").read_text())
  assert meta["init_from"]["from"] == str(out) and meta["init_from"]["kind"] == "hf"
  from maxlm.ckpt import integrity
  integrity.check_meta(2, meta)  # the record is under the metadata's own checksum
  lines.clear()
  loop.train(sft, log=lines.append)
  assert any("not used: run_dir holds checkpoint 2, which wins" in l for l in lines)
  last = json.loads((tmp_path / "sft" / "checkpoints" / "6" / "meta" / "metadata").read_text())
  assert last["init_from"] == meta["init_from"]  # carried through the resume
  rows = [json.loads(l) for l in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
  base = [json.loads(l) for l in (pathlib.Path(cfg.run_dir) / "metrics.jsonl")
          .read_text().splitlines()]
  assert rows[0]["loss"] < base[0]["loss"] - 0.1  # it starts where the source left off


@pytest.mark.parametrize("overrides, message", [
    (["init.from={out}", "model.d_ff=96"],
     r"hf is another model than this config's: intermediate_size 64 there, model.d_ff=96 here"),
    (["init.from={out}", "model.vocab_size=2048"], r"vocab_size \d+ there, model.vocab_size=2048"),
    (["init.from={out}", "model.tied_embeddings=true"],
     r"tie_word_embeddings False there, model.tied_embeddings=True here"),
    (["init.from={run}", "model.d_ff=96", "model.n_layers=2"],
     r"run is another model than this config's: model.n_layers 3 there, 2 here; model.d_ff 64 "),
    (["init.from={run}", "model.vocab_size=2048"], r"model.vocab_size \d+ there, 2048 here"),
    (["init.from={tmp}/missing"], r"init.from .*/missing: no such file or folder"),
    (["init.from={run}@99"], r"has no checkpoint 99; it has 3, 4, 6"),
    (["init.from={tmp}"], r"neither a maxlm run dir \(config.yaml\) nor a Hugging Face folder"),
    (["init.from={out}@3"], r"is not a maxlm run dir \(no config.yaml\), so @3 names no "),
])
def test_init_from_errors_are_one_line(trained, overrides, message):
  tmp, cfg, out = trained
  overrides = [o.format(tmp=tmp, run=cfg.run_dir, out=out) for o in overrides]
  config = config_lib.load(str(tmp / "cfg.yaml"), overrides)
  vocab = config.model.vocab_size or source_vocab(cfg)
  with pytest.raises(MaxlmError, match=message):
    load.open_source(config, vocab, None, log=quiet)


def test_init_from_checks_the_hf_config_and_the_tokenizer(trained, tmp_path):
  tmp, cfg, out = trained
  config = config_lib.load(str(tmp / "cfg.yaml"), [f"init.from={tmp_path / 'hf'}"])
  shutil.copytree(out, tmp_path / "hf")
  (tmp_path / "hf" / "maxlm-export.json").unlink()  # as a folder from elsewhere: edits count
  with pytest.raises(MaxlmError, match="tokenizer differs from this data dir's"):
    load.open_source(config, source_vocab(cfg), b"another tokenizer", log=quiet)
  hf = json.loads((out / "config.json").read_text())
  for change, message in (({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]},
                           "holds a gpt2 model"),
                          ({"attention_bias": True}, "attention_bias=True, which the maxlm"),
                          ({"num_key_value_heads": 4}, "num_key_value_heads 4 there")):
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**hf, **change}))
    with pytest.raises(MaxlmError, match=message):
      load.open_source(config, source_vocab(cfg), None, log=quiet)
  (tmp_path / "hf" / "config.json").write_text(json.dumps(hf))
  index = json.loads((out / "model.safetensors.index.json").read_text())
  del index["weight_map"]["model.layers.2.mlp.down_proj.weight"]
  (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
  with pytest.raises(MaxlmError, match="1 tensors missing, e.g. model.layers.2.mlp.down_proj"):
    load.open_source(config, source_vocab(cfg), None, log=quiet)
  shutil.copy(out / "model.safetensors.index.json", tmp_path / "hf")
  shard = sorted((tmp_path / "hf").glob("model-*.safetensors"))[-1]
  shard.write_bytes(shard.read_bytes()[:1000])  # truncated: a copy cut short
  source = load.open_source(config, source_vocab(cfg), None, log=quiet)
  with pytest.raises(MaxlmError, match=f"cannot read {shard.name}"):
    for name in source.names:
      source.get(name)


def test_init_from_syntax_is_checked_with_the_config():
  stages = [{"seq_len": 16, "batch": 1, "steps": 1}]
  with pytest.raises(config_lib.ConfigError, match=r"init.from: expected PATH or RUN_DIR@STEP"):
    config_lib.from_dict({"stages": stages, "init": {"from": "runs/a@last"}})
  with pytest.raises(config_lib.ConfigError, match=r"unknown key 'init.form'; did you mean "
                                                   r"'init.from'"):
    config_lib.from_dict({"stages": stages, "init": {"form": "runs/a"}})
  cfg = config_lib.from_dict({"stages": stages, "init": {"from": "runs/a@12"}})
  assert config_lib.to_dict(cfg)["init"] == {"from": "runs/a@12"}
  assert config_lib.from_dict(config_lib.to_dict(cfg)) == cfg


def test_export_refuses_what_it_cannot_do(trained, tmp_path, monkeypatch):
  tmp, cfg, out = trained
  with pytest.raises(MaxlmError, match="exists and is not empty.*--overwrite"):
    export.export(cfg.run_dir, str(out), log=quiet)
  for holder in (cfg.run_dir, tmp):  # --overwrite must never replace the run itself
    with pytest.raises(MaxlmError, match="(is|holds) the run dir"):
      export.export(cfg.run_dir, str(holder), overwrite=True, log=quiet)
  with pytest.raises(MaxlmError, match="has no checkpoint 5; it has 3, 4, 6"):
    export.export(cfg.run_dir, str(tmp_path / "x"), step=5, log=quiet)
  with pytest.raises(hf_config.CannotExpress, match="not a whole number of positions"):
    hf_config.rope_scaling(config_lib.RopeConfig(scaling="yarn", factor=2.5,
                                                 original_length=4095))
  reader = run_reader.RunCheckpoint(cfg.run_dir, log=quiet)
  key = "['params']['layers']['mlp']['down']['kernel']"
  monkeypatch.setitem(reader.digests, key, "float32[3, 64, 32]:0123456789abcdef")
  names = [n for n in reader.names() if "down_proj" in n]
  with pytest.raises(MaxlmError, match="parameter layers/mlp/down/kernel does not match its "
                                       "checksum"):
    for name in names:
      reader.get(name)
  assert not (tmp_path / "x").exists()
  stale = tmp_path / "y.tmp-999999999"  # left by an export that was killed
  (stale / "sub").mkdir(parents=True)
  export.export(cfg.run_dir, str(tmp_path / "y"), with_tokenizer=False, log=quiet)
  assert not stale.exists() and (tmp_path / "y" / "config.json").exists()


def _tree(folder):
  return sorted((str(p.relative_to(folder)), p.stat().st_size) for p in folder.rglob("*"))


def test_export_never_replaces_what_is_not_a_previous_export(trained, tmp_path):
  """--overwrite replaces an export and nothing else: not the run's checkpoints (through `..`
  or a symlink), another run dir, a data dir, a user's folder or file."""
  tmp, cfg, out = trained
  run = pathlib.Path(cfg.run_dir)
  other = tmp_path / "other_run"
  (other / "checkpoints").mkdir(parents=True)
  (other / "config.yaml").write_text("seed: 0\n")
  mine = tmp_path / "mine"
  mine.mkdir()
  (mine / "notes.txt").write_text("keep me")
  (tmp_path / "file").write_text("keep me")
  (tmp_path / "link").symlink_to(run / "checkpoints")
  before = {p: _tree(p) for p in (run, other, mine, pathlib.Path(cfg.data.dir))}
  cases = [(run / "checkpoints", "lies inside the run dir"),
           (tmp_path / ".." / tmp_path.name / "link", "lies inside the run dir"),
           (f"{run}/checkpoints/../checkpoints/new", "lies inside the run dir"),
           (other, "is the run dir"), (other / "checkpoints", "lies inside the run dir"),
           (cfg.data.dir, "is the data dir"), (f"{cfg.data.dir}/hf", "lies inside the data dir"),
           (mine, "is not a previous export of maxlm .it holds 'notes.txt'."),
           (tmp_path / "file", "is a file")]
  for target, message in cases:
    with pytest.raises(MaxlmError, match=message):
      export.export(cfg.run_dir, str(target), overwrite=True, with_tokenizer=False, log=quiet)
  assert {p: _tree(p) for p in before} == before
  assert (tmp_path / "file").read_text() == "keep me"
  again = tmp_path / "again"  # a previous export is replaced, and only with --overwrite
  export.export(cfg.run_dir, str(again), step=3, with_tokenizer=False, log=quiet)
  with pytest.raises(MaxlmError, match="exists and is not empty"):
    export.export(cfg.run_dir, str(again), with_tokenizer=False, log=quiet)
  export.export(cfg.run_dir, str(again), overwrite=True, with_tokenizer=False, log=quiet)
  assert json.loads((again / "config.json").read_text())["maxlm"]["global_step"] == 6
  listed = json.loads((again / "maxlm-export.json").read_text())["files"]
  assert sorted(listed) == sorted(p.name for p in again.iterdir() if p.name != "maxlm-export.json")
  (again / "extra.txt").write_text("mine now")  # no longer only an export: kept
  with pytest.raises(MaxlmError, match="holds 'extra.txt'"):
    export.export(cfg.run_dir, str(again), overwrite=True, with_tokenizer=False, log=quiet)
  assert (again / "extra.txt").exists()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "file", "link", "mine",
                                                         "other_run"]


def test_export_on_a_full_disk_writes_nothing(trained, tmp_path, monkeypatch):
  """ENOSPC midway through the weights: one line naming --out, no folder, no temporary."""
  tmp, cfg, out = trained
  calls = []

  def full(tensors, path, metadata=None):
    calls.append(path)
    with open(path, "wb") as f:
      f.write(b"half a file")
    if len(calls) == 2:
      raise OSError(28, "No space left on device", path)
  monkeypatch.setattr(export, "save_file", full)
  target = tmp_path / "hf"
  with pytest.raises(MaxlmError, match=r"--out .*hf: cannot write the export \(No space left "
                                       r"on device: .*\); nothing was written there"):
    export.export(cfg.run_dir, str(target), shard_bytes=100_000, log=quiet)
  assert len(calls) == 2 and list(tmp_path.iterdir()) == []
  from safetensors import SafetensorError  # how safetensors itself reports it

  def full_rust(tensors, path, metadata=None):
    raise SafetensorError("Error while serializing: I/O error: No space left on device (os "
                          "error 28)")
  monkeypatch.setattr(export, "save_file", full_rust)
  with pytest.raises(MaxlmError, match=r"os error 28\)\); nothing was written there"):
    export.export(cfg.run_dir, str(target), overwrite=True, log=quiet)
  assert list(tmp_path.iterdir()) == []


def test_export_default_is_the_newest_intact_checkpoint(trained, tmp_path, monkeypatch):
  """A damaged newest checkpoint (a parameter unreadable or off its checksum) is skipped by
  the default, said in one line; asked for by --step, it is an error."""
  tmp, cfg, out = trained
  read = run_reader.RunCheckpoint._read

  def damaged_6(self, path):
    if self.step == 6 and path[-1] == "kernel":
      raise run_reader.Damaged(f"checkpoint 6 of {self.run_dir} is corrupt: parameter "
                               f"{'/'.join(path)} does not match its checksum")
    return read(self, path)
  monkeypatch.setattr(run_reader.RunCheckpoint, "_read", damaged_6)
  lines = []
  done = export.export(cfg.run_dir, str(tmp_path / "e"), with_tokenizer=False,
                       shard_bytes=100_000, log=lines.append)
  assert done["step"] == 4 and json.loads((tmp_path / "e" / "maxlm-export.json").read_text())[
      "origin"]["step"] == 4
  assert any("checkpoint 6 of" in l and "exporting checkpoint 4, the newest before it" in l
             for l in lines), lines
  with pytest.raises(run_reader.Damaged, match="checkpoint 6 of .* does not match"):
    export.export(cfg.run_dir, str(tmp_path / "f"), step=6, with_tokenizer=False, log=quiet)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["e"]


def test_init_from_checks_export_digests_and_refuses_non_finite_weights(trained, tmp_path):
  from safetensors.numpy import load_file, save_file
  tmp, cfg, out = trained
  hf = tmp_path / "hf"
  shutil.copytree(out, hf)
  config = config_lib.load(str(tmp / "cfg.yaml"), [f"init.from={hf}"])
  shard = sorted(hf.glob("model-*.safetensors"))[1]
  data = bytearray(shard.read_bytes())
  data[len(data) // 2] ^= 1  # one bit of one weight: still a valid file, other numbers
  shard.write_bytes(bytes(data))
  with pytest.raises(MaxlmError, match=f"{shard.name} does not match its XXH3-128 in "
                                       "maxlm-export.json: damaged or edited after maxlm export"):
    load.open_source(config, source_vocab(cfg), None, log=quiet)
  shard.write_bytes(shard.read_bytes()[:-8])
  with pytest.raises(MaxlmError, match=f"{shard.name} has {len(data) - 8} bytes where "
                                       f"maxlm-export.json lists {len(data)}"):
    load.open_source(config, source_vocab(cfg), None, log=quiet)
  shutil.copy(out / shard.name, shard)
  (hf / "maxlm-export.json").write_text("{")
  with pytest.raises(MaxlmError, match="maxlm-export.json unreadable"):
    load.open_source(config, source_vocab(cfg), None, log=quiet)
  (hf / "maxlm-export.json").unlink()  # a folder from elsewhere: read, with a note
  tensors = load_file(shard)
  name = sorted(tensors)[0]
  tensors[name].flat[3] = np.inf
  save_file(tensors, shard, metadata={"format": "pt"})
  notes = []
  source = load.open_source(config, source_vocab(cfg), None, log=notes.append)
  assert any("no maxlm-export.json (not written by maxlm export)" in n for n in notes)
  with pytest.raises(MaxlmError, match=f"tensor {re.escape(name)} holds 1 NaN or infinite "
                                       "values"):
    for n in source.names:
      source.get(n)


def in_process(capsys, *args):
  """`maxlm ARGS` through cli.main in this process, as a CompletedProcess (its exit code,
  stdout and stderr), for a further case of a command a test has already run as a process."""
  from maxlm import cli
  capsys.readouterr()
  try:
    code = cli.main([str(a) for a in args])
  except SystemExit as e:
    code = e.code
  out = capsys.readouterr()
  return subprocess.CompletedProcess(args, code, out.out, out.err)


def test_export_command(trained, tmp_path, capsys):
  tmp, cfg, out = trained
  proc = subprocess.run([sys.executable, "-m", "maxlm.cli", "export", cfg.run_dir, "--out",
                         str(tmp_path / "e"), "--step", "3", "--no-tokenizer"],
                        capture_output=True, text=True, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr
  assert "checkpoint 3 (stage 0)" in proc.stdout
  assert json.loads((tmp_path / "e" / "config.json").read_text())["rope_scaling"] is None
  assert not (tmp_path / "e" / "tokenizer.model").exists()
  proc = in_process(capsys, "export", tmp_path / "nope", "--out", tmp_path / "f")
  assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
  assert "does not exist (no config.yaml)" in proc.stderr


# ---- against transformers itself (the `hf` extra) ----

def _needs_transformers():
  pytest.importorskip("torch", reason="torch not installed (pip install -e '.[hf]')")
  pytest.importorskip("transformers", reason="transformers not installed (pip install -e "
                                             "'.[hf]')")


PARITY_MODEL = {"d_model": 64, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16,
                "d_ff": 96}
PARITY_CASES = {  # name: (model keys, rope)
    "gqa": (PARITY_MODEL, {}),
    "gqa_tied_yarn": ({**PARITY_MODEL, "tied_embeddings": True},
                      {"scaling": "yarn", "factor": 4.0, "original_length": 16}),
    "gqa_linear": (PARITY_MODEL, {"scaling": "linear", "factor": 2.0}),
    "gqa_yarn_betas_attention_factor": (PARITY_MODEL, {
        "scaling": "yarn", "factor": 8.0, "original_length": 8, "beta_fast": 16,
        "beta_slow": 2, "attention_factor": 1.25, "theta": 500.0}),
}


@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_logits_equal_transformers(case, tmp_path):
  _needs_transformers()
  model_keys, rope = PARITY_CASES[case]
  config = parity.config_for(model_keys, [{"seq_len": 64, "batch": 1, "steps": 1,
                                           "attention": "blockwise", "block_q": 16,
                                           "block_k": 16, "rope": rope}])
  model, params = parity.random_params(config)
  parity.random_folder(tmp_path, config, params)
  rng = np.random.default_rng(1)
  one = [rng.integers(0, 256, 64).tolist()]
  packed = [rng.integers(0, 256, 23).tolist(), rng.integers(0, 256, 41).tolist()]
  assert parity.max_difference(model, params, tmp_path, one, 64) < 1e-4
  # a packed row of two documents against two separate transformers passes
  assert parity.max_difference(model, params, tmp_path, packed, 64) < 1e-4


TEXTS = ["Hello world", " leading space", "two  spaces\tand a tab\nnewline\n\n",
         "def f(x):\n    return x + 1\n", "unicode: héllo ✓ 日本語 🙂 \u200b", "digits 12345 3.14",
         "<|end|> and <|user|> spelled out, <s> </s> <unk>", "", "   ", "a\r\nb", "\x00\x07"]


def test_autotokenizer_ids_equal_maxlms(trained):
  _needs_transformers()
  import transformers
  _, cfg, out = trained
  tok = transformers.AutoTokenizer.from_pretrained(str(out))
  sp = tok_lib.load((out / "tokenizer.model").read_bytes())
  for text in TEXTS:
    assert tok(text)["input_ids"] == [tok_lib.BOS] + sp.encode(text), repr(text)
  assert tok.eos_token_id == tok_lib.EOS and tok.bos_token_id == tok_lib.BOS


def test_greedy_continuations_equal_maxlm_generate(trained, capsys):
  _needs_transformers()
  import torch
  import transformers
  _, cfg, out = trained
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
  tok = transformers.AutoTokenizer.from_pretrained(str(out))
  for i, prompt in enumerate(("def main(", "The ")):  # the second in this process
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
      theirs = hf.generate(ids, max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(ids))
    text = prompt + tok.decode(theirs[0, ids.shape[1]:], skip_special_tokens=True)
    args = ["generate", cfg.run_dir, "--prompt", prompt, "--temperature", "0", "--max-tokens",
            "12"]
    proc = (subprocess.run([sys.executable, "-m", "maxlm.cli", *args], capture_output=True,
                           text=True, cwd=ROOT) if i == 0 else in_process(capsys, *args))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip("\n") == text

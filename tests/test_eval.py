import math

import jax
import jax.numpy as jnp
import numpy as np

from maxlm import config as config_lib
from maxlm.config import MeshConfig
from maxlm.data import loader, store
from maxlm.eval import bpb, generate
from maxlm.model import build
from maxlm.parallel import mesh as mesh_lib

import datagen


def tiny_model():
  cfg = config_lib.from_dict({
      "model": {"size": "tiny", "vocab_size": 64, "dtype": "float32", "d_model": 32,
                "n_heads": 2, "n_kv_heads": 1, "head_dim": 16, "d_ff": 64},
      "stages": [{"seq_len": 32, "batch": 1, "steps": 1, "attention": "reference"}]})
  mesh = mesh_lib.make_mesh(MeshConfig(1, 1, 1, 1), jax.devices()[:1])
  model = build.model_for(cfg, 0, mesh)
  return cfg, mesh, model, build.init_params(model, jax.random.key(3), mesh, cfg.rules, 32)


def test_kv_cache_greedy_equals_full_recompute():
  cfg, mesh, model, params = tiny_model()
  prompt = [1, 5, 9, 13]
  with mesh:
    cached = generate.sample(model, params, prompt, max_tokens=10, temperature=0)
  seq = list(prompt)
  for _ in range(10):
    tokens = jnp.asarray([seq], jnp.int32)
    h, head, _ = model.apply({"params": params}, tokens, jnp.arange(len(seq))[None],
                             jnp.ones_like(tokens))
    seq.append(int(jnp.argmax(h[0, -1] @ head)))
  assert cached == seq[len(prompt):]


def test_seeded_sampling_is_reproducible():
  _, mesh, model, params = tiny_model()
  with mesh:
    runs = [generate.sample(model, params, [1, 2], max_tokens=12, temperature=1.0, top_k=5,
                            seed=s) for s in (7, 7, 8)]
  assert runs[0] == runs[1] and runs[0] != runs[2]


def test_bits_per_byte_counts_utf8_bytes_of_complete_documents(tmp_path):
  docs = datagen.make_docs([30, 70, 5, 200, 12, 40], sources=["a", "b"] * 3)
  data_dir = datagen.write_data_dir(tmp_path / "d", docs, val_fraction=0.5)
  cfg = datagen.make_config([{"seq_len": 32, "batch": 2, "steps": 1}], {"overlap": 4})
  cfg = config_lib.from_dict({**config_lib.to_dict(cfg), "data": {
      **config_lib.to_dict(cfg)["data"], "dir": data_dir}})
  data = loader.Data(cfg)
  nll_per_target = 0.5
  result = bpb.evaluate(lambda b: b["loss_mask"] * nll_per_target, data, 32, 2, max_rows=100)
  index = data.index
  val = np.flatnonzero(index.split == store.VAL)
  rows, complete = bpb.heldout_rows(index, 32, 4, 0.5, 100)
  assert set(complete) == set(val.tolist())
  assert math.isclose(result["val_loss"], nll_per_target)
  # every token of a held-out document is a target once (+ EOS): NLL = 0.5 * (n + 1)
  bits = sum(nll_per_target * (index.length[d] + 1) for d in val) / math.log(2)
  assert math.isclose(result["val_bpb"], bits / index.nbytes[val].sum(), rel_tol=1e-9)

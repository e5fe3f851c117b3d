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


def _three_source_data(tmp_path):
  rng = np.random.default_rng(1)
  lengths = (rng.lognormal(np.log(30), 0.7, 240).astype(int) + 2).tolist()
  sources = [("a", "b", "b", "c", "c", "c")[i % 6] for i in range(len(lengths))]
  data_dir = datagen.write_data_dir(tmp_path / "d", datagen.make_docs(lengths, sources),
                                    val_fraction=0.2)
  cfg = datagen.make_config([{"seq_len": 32, "batch": 4, "steps": 1}], {"overlap": 4})
  cfg = config_lib.from_dict({**config_lib.to_dict(cfg), "data": {
      **config_lib.to_dict(cfg)["data"], "dir": data_dir}})
  return loader.Data(cfg)


def _fake_nll(batch):
  """A per-position NLL that depends only on the row's own tokens (not on batch layout)."""
  return batch["loss_mask"] * (1.0 + (batch["targets"] % 13) / 5.0)


def test_row_quotas_are_equal_shares_and_spare_rows_are_dealt_again():
  assert bpb.row_quotas([10, 10, 10], 4) == [2, 1, 1]
  assert bpb.row_quotas([10, 1, 10], 7) == [3, 1, 3]
  assert bpb.row_quotas([0, 5, 2], 9) == [0, 5, 2]
  assert bpb.row_quotas([9, 9], 1) == [1, 0]
  assert bpb.row_quotas([3, 40, 40], 64) == [3, 31, 30]


def test_every_source_is_evaluated_and_the_rows_do_not_depend_on_the_batch(tmp_path):
  data = _three_source_data(tmp_path)
  index = data.index
  for max_rows in (3, 4, 7, 12):
    rows, _ = bpb.heldout_rows(index, 32, 4, 0.5, max_rows)
    per_source = np.bincount([r[0][0] for r in rows], minlength=3)
    assert len(rows) == max_rows and per_source.max() - per_source.min() <= 1, per_source
    assert all(len({p[0] for p in r}) == 1 for r in rows), "a row holds one source"
  tables = [bpb.evaluate_table(_fake_nll, data, 32, b, 7) for b in (1, 3, 8)]
  assert tables[0] == tables[1] == tables[2]
  assert sorted(tables[0]["sources"]) == ["a", "b", "c"]
  assert [tables[0]["sources"][n]["rows"] for n in "abc"] == [3, 2, 2]
  flat = bpb.as_metrics(tables[0])
  assert {f"val_loss/{n}" for n in "abc"} <= set(flat) and {f"val_bpb/{n}" for n in "abc"} <= set(flat)
  total = sum(e["tokens"] for e in tables[0]["sources"].values())
  assert tables[0]["all"]["tokens"] == total and tables[0]["all"]["rows"] == 7
  mean = sum(e["loss"] * e["tokens"] for e in tables[0]["sources"].values()) / total
  assert math.isclose(tables[0]["all"]["loss"], mean, rel_tol=1e-12)


def test_source_order_is_fixed_and_independent_of_other_sources(tmp_path):
  data = _three_source_data(tmp_path)
  first = bpb.source_order(data.index, 1)
  assert first == bpb.source_order(data.index, 1)
  held = np.flatnonzero((data.index.split == store.VAL) & (data.index.source == 1)).tolist()
  assert sorted(first) == held and first != held  # a permutation, not index order


def test_pack_places_whole_documents_and_a_long_one_does_not_crowd_out_the_rest(tmp_path):
  docs = datagen.make_docs([500, 20, 30, 40, 600])
  data_dir = datagen.write_data_dir(tmp_path / "d", docs)
  index = loader.Data(config_lib.from_dict({**config_lib.to_dict(datagen.make_config(
      [{"seq_len": 32, "batch": 1, "steps": 1}])), "data": {"dir": data_dir}})).index
  rows, complete = bpb.pack(index, [0, 1, 2, 3], 32, 4, 0.5, max_rows=6)
  assert complete == [1, 2, 3] and len(rows) == 6
  body = {d: sum(p[3] - p[2] for r in rows for p in r if p[1] == d) for d in range(4)}
  assert [body[1], body[2], body[3]] == [20, 30, 40]
  assert 0 < body[0] < 500  # the long one fills the room left, from its start, loss only
  assert min(p[2] for r in rows for p in r if p[1] == 0) == 0
  assert all(sum(p[3] - p[2] for p in r) <= 32 for r in rows)
  # nothing fits whole: the first document fills the rows, for the loss only
  rows, complete = bpb.pack(index, [0, 4], 32, 4, 0.5, max_rows=3)
  assert complete == [] and len(rows) == 3 and {p[1] for r in rows for p in r} == {0}

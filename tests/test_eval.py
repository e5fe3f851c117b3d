import json
import math
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from maxlm import config as config_lib
from maxlm.data import loader, store, tokenizer
from maxlm.eval import bpb, generate, windows

import datagen
from smallrun import tiny_model


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


def _data(tmp_path, lengths, sources, val_fraction, overlap=4, seed=1, bounds=None):
  docs = datagen.make_docs(lengths, sources, seed=seed, bounds=bounds)
  data_dir = datagen.write_data_dir(tmp_path / "d", docs, val_fraction=val_fraction)
  cfg = datagen.make_config([{"seq_len": 32, "batch": 4, "steps": 1}], {"overlap": overlap})
  return loader.Data(config_lib.from_dict({**config_lib.to_dict(cfg), "data": {
      **config_lib.to_dict(cfg)["data"], "dir": data_dir}}))


def _three_source_data(tmp_path, overlap=4):
  rng = np.random.default_rng(1)
  lengths = (rng.lognormal(np.log(30), 1.0, 240).astype(int) + 2).tolist()
  lengths[::17] = [300] * len(lengths[::17])  # documents longer than any L below
  sources = [("a", "b", "b", "c", "c", "c")[i % 6] for i in range(len(lengths))]
  return _data(tmp_path, lengths, sources, 0.3, overlap,
               bounds={i: range(7, n, 23) for i, n in enumerate(lengths)})


def _target_nll(batch):
  """An integer NLL per target that depends only on the target token (exact sums)."""
  return batch["loss_mask"] * (1.0 + batch["targets"] % 13)


def _expected(data, docs):
  """(targets, summed _target_nll) if every token of docs and each one's EOS is scored once."""
  count, total = 0, 0.0
  for d in docs:
    tokens = np.append(data.store.read(d, 0, int(data.index.length[d])), data.special.eos)
    count, total = count + len(tokens), total + float((1.0 + tokens % 13).sum())
  return count, total


@pytest.mark.parametrize("overlap", [0, 4])
def test_every_scored_token_is_a_target_once_whatever_l(tmp_path, overlap):
  data = _three_source_data(tmp_path, overlap)
  docs = windows.heldout_docs(data.index, 10**9)
  assert [sorted(d) for d in docs] == [
      np.flatnonzero((data.index.split == store.VAL) & (data.index.source == s)).tolist()
      for s in range(3)]
  tables = {L: bpb.evaluate_table(_target_nll, data, L, 4, 10**9) for L in (16, 32, 64, 256)}
  for name, source_docs in zip("abc", docs):
    tokens, nll = _expected(data, source_docs)
    for L, table in tables.items():
      e = table["sources"][name]
      assert (e["documents"], e["tokens"], e["nll"]) == (len(source_docs), tokens, nll), (L, name)
      assert e["bytes"] == int(data.index.nbytes[source_docs].sum())
  assert max(data.index.length[d] for s in docs for d in s) > 256  # windows were needed


def test_bits_per_byte_is_recomputable_from_the_table(tmp_path):
  data = _three_source_data(tmp_path)
  table = bpb.evaluate_table(_fake_nll, data, 32, 4, 500)
  for e in [*table["sources"].values(), table["all"]]:
    assert e["bpb"] == e["nll"] / math.log(2) / e["bytes"]
    assert e["loss"] == e["nll"] / e["tokens"]
  for field in ("documents", "tokens", "bytes"):
    assert table["all"][field] == sum(e[field] for e in table["sources"].values())
  flat = bpb.as_metrics(table)
  for name, e in table["sources"].items():
    assert flat[f"val_tokens/{name}"] == e["tokens"] and flat[f"val_bytes/{name}"] == e["bytes"]
    assert flat[f"val_bpb/{name}"] == e["bpb"] and flat[f"val_loss/{name}"] == e["loss"]
  assert flat["val_bpb"] == table["all"]["bpb"] and flat["val_tokens"] == table["all"]["tokens"]


def test_the_budget_takes_whole_documents_as_a_fixed_prefix(tmp_path):
  data = _data(tmp_path, [50, 80, 20, 400, 30, 60, 10, 90], None, 0.0)
  index = data.index
  order = list(range(8))
  assert windows.take(index, order, 150) == [0, 1, 2]  # 150 fits; the 400 would exceed
  assert windows.take(index, order, 149) == [0, 1]
  assert windows.take(index, [3, 0], 100) == [3]  # at least one, however long
  assert windows.take(index, order, 10**6) == order and windows.take(index, [], 5) == []
  small, large = windows.take(index, order, 200), windows.take(index, order, 900)
  assert large[:len(small)] == small


def test_small_sources_are_flagged(tmp_path):
  data = _three_source_data(tmp_path)
  table = bpb.evaluate_table(_fake_nll, data, 32, 4, 10**9)
  assert all(e["small"] == (e["tokens"] < bpb.SMALL_TOKENS) for e in table["sources"].values())
  assert [n for n, _ in bpb.small_sources(table)] == ["a", "b", "c"]  # a tiny held-out set
  assert "under 10,000 tokens" in bpb.small_note(bpb.small_sources(table))
  assert bpb.small_note([]) == ""
  big = bpb.entry(3, bpb.SMALL_TOKENS, 40_000, 1.0)
  assert not big["small"] and bpb.entry(3, bpb.SMALL_TOKENS - 1, 40_000, 1.0)["small"]


def _fake_nll(batch):
  """A per-position NLL that depends only on the row's own tokens (not on batch layout)."""
  return batch["loss_mask"] * (1.0 + (batch["targets"] % 13) / 5.0)


def test_every_source_is_evaluated_and_the_table_does_not_depend_on_the_batch(tmp_path):
  data = _three_source_data(tmp_path)
  rows = windows.heldout_rows(data.index, windows.heldout_docs(data.index, 300), 32, 4, 0.5)
  assert all(len({p[0] for p in r}) == 1 for r in rows), "a row holds one source"
  tables = [bpb.evaluate_table(_fake_nll, data, 32, b, 300) for b in (1, 3, 8)]
  assert tables[0] == tables[1] == tables[2]
  assert sorted(tables[0]["sources"]) == ["a", "b", "c"]
  total = sum(e["tokens"] for e in tables[0]["sources"].values())
  mean = sum(e["loss"] * e["tokens"] for e in tables[0]["sources"].values()) / total
  assert math.isclose(tables[0]["all"]["loss"], mean, rel_tol=1e-12)


def test_source_order_is_fixed_and_independent_of_other_sources(tmp_path):
  data = _three_source_data(tmp_path)
  first = windows.source_order(data.index, 1)
  assert first == windows.source_order(data.index, 1)
  held = np.flatnonzero((data.index.split == store.VAL) & (data.index.source == 1)).tolist()
  assert sorted(first) == held and first != held  # a permutation, not index order


def test_pack_fills_rows_first_fit_in_order(tmp_path):
  data = _data(tmp_path, [500, 20, 30, 40, 600], None, 0.0)
  pieces = [w for d in range(5) for w in windows.windows(data.index, d, 32, 4, 0.5)]
  rows = windows.pack(pieces, 32)
  assert [p for r in rows for p in r] != [] and all(
      sum(size for size, piece in pieces if piece in r) <= 32 for r in rows)
  assert sorted(p for r in rows for p in r) == sorted(p for _, p in pieces)
  body = {d: sum(p[3] - p[2] for _, p in pieces if p[1] == d) for d in range(5)}
  assert body == {d: int(data.index.length[d]) for d in range(5)}


def test_a_chat_document_is_scored_on_the_bytes_of_its_replies(tmp_path):
  replies = ["Vier — four.", "Ja, grüß dich! ✓"]
  chats = [{"id": f"chat-{i}", "messages": [
      {"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Frage {i}?"},
      {"role": "assistant", "content": replies[0]}, {"role": "user", "content": "Und?"},
      {"role": "assistant", "content": replies[1]}]} for i in range(30)]
  texts = [{"id": f"t{i}", "text": f"Plain text number {i}, with ümlauts.\n" * 3}
           for i in range(30)]
  (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(d) + "\n" for d in chats + texts))
  out = tmp_path / "data"
  proc = subprocess.run(  # prepare forks its workers: not from this process, which runs JAX
      [sys.executable, "-m", "maxlm.cli", "prepare", str(tmp_path / "mixed.jsonl"), "--out",
       str(out), "--vocab-size", "400", "--val-fraction", "0.5", "--workers", "1", "--lang",
       "any", "--filters", "off", "--dedup", "off"], capture_output=True, text=True)
  assert proc.returncode == 0, proc.stderr
  cfg = datagen.make_config([{"seq_len": 32, "batch": 2, "steps": 1}], {"overlap": 4})
  data = loader.Data(config_lib.from_dict({**config_lib.to_dict(cfg), "data": {
      **config_lib.to_dict(cfg)["data"], "dir": str(out)}}))
  index = data.index
  val = np.flatnonzero(index.split == store.VAL)
  chat, text = [d for d in val if index.is_chat[d]], [d for d in val if not index.is_chat[d]]
  assert chat and text
  reply_bytes = sum(len(r.encode()) for r in replies)
  assert {bpb.scored_bytes(data, d) for d in chat} == {reply_bytes}
  assert all(bpb.scored_bytes(data, d) == index.nbytes[d] for d in text)
  sp = tokenizer.load((out / "tokenizer.model").read_bytes())
  table = bpb.evaluate_table(lambda b: b["loss_mask"] * 1.0, data, 32, 2, 10**9)
  reply_targets = sum(len(sp.encode(r)) + 1 for r in replies)  # + each reply's end marker
  assert table["sources"]["mixed"]["tokens"] == len(chat) * reply_targets + sum(
      int(index.length[d]) + 1 for d in text)

"""Preference pairs and RL prompts through prepare, the planner and assembly
(maxlm/data/pairs.py): rejects per reason, the prompt cut from the left, a pair never split,
two adjacent segments sharing one prompt, provenance and ledger."""

import json

import numpy as np
import pytest

from maxlm import MaxlmError
from maxlm.data import assemble, ledger, pairs, plan, prepare, store, tokenizer

import datagen

WORDS = "the quick brown fox jumps over a lazy dog while seven green birds sing".split()


def _records():
  rng = np.random.default_rng(0)
  out = [{"text": " ".join(rng.choice(WORDS, 60))} for _ in range(60)]
  for i in range(20):
    w = rng.choice(WORDS, 24).tolist()
    out.append({"id": f"pair{i}", "source": "prefs", "prompt": " ".join(w[:8]),
                "chosen": " ".join(w[8:]), "rejected": " ".join(reversed(w[8:]))})
  out += [
      {"source": "prefs", "prompt": "p", "chosen": "a"},  # missing_field
      {"source": "prefs", "prompt": "", "chosen": "a", "rejected": "b"},  # missing_field
      {"source": "prefs", "prompt": "p", "chosen": 3, "rejected": "b"},  # missing_field
      {"source": "prefs", "prompt": "p", "chosen": " ", "rejected": "b"},  # empty_answer
      {"source": "prefs", "prompt": "p", "chosen": "same", "rejected": "same"},  # identical
      {"source": "prefs", "prompt": "p", "chosen": " ".join(WORDS * 20),
       "rejected": " ".join(WORDS[::-1] * 20)},  # over-long
      {"id": "cut", "source": "prefs", "prompt": "fox " * 300, "chosen": "a dog",
       "rejected": "dog a"},  # truncated
      {"id": "chat", "source": "prefs", "prompt": [{"role": "user", "content": "hi fox"}],
       "chosen": [{"role": "assistant", "content": "hello"}], "rejected": "go"},
      {"id": "q1", "source": "rl", "prompt": "2 + 2 =", "gold": 4},
      {"id": "q2", "source": "rl", "prompt": "", "gold": 4},  # missing_field
      {"id": "q3", "source": "rl", "prompt": "x", "gold": ""},  # empty_answer
      {"text": "a fox with a gold field is a document", "gold": 1},
  ]
  return out


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("pairs")
  src = tmp / "in.jsonl"
  src.write_text("".join(json.dumps(r) + "\n" for r in _records()))
  manifest = prepare.prepare([str(src)], str(tmp / "data"),
                             prepare.Options(vocab_size=300, progress=False, val_fraction=0.0,
                                             max_pair_len=400))
  return tmp / "data", manifest


def test_pair_records_are_counted_per_reason(prepared):
  data, manifest = prepared
  assert manifest["rejected_pairs"] == {"missing_field": 3, "empty_answer": 1,
                                        "identical_answers": 1, "over_long_pair": 1}
  assert manifest["rejected_prompts"] == {"missing_field": 1, "empty_answer": 1}
  assert manifest["truncated_pairs"] == 1
  assert manifest["sources"]["prefs"]["pairs"] == 22
  assert "rl" not in manifest["sources"]  # RL prompts are not training documents
  assert manifest["sources"]["in"]["documents"] == 61 and manifest["sources"]["in"]["pairs"] == 0
  (prompt,) = [json.loads(l) for l in open(data / prepare.PROMPTS)]
  assert prompt == {"id": "q1", "source": "rl", "prompt": "2 + 2 =", "gold": "4"}


def test_the_stored_pair_is_prompt_chosen_rejected_and_the_prompt_is_cut_from_the_left(
    prepared):
  data, _ = prepared
  index, ids = store.load_index(str(data)), list(store.load_doc_ids(str(data)))
  sp = tokenizer.load(open(data / "tokenizer.model", "rb").read())
  toks = store.TokenStore(str(data), index)
  doc = ids.index("pair3")
  p, c = index.pair_of(doc)
  t = toks.document(doc).tolist()
  rec = _records()[63]
  assert sp.decode(t[:p]) == rec["prompt"] and sp.decode(t[p:p + c]) == rec["chosen"]
  assert sp.decode(t[p + c:]) == rec["rejected"]
  cut = ids.index("cut")
  p, c = index.pair_of(cut)
  n = int(index.length[cut])
  assert pairs.positions(n, p) <= 400 and sp.decode(toks.document(cut)[p:].tolist()) == (
      "a dogdog a")
  assert sp.decode(toks.document(cut)[:p].tolist()).endswith("fox fox ")  # its end is kept
  chat = ids.index("chat")
  p, c = index.pair_of(chat)
  t = toks.document(chat).tolist()
  end = sp.piece_to_id(tokenizer.CHAT_END)
  assert t[p - 2] == sp.piece_to_id("<|assistant|>")  # the header is prompt
  assert t[p + c - 1] == end and t[-1] == end  # each answer ends its turn
  assert index.pair_of(ids.index(next(i for i in ids if i.startswith("in.jsonl"))))[0] == 0


def _mem_with_pairs(lengths, pair_at):
  mem = datagen.MemoryStore(datagen.make_docs(lengths, sources=["a"] * len(lengths)))
  return datagen.with_pairs(mem, pair_at)


def _assemble(mem, cfg):
  planner = plan.Planner(mem.index, cfg)
  L = cfg.stages[0].seq_len
  rows = planner.rows(0, 0, planner.stage_rows(0))
  arrays = [assemble.row_arrays(mem, datagen.SPECIAL, cfg.seed, r, L) for r in rows]
  return planner, rows, {f: np.stack([a[f] for a in arrays]) for f in assemble.FIELDS}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pairs_pack_whole_beside_documents_and_the_ledger_counts_them(seed):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(8, 60, 30).tolist()
  pair_at = {d: (int(rng.integers(1, 6)), int(rng.integers(1, lengths[d] - 6)))
             for d in range(0, 30, 3)}  # prompt 1-5 tokens, chosen and rejected at least 1
  mem = _mem_with_pairs(lengths, pair_at)
  cfg = datagen.make_config([{"seq_len": 64, "batch": 4, "steps": 6}],
                            {"overlap": 2, "fim": {"rate": 0.5}, "shuffle_rows": 4,
                             "block_rows": 8}, seed)
  planner, rows, batch = _assemble(mem, cfg)
  datagen.check_batch_rules(batch)
  datagen.check_pair_rules(batch)
  for r, pieces in enumerate(rows):
    for piece in pieces:
      if piece[1] in pair_at:
        assert piece[2:6] == (0, lengths[piece[1]], 0, 0), "a pair is one whole piece, no FIM"
  chosen = batch["roles"] == pairs.CHOSEN
  n_pairs = sum(1 for row in rows for p in row if p[1] in pair_at)
  assert n_pairs > 0
  st = ledger.stage_ledger(planner, 0)
  src = st["sources"]["a"]
  assert src["pairs"] == n_pairs
  assert src["loss"] == batch["loss_mask"].sum()
  assert src["positions"] == (batch["segment_ids"] > 0).sum()
  assert src["eos"] == (batch["targets"] == datagen.SPECIAL.eos).sum()
  answers = ((batch["roles"] > 0) & (batch["loss_mask"] == 1)
             & (batch["targets"] != datagen.SPECIAL.eos)).sum()
  assert src["answer"] == answers
  prompt_targets = ((batch["roles"] > 0) & (batch["loss_mask"] == 0)).sum()
  assert src["prompt"] == prompt_targets  # BOS->p1 ... p_last->a1: one target per prompt token
  assert int(chosen.any(axis=1).sum()) > 0
  again = plan.Planner(mem.index, cfg).rows(0, 0, planner.stage_rows(0))
  assert again == rows, "the plan is deterministic"


def test_a_pair_longer_than_the_row_is_an_error_never_a_split():
  mem = _mem_with_pairs([10, 40, 8], {1: (10, 15)})  # 40 + 10 + 2 = 52 positions
  cfg = datagen.make_config([{"seq_len": 48, "batch": 2, "steps": 2}],
                            {"overlap": 0, "shuffle_rows": 1, "block_rows": 2})
  with pytest.raises(MaxlmError, match=r"a preference pair fills 52 row positions, more than "
                     r"this stage's seq_len=48; a pair is never split"):
    _assemble(mem, cfg)
  cfg = datagen.make_config([{"seq_len": 52, "batch": 2, "steps": 2}],
                            {"overlap": 0, "shuffle_rows": 1, "block_rows": 2})
  _, rows, batch = _assemble(mem, cfg)
  datagen.check_pair_rules(batch)


def test_pair_provenance_and_show_batch_name_both_segments(prepared, tmp_path):
  from maxlm import config as config_lib
  from maxlm.data import loader, show
  data, _ = prepared
  cfg = config_lib.from_dict({"data": {"dir": str(data), "mix": {"prefs": 1.0}},
                              "stages": [{"seq_len": 400, "batch": 2, "steps": 2}]})
  d = loader.Data(cfg)
  rows = d.global_batch_pieces(0, 0)
  prov = d.provenance(rows)
  assert all(p.get("pair") for row in prov for p in row)
  batch = loader.stack([assemble.row_arrays(d.store, d.special, cfg.seed, r, 400)
                        for r in rows])
  datagen.check_pair_rules(batch)
  assert batch["segment_ids"][0].max() == 2 * len(rows[0])
  show.save_row_png(batch, 0, str(tmp_path / "row.png"), pieces=prov[0])
  labels = [show.piece_label(dict(p, role=r)) for p in prov[0] for r in ("chosen", "rejected")]
  assert "pair, chosen" in labels[0] and "pair, rejected" in labels[1]


def test_ledger_and_batches_commands_count_pairs_per_stage_and_source(prepared, tmp_path,
                                                                      capsys):
  import yaml
  from maxlm import cli
  data, _ = prepared
  cfg = tmp_path / "c.yaml"
  cfg.write_text(yaml.safe_dump({"data": {"dir": str(data), "mix": {"prefs": 0.5, "in": 0.5}},
                                 "stages": [{"seq_len": 400, "batch": 2, "steps": 3},
                                            {"seq_len": 512, "batch": 2, "steps": 2}]}))
  cli.main(["ledger", str(cfg), "--json"])
  led = json.loads(capsys.readouterr().out)
  out = tmp_path / "b.npz"
  cli.main(["batches", str(cfg), "--stage", "0", "--count", "3", "--out", str(out)])
  capsys.readouterr()
  z = np.load(out)
  prefs = led["stages"][0]["sources"]["prefs"]
  chosen_segments = sum(len(np.unique(z["segment_ids"][s, r][z["roles"][s, r] == 1]))
                        for s in range(3) for r in range(2))
  assert prefs["pairs"] == chosen_segments
  assert led["stages"][0]["sources"]["in"]["pairs"] == 0
  assert led["totals"]["prefs"]["pairs"] == sum(st["sources"]["prefs"]["pairs"]
                                               for st in led["stages"])
  assert prefs["pairs"] >= 1
  assert prefs["answer"] + prefs["prompt"] + 2 * prefs["pairs"] == (z["roles"] > 0).sum()
  # (a pair's positions: each segment's BOS input, its prompt and answer; the EOS is a target)
  cli.main(["ledger", str(cfg)])
  table = capsys.readouterr().out
  assert "pairs" in table.splitlines()[0] and "answer" in table.splitlines()[0]

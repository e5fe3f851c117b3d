import json
import pathlib
import sysconfig

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from maxlm import MaxlmError
from maxlm.data import plan, prepare, store, tokenizer

import datagen

STDLIB = pathlib.Path(sysconfig.get_paths()["stdlib"])
MARKDOWN = "# Title\n\nIntro paragraph with words.\n\n## Usage\n\n```python\nx = 1\n```\n\nEnd.\n"


@pytest.fixture(scope="session")
def prepared(tmp_path_factory):
  root = tmp_path_factory.mktemp("prep")
  code = root / "code"
  code.mkdir()
  for name in ("textwrap.py", "colorsys.py", "bisect.py", "shlex.py"):
    (code / name).write_text((STDLIB / name).read_text())
  (code / "guide.md").write_text(MARKDOWN * 3)
  (code / "blob.bin").write_bytes(b"\x00\x01")
  (code / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
  (code / "blank.md").write_text("  \n\t\n")
  lines = [
      json.dumps({"id": "doc/ä-42", "text": "Verbatim ids are kept.\n" * 5}),
      json.dumps({"text": "From the line's own source.", "source": "notes"}),
      b"\xff\xfe not utf-8".decode("latin-1"),
      json.dumps({"text": ""}), json.dumps({"text": "  \n "}), "{not json", "[1, 2]",
      json.dumps({"id": "no-text"}), json.dumps({"messages": "not a list"}),
      json.dumps({"id": "chat-1", "messages": [
          {"role": "user", "content": "What is two plus two?"},
          {"role": "assistant", "content": "Four."}]}),
  ]
  raw = b"\n".join(line.encode("latin-1") if line.startswith("\xff") else line.encode()
                   for line in lines)
  (root / "mixed.jsonl").write_bytes(raw)
  out = root / "data"
  manifest = prepare.prepare([str(code), str(root / "mixed.jsonl")], str(out),
                             prepare.Options(vocab_size=700, val_fraction=0.2, workers=2,
                                             progress=False))
  return out, manifest


def test_rejections_are_counted_per_reason(prepared):
  _, manifest = prepared
  assert manifest["rejected"] == {"non_utf8": 2, "empty": 3, "malformed_json": 2,
                                  "too_deep": 0, "bad_source": 0, "bad_id": 0,
                                  "missing_text": 1, "bad_messages": 1, "bad_unicode": 0}
  assert manifest["skipped_files"] == {".bin": 1}
  assert any("latin1.txt" in w for w in manifest["rejected_examples"]["non_utf8"])


def test_sources_ids_tokenizer_and_heldout(prepared):
  out, manifest = prepared
  ids = store.load_doc_ids(str(out))
  assert "doc/ä-42" in ids and "chat-1" in ids
  assert set(manifest["sources"]) == {"code", "mixed", "notes"}
  assert manifest["sources"]["code"]["documents"] == 5
  assert (out / "tokenizer.model").is_file()
  sp = tokenizer.load((out / "tokenizer.model").read_bytes())
  assert tokenizer.special_ids(sp) == tokenizer.DEFAULT_SPECIAL
  index = store.load_index(str(out))
  for name, s in manifest["sources"].items():
    held = (index.source == index.sources.index(name)) & (index.split == store.VAL)
    assert held.sum() == s["heldout_documents"]
    if s["documents"] >= 2:
      assert 1 <= s["heldout_documents"] < s["documents"]


def test_every_document_round_trips_and_sections_are_token_offsets(prepared):
  out, _ = prepared
  index, tokens = store.load_index(str(out)), store.TokenStore(str(out))
  sp = tokenizer.load((out / "tokenizer.model").read_bytes())
  ids = store.load_doc_ids(str(out))
  guide = ids.index(next(i for i in ids if i.endswith("guide.md")))
  text = sp.decode(tokens.document(guide).tolist())
  assert text == MARKDOWN * 3
  pos, level = index.bounds(guide)
  heading_cuts = [sp.decode(tokens.read(guide, 0, int(p)).tolist()) for p, lv in zip(pos, level)
                  if lv == 2]
  assert heading_cuts and all(text[len(c):].startswith("#") for c in heading_cuts)


def test_chat_loss_covers_assistant_content_and_end_only(prepared):
  out, _ = prepared
  index, tokens = store.load_index(str(out)), store.TokenStore(str(out))
  sp = tokenizer.load((out / "tokenizer.model").read_bytes())
  doc = store.load_doc_ids(str(out)).index("chat-1")
  toks = tokens.document(doc)
  mask = np.ones(len(toks), bool)
  for a, b in index.no_loss(doc):
    mask[a:b] = False
  counted = toks[mask].tolist()
  assert sp.decode(counted[:-1]) == "Four." and counted[-1] == tokenizer.DEFAULT_SPECIAL.chat_end


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(L=st.sampled_from([32, 64, 96, 200]), overlap=st.integers(0, 15),
       fim_rate=st.sampled_from([0.0, 0.5]))
def test_decoding_pieces_in_order_reconstructs_each_text(prepared, L, overlap, fim_rate):
  out, _ = prepared
  index, tokens = store.load_index(str(out)), store.TokenStore(str(out))
  sp = tokenizer.load((out / "tokenizer.model").read_bytes())
  train_tokens = int(index.length[index.split == store.TRAIN].sum())
  steps = 3 * train_tokens // (4 * L) + 4  # enough for every source to finish an epoch
  cfg = datagen.make_config([{"seq_len": L, "batch": 4, "steps": steps}],
                            {"overlap": overlap, "fim": {"rate": fim_rate}})
  planner = plan.Planner(index, cfg)
  pieces = {}  # per document, its pieces in packing order (an epoch's before the next's)
  for b in range(planner.num_blocks(0)):
    blk = planner.block(0, b)
    for r in np.argsort(blk.order):
      for k in range(blk.row_ptr[r], blk.row_ptr[r + 1]):
        pieces.setdefault(int(blk.doc[k]), []).append((int(blk.start[k]), int(blk.end[k])))
  assert set(pieces) == set(np.flatnonzero(index.split == store.TRAIN).tolist())
  for doc, spans in pieces.items():
    first_epoch, covered = [], 0
    for a, b in spans:
      if covered == index.length[doc]:
        break
      first_epoch.append((a, b))
      covered += b - a
    first_epoch.sort()
    assert covered == index.length[doc]
    assert [a for a, _ in first_epoch] == [0] + [b for _, b in first_epoch[:-1]], "they tile"
    body = np.concatenate([tokens.read(doc, a, b) for a, b in first_epoch])
    assert (body == tokens.document(doc)).all()
    if not index.is_chat[doc]:
      assert sp.decode(body.tolist()) == sp.decode(tokens.document(doc).tolist())


def test_only_bad_input_is_a_clear_error(tmp_path):
  bad = tmp_path / "bad.jsonl"
  bad.write_text("{oops\n" + json.dumps({"text": " "}) + "\n")
  with pytest.raises(MaxlmError, match="no usable documents.*malformed_json"):
    prepare.prepare([str(bad)], str(tmp_path / "out"),
                    prepare.Options(vocab_size=300, progress=False))
  with pytest.raises(MaxlmError, match="input not found"):
    prepare.prepare([str(tmp_path / "missing")], str(tmp_path / "out"),
                    prepare.Options(progress=False))

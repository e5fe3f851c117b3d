"""Cleaning by what a document is, on real text from this machine (tests/realtext.py): code in
JSON Lines is never language-filtered or line-cleaned, hard-wrapped prose keeps its text,
junk, other-language pages and near-copies are still removed; and the per-source funnel."""

import glob
import json
import statistics
import sys

import pytest

from maxlm.data import documents, prepare, quality, store, tokenizer
from maxlm.data.quality import kinds

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import realtext  # noqa: E402

N = 24  # documents per group


@pytest.fixture(scope="module")
def real(tmp_path_factory):
  root = tmp_path_factory.mktemp("real")
  truth, inputs = realtext.write(str(root), N)
  manifest = prepare.prepare(inputs, str(root / "out"),
                             prepare.Options(vocab_size=1000, workers=2, progress=False,
                                             quality=quality.QualityConfig(),
                                             rejected=str(root / "rejected.jsonl")),
                             log=lambda *a: None)
  ids = store.load_doc_ids(str(root / "out"))
  sp = tokenizer.load((root / "out" / "tokenizer.model").read_bytes())
  tokens = store.TokenStore(str(root / "out"))
  kept = {ids[i]: sp.decode(tokens.document(i).tolist()) for i in range(len(ids))}
  given = {d["id"]: d["text"] for d in documents.iter_documents(inputs, documents.Report())}
  rejected = {r["id"]: r for r in map(json.loads, open(root / "rejected.jsonl"))}
  return truth, manifest, kept, given, rejected


def kept_share(real, ids):
  _, _, kept, given, _ = real
  return [len(kept.get(i, "")) / len(given[i]) for i in ids]


def test_the_corpora_are_full_size_on_this_machine(real):
  truth = real[0]
  for group in ("wrapped", "wrapped_web", "code", "web", "web_wrapped", "near"):
    assert len(truth[group]) == N, group
  assert len(truth["docs"]) >= N // 2 and len(truth["junk"]) >= 20
  catalogs = glob.glob("/usr/share/locale/*/LC_MESSAGES/*.mo")
  assert len(truth["foreign"]) >= 3 or len(catalogs) < 20  # a machine without translations


def test_code_in_json_lines_is_code_never_language_filtered_or_line_cleaned(real):
  truth, manifest, kept, given, rejected = real
  code = manifest["funnel"]["sources"]["code"]
  assert code["kinds"] == {"code": N} and code["kinds_from"] == {"content": N}
  assert code["kept_chars_median"] == 1.0
  assert not any("'code'" in w for w in manifest["funnel"]["warnings"])
  assert not any(rejected.get(i, {}).get("step") in ("language", "lines", "quality",
                                                      "repetition") for i in truth["code"])
  assert all(kept[i] == given[i] for i in truth["code"] if i in kept)
  assert sum(i in kept for i in truth["code"]) >= 0.9 * N


def test_hard_wrapped_prose_keeps_its_characters(real):
  truth = real[0]
  assert statistics.median(kept_share(real, truth["wrapped"])) >= 0.9  # .txt files: prose
  manifest = real[1]
  assert manifest["funnel"]["sources"]["manpages"]["kinds"] == {"prose": N}


def test_markdown_docs_are_prose_and_never_line_cleaned(real):
  truth, manifest, kept, given, _ = real
  assert manifest["funnel"]["sources"]["docs"]["kinds"] == {"prose": len(truth["docs"])}
  docs = [i for i in truth["docs"] if i in kept]
  assert docs and all(kept[i] == given[i] for i in docs)


def test_hard_wrapped_web_pages_keep_their_paragraphs_whole(real):
  truth, _, kept, given, _ = real
  shares = []
  for page in truth["web_wrapped"]:
    if page not in kept:
      continue
    lines = given[page].split("\n")
    nav, footer = 4, 3  # three navigation lines and a title; a blank line, three footer lines
    body = [line for line in lines[nav:-footer - 1] if line.strip()]
    out = set(kept[page].split("\n"))
    shares.append(sum(len(line) for line in body if line in out) / sum(map(len, body)))
    assert not any(line in out for line in lines[:3] + lines[-footer:]), page
  assert len(shares) >= 0.9 * N and statistics.median(shares) >= 0.9, shares


def test_junk_and_other_languages_are_still_removed(real):
  truth, _, kept, _, rejected = real
  for group in ("junk", "foreign"):
    removed = [i for i in truth[group] if i not in kept]
    assert len(removed) >= 0.9 * len(truth[group]), (group, [i for i in truth[group]
                                                             if i in kept])
  assert all(rejected[i]["step"] == "language" for i in truth["foreign"])


def test_planted_near_duplicates_are_found(real):
  truth, _, kept, _, rejected = real
  near = [(i, original) for i, original, j in truth["near"] if j >= 0.8 and original in kept]
  assert len(near) >= 0.8 * N
  found = [i for i, original in near if rejected.get(i, {}).get("duplicate_of") == original]
  assert len(found) >= 0.95 * len(near), (len(found), len(near))


def test_the_funnel_adds_up_per_source(real):
  funnel = real[1]["funnel"]
  for name, c in list(funnel["sources"].items()) + [("total", funnel)]:
    for unit in ("documents", "bytes"):
      assert c["input"][unit] == c["kept"][unit] + sum(s[unit] for s in c["steps"]), name
  assert sum(c["input"]["documents"] for c in funnel["sources"].values()) == \
      funnel["input"]["documents"]
  assert funnel["sources"]["code"]["kept"]["tokens"] == \
      real[1]["sources"]["code"]["tokens"]


def test_kind_comes_from_flag_record_path_lang_suffix_content_then_web():
  parse = lambda record: documents._parse_line(json.dumps(record).encode(), "x:1",
                                               documents.Report())
  prose = "It was a dark and stormy night; the rain fell in torrents."
  cases = [({"text": prose, "kind": "code"}, ("code", "record")),
           ({"text": prose, "kind": "article"}, ("web", "default")),  # not a kind: no hint
           ({"text": prose, "max_stars_repo_path": "src/a.rs"}, ("code", "path")),
           ({"text": prose, "id": "lib/x.py"}, ("code", "path")),
           ({"text": prose, "language": "Python"}, ("code", "path")),
           ({"text": prose, "lang": "en"}, ("web", "default")),
           ({"text": prose}, ("web", "default"))]
  for record, want in cases:
    doc = parse(record)
    assert (doc["kind"], doc["kind_from"]) == want, record
  python = open(kinds.__file__).read()
  inspect = quality.Inspector(quality.QualityConfig(kinds={"forced": "prose"}))
  doc = {"source": "s", "id": "c", "where": "x", **parse({"text": python})}
  assert inspect.kind_of(doc) == ("code", "content")
  assert inspect.kind_of({**doc, "source": "forced"}) == ("prose", "flag")
  assert inspect.kind_of({**doc, "kind": "prose", "kind_from": "suffix"}) == ("prose", "suffix")
  with pytest.raises(Exception, match="unknown kind 'novel'"):
    kinds.parse_flags(["docs=novel"])

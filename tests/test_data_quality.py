"""The quality steps of prepare on planted cases made of real text from this machine: Python's
own documentation (pydoc_data) for English prose, translation catalogs for other languages."""

import dataclasses
import json
import random
import re

import numpy as np
import pytest

from maxlm import MaxlmError
from maxlm.data import prepare, quality, store
from maxlm.data.quality import minhash, rules
from maxlm.typed_yaml import ConfigError

from planted import JUNK, english_docs, foreign_docs, jaccard, perturb


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
  rng = random.Random(0)
  base = english_docs(90, words=250)
  rows, truth = [], {"near": [], "exact": [], "junk": [], "foreign": []}
  for i, text in enumerate(base):
    rows.append({"id": f"base-{i}", "text": text, "source": "web"})
  for i in range(0, 25):
    rows.append({"id": f"exact-{i}", "text": base[i], "source": "mirror"})
    truth["exact"].append(f"exact-{i}")
  for i in range(25, 65):
    copy = perturb(base[i], rng, fraction=(0.004, 0.008, 0.015, 0.03)[i % 4])
    rows.append({"id": f"near-{i}", "text": copy, "source": "mirror"})
    truth["near"].append((f"near-{i}", jaccard(base[i], copy)))
  for name, text in JUNK.items():
    rows.append({"id": f"junk-{name}", "text": text, "source": "web"})
    truth["junk"].append(f"junk-{name}")
  for i, text in enumerate(foreign_docs(5)):
    rows.append({"id": f"foreign-{i}", "text": text, "source": "web"})
    truth["foreign"].append(f"foreign-{i}")
  root = tmp_path_factory.mktemp("quality")
  path = root / "in.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return root, str(path), rows, truth


def run(planted, workers, name):
  root, path, _, _ = planted
  rejected = root / f"{name}.rejected.jsonl"
  manifest = prepare.prepare([path], str(root / name),
                             prepare.Options(vocab_size=600, workers=workers, progress=False,
                                             quality=quality.QualityConfig(),
                                             rejected=str(rejected), val_fraction=0.2))
  removed = {r["id"]: r for r in map(json.loads, rejected.read_text().splitlines())}
  return manifest, removed


def test_planted_duplicates_junk_and_languages(planted):
  _, _, rows, truth = planted
  manifest, removed = run(planted, 2, "two")
  survived = lambda copy: f"base-{copy.split('-')[1]}" not in removed  # its original was kept
  assert all(removed[i]["step"] == "exact_dup" and removed[i]["duplicate_of"] ==
             f"base-{i.split('-')[1]}" for i in truth["exact"] if survived(i))
  near = [(i, j) for i, j in truth["near"] if j >= 0.8 and survived(i)]
  assert len(near) >= 15, sorted(j for _, j in truth["near"])
  found = [i for i, _ in near if removed.get(i, {}).get("step") == "near_dup"]
  assert len(found) / len(near) >= 0.95, (len(found), len(near))
  assert all(removed[i]["duplicate_of"] == f"base-{i.split('-')[1]}" for i in found)
  base_removed = [i for i in removed if i.startswith("base-") and
                  removed[i]["step"] in ("exact_dup", "near_dup")]
  assert len(base_removed) <= 0.01 * 90, base_removed  # distinct documents are not merged
  assert all(i in removed and removed[i]["step"] in ("language", "lines", "quality", "repetition")
             for i in truth["junk"]), {i: removed.get(i) for i in truth["junk"]}
  assert all(removed[i]["step"] == "language" for i in truth["foreign"])

  funnel = manifest["funnel"]
  for unit in ("documents", "bytes"):
    assert funnel["input"][unit] == funnel["kept"][unit] + sum(s[unit] for s in funnel["steps"])
  assert funnel["input"]["documents"] == len(rows)
  assert funnel["kept"]["documents"] == sum(s["documents"] for s in manifest["sources"].values())
  assert sum(r["documents"] for r in funnel["rules"].values()) == len(removed)
  assert funnel["kept"]["tokens"] == sum(s["tokens"] for s in manifest["sources"].values())


def test_output_is_byte_identical_for_one_and_two_workers(planted):
  one, removed_one = run(planted, 1, "one")
  two, removed_two = run(planted, 2, "two-again")
  assert one["fingerprint"] == two["fingerprint"] and removed_one == removed_two


def test_no_validation_document_near_duplicates_a_training_one(planted):
  root, _, _, truth = planted
  manifest, removed = run(planted, 2, "split")
  index = store.load_index(str(root / "split"))
  ids = list(store.load_doc_ids(str(root / "split")))
  split = dict(zip(ids, index.split.tolist()))
  pairs = [(f"base-{c.split('-')[1]}", c) for c, j in truth["near"] if j >= 0.85]
  across = [(a, c) for a, c in pairs if a in split and prepare.heldout("mirror", c, 0.2) !=
            (split[a] == store.VAL)]  # pairs the split would have put on both sides
  assert across, "the planted set should hold a pair straddling the split"
  assert not [(a, c) for a, c in pairs if a in split and c in split]
  assert np.isfinite(index.lang_score.astype(np.float32)).all()  # prose: a language score each


@pytest.mark.parametrize("tasks,workers", [(1, 1), (3, 2)])
def test_datatrove_engine_gives_the_same_data_dir(planted, tasks, workers):
  pytest.importorskip("datatrove.executor", reason="datatrove (the cluster extra) is not "
                      "installed")
  root, path, _, _ = planted
  local, _ = run(planted, 2, f"engine-local-{tasks}")
  other = prepare.prepare([path], str(root / f"engine-{tasks}"),
                          prepare.Options(vocab_size=600, workers=workers, progress=False,
                                          quality=quality.QualityConfig(), val_fraction=0.2,
                                          engine="datatrove", tasks=tasks))
  assert other["fingerprint"] == local["fingerprint"]
  assert other["funnel"] == local["funnel"]


def test_records_from_a_cluster_are_merged_into_the_same_data_dir(planted):
  from maxlm.data.quality import engine
  root, path, _, _ = planted
  local, _ = run(planted, 2, "cluster-local")
  work = str(root / "cluster-work")
  inspector = quality.Inspector(quality.QualityConfig())
  for rank in (2, 0, 1):  # as three cluster tasks would, in any order
    list(engine.inspect_shard([path], inspector, work, rank=rank, world_size=3))
  merged = prepare.prepare([path], str(root / "cluster"),
                           prepare.Options(vocab_size=600, workers=2, progress=False,
                                           quality=quality.QualityConfig(), val_fraction=0.2,
                                           engine="datatrove", tasks=3, inspect_dir=work))
  assert merged["fingerprint"] == local["fingerprint"]
  with pytest.raises(MaxlmError, match="task 0 inspected with other quality settings"):
    prepare.prepare([path], str(root / "cluster-other"),
                    prepare.Options(vocab_size=600, workers=2, progress=False,
                                    quality=quality.load(None, ["gopher_min_words=10"]),
                                    engine="datatrove", tasks=3, inspect_dir=work))


def test_language_any_and_filters_off_keep_everything_usable(planted):
  root, path, rows, _ = planted
  manifest = prepare.prepare([path], str(root / "off"),
                             prepare.Options(vocab_size=600, workers=1, progress=False,
                                             quality=quality.OFF))
  assert manifest["funnel"]["kept"]["documents"] == len(rows)


def test_code_rules_and_c4_lines():
  t = rules.Thresholds()
  assert rules.code_rules("# Auto-generated by protoc. DO NOT EDIT.\nx = 1\n", t) == \
      "code_auto_generated"
  assert rules.code_rules("x = '" + "a" * 2000 + "'\n", t) == "code_max_line_length"
  assert rules.code_rules("def f(x):\n  return x + 1\n", t) is None
  text = "\n".join(["Home | About", "Enable JavaScript to view this page, please.",
                    "We use cookies. See our privacy policy for details."] +
                   ["This sentence is a proper one and ends well."] * 6)
  cleaned, rule = rules.c4_clean(text, t)
  assert rule is None
  assert cleaned.split("\n") == ["This sentence is a proper one and ends well."] * 6


def test_minhash_signature_equals_datasketch_legacy():
  datasketch = pytest.importorskip("datasketch", reason="datasketch (the quality-check extra) "
                                   "is not installed")
  import xxhash
  perms = minhash.permutations(128)
  for text in english_docs(20, words=150):
    normalized = minhash.normalize(text)
    ours = minhash.signature(minhash.shingles(normalized), perms)
    words = normalized.split()
    theirs = datasketch.MinHash(num_perm=128, scheme="legacy", permutations=(perms[0], perms[1]),
                                hashfunc=xxhash.xxh64_intdigest)
    theirs.update_batch([" ".join(words[i:i + 5]).encode() for i in range(len(words) - 4)])
    assert (ours == theirs.hashvalues.astype(np.uint32)).all()


def test_rules_decide_as_datatrove_does_with_the_same_word_splitter():
  filters = pytest.importorskip("datatrove.pipeline.filters", reason="datatrove (the "
                                "quality-check extra) is not installed")
  from datatrove.data import Document
  from datatrove.utils.word_tokenizers import WordTokenizer

  class Whitespace(WordTokenizer):
    def word_tokenize(self, text):
      return text.split()

    def sent_tokenize(self, text):
      return [s for s in re.split(r"(?<=[.!?])\s+", text) if s]

    def span_tokenize(self, text):
      return [(m.start(), m.end()) for m in re.finditer(r"[^.!?]+[.!?]*\s*", text)]

  words = Whitespace()
  t = rules.Thresholds()
  pairs = (  # C4's curly-bracket rule is left out on purpose: technical prose has braces
      (filters.GopherQualityFilter(language=words), lambda d: rules.gopher_quality(d, t)),
      (filters.GopherRepetitionFilter(language=words), lambda d: rules.gopher_repetition(d, t)),
      (filters.C4QualityFilter(language=words, filter_curly_bracket=False),
       lambda d: rules.c4_clean(d, t)[1]))
  docs = (english_docs(60, words=200) + list(JUNK.values()) +
          [d + "\n\n" + d for d in english_docs(10, words=100)] +
          [" ".join(d.split()[:40]) for d in english_docs(5, words=60)])
  for theirs, ours in pairs:
    agree = sum((theirs.filter(Document(text=d, id=str(i))) is True) == (ours(d) is None)
                for i, d in enumerate(docs))
    assert agree == len(docs), (type(theirs).__name__, agree, len(docs))


def test_hostile_flags_are_one_line_before_any_work(tmp_path):
  import subprocess
  import sys
  corpus = tmp_path / "in.jsonl"
  corpus.write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n"
                            for i, t in enumerate(english_docs(6, words=120))))
  before = corpus.read_bytes()
  cases = ((["--rejected", str(corpus)], "is (or is inside) the input"),
           (["--rejected", str(tmp_path / "out" / "r.jsonl")], "is inside --out"),
           (["--funnel-png", str(tmp_path / "f.xyz")], "give a .png file name"),
           (["--lang", "xx"], "unknown language code 'xx'"),
           (["--filter", "gopher_min_word=1"], "did you mean 'gopher_min_words'"))
  for flags, message in cases:
    proc = subprocess.run([sys.executable, "-m", "maxlm.cli", "prepare", str(corpus), "--out",
                           str(tmp_path / "out"), "--vocab-size", "400", *flags],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and message in proc.stderr, (flags, proc.stderr)
    assert proc.stderr.count("\n") == 1 and corpus.read_bytes() == before
  assert not (tmp_path / "out").exists()


def test_a_quality_file_is_not_overridden_and_code_keeps_its_symbols(tmp_path):
  (tmp_path / "q.yaml").write_text("filters: false\ndedup: true\nlang: [any]\n")
  config = quality.load(str(tmp_path / "q.yaml"))
  assert not config.filters and config.dedup
  inspect = quality.Inspector(config)
  plus, minus = ({"source": "c", "id": n, "kind": "code",
                  "text": f"def f(a, b):\n  return a {op} b\n"} for n, op in (("p1", "+"), ("p2", "-")))
  assert inspect(plus)["verdict"]["exact"] != inspect(minus)["verdict"]["exact"]
  emoji = {"source": "s", "id": "e", "kind": "prose", "text": "😀😀😀 🎉🎉"}
  marks = {"source": "s", "id": "m", "kind": "prose", "text": "!!! ??? ..."}
  assert inspect(emoji)["verdict"]["exact"] != inspect(marks)["verdict"]["exact"]


def test_every_threshold_range_is_enforced_as_documented(tmp_path):
  import inspect as inspect_lib
  source = inspect_lib.getsource(rules.Thresholds)
  for field in dataclasses.fields(rules.Thresholds):
    documented = re.search(rf"\b{field.name}: \w+ = [^#\n]+# ([^:\n]+)", source)[1].strip()
    assert documented == rules.range_text(*rules.threshold_range(field.name)), field.name
  for bad, words in (("gopher_max_bullet_lines=2", "in [0, 1]"),  # would switch the rule off
                     ("rep_top_2gram=1.5", "in [0, 1]"), ("code_max_line_length=0", ">= 1"),
                     ("gopher_max_mean_word_length=0", "> 0"), ("gopher_min_words=-1", ">= 0")):
    with pytest.raises(ConfigError, match=re.escape(words)):
      quality.load(None, [bad])
  assert quality.load(None, ["rep_top_2gram=1", "code_max_line_length=1"])
  with pytest.raises(ConfigError, match=r"num_perm: expected an integer in \[1, 4096\]"):
    quality.load(None, ["num_perm=100000000000"])  # would allocate for minutes, then die


def test_unknown_or_empty_keys_in_a_quality_file_are_one_line(tmp_path):
  for text, words in (("thresholds:\n  gopher_min_word: 3\n", "did you mean "
                       "'thresholds.gopher_min_words'"),
                      ("lang_by_sources:\n  docs: [en]\n", "did you mean 'lang_by_source'"),
                      ("lang_by_source:\n  '': [en]\n", "lang_by_source: a source name is empty"),
                      ("kinds:\n  ' ': code\n", "kinds: a source name is empty")):
    (tmp_path / "q.yaml").write_text(text)
    with pytest.raises(ConfigError, match=re.escape(words)):
      quality.load(str(tmp_path / "q.yaml"))

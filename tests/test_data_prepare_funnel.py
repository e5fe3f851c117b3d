"""What prepare says about what it removed: the per-source funnel's warnings and --strict,
--rejected listing input rejects and over-long pairs, --val-fraction 0, and `maxlm show-doc`
and `show-batch --text` showing what will be trained on."""

import json
import subprocess
import sys

import yaml

from maxlm.data import prepare, quality, store

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import realtext  # noqa: E402
import planted  # noqa: E402


def maxlm(*args):
  return subprocess.run([sys.executable, "-m", "maxlm.cli", *map(str, args)],
                        capture_output=True, text=True)


def write_jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


def test_val_fraction_zero_holds_nothing_out(tmp_path):
  docs = [{"id": f"d{i}", "text": t} for i, t in enumerate(planted.english_docs(6, words=80))]
  path = write_jsonl(tmp_path / "a.jsonl", docs)
  manifest = prepare.prepare([str(path)], str(tmp_path / "out"),
                             prepare.Options(vocab_size=400, workers=1, progress=False,
                                             val_fraction=0.0))
  assert manifest["sources"]["a"]["heldout_documents"] == 0
  index = store.load_index(str(tmp_path / "out"))
  assert (index.split == store.TRAIN).all()


def test_rejected_lists_input_rejects_and_over_long_pairs(tmp_path):
  text = planted.english_docs(1, words=200)[0]
  lines = [json.dumps({"id": "good", "text": text}), json.dumps({"id": "blank", "text": "  "}),
           '{"id": "surrogate", "text": "\\ud800 x"}', "{not json", json.dumps({"id": "no"}),
           json.dumps({"id": "long", "prompt": "Say it.", "chosen": text,
                       "rejected": text[::-1]}),
           json.dumps({"id": "short", "prompt": "Say it.", "chosen": "Yes, gladly.",
                       "rejected": "No, never."})]
  path = tmp_path / "in.jsonl"
  path.write_text("\n".join(lines) + "\n")
  rejected = tmp_path / "rejected.jsonl"
  manifest = prepare.prepare([str(path)], str(tmp_path / "out"),
                             prepare.Options(vocab_size=400, workers=1, progress=False,
                                             quality=quality.QualityConfig(lang=("any",)),
                                             rejected=str(rejected), max_pair_len=64))
  rows = [json.loads(line) for line in rejected.read_text().splitlines()]
  by_rule = {r["rule"]: r for r in rows}
  assert {"empty", "bad_unicode", "malformed_json", "missing_text"} <= set(by_rule)
  assert all(by_rule[r]["step"] == "input" and by_rule[r]["where"].startswith(str(path))
             for r in ("empty", "bad_unicode", "malformed_json", "missing_text"))
  assert by_rule["over_long_pair"] == {"id": "long", "source": "in", "step": "over_long",
                                       "rule": "over_long_pair"}
  funnel = manifest["funnel"]
  assert funnel["kept"]["documents"] == 2 == sum(s["documents"] for s in
                                                 manifest["sources"].values())
  over = {s["step"]: s for s in funnel["steps"]}["over_long"]
  assert over["documents"] == 1 and funnel["sources"]["in"]["kept"]["documents"] == 2
  assert funnel["input"]["documents"] == funnel["kept"]["documents"] + sum(
      s["documents"] for s in funnel["steps"])


def test_a_source_that_loses_most_is_warned_about_and_strict_refuses_it(tmp_path):
  code = write_jsonl(tmp_path / "code.jsonl", [{"id": f"c{i}", "text": t} for i, t in
                                               enumerate(realtext.python_sources(6))])
  prose = write_jsonl(tmp_path / "prose.jsonl", [
      {"id": f"p{i}", "text": t} for i, t in enumerate(planted.english_docs(6, words=150))])
  args = ("prepare", code, prose, "--vocab-size", 400, "--workers", 1, "--kind", "code=web")
  proc = maxlm(*args, "--out", tmp_path / "out")
  assert proc.returncode == 0, proc.stderr
  warning = [line for line in proc.stdout.splitlines() if line.startswith("warning: ")]
  assert len(warning) == 1 and "source 'code' lost" in warning[0], proc.stdout
  assert "--kind code=code" in warning[0]
  manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
  assert manifest["funnel"]["warnings"] == [warning[0][len("warning: "):]]
  strict = maxlm(*args, "--out", tmp_path / "strict", "--strict")
  error = strict.stderr.splitlines()[-1]  # one line, after the progress bars
  assert strict.returncode == 2 and "Traceback" not in strict.stderr
  assert error.startswith("maxlm prepare: error: --strict: source 'code' lost")
  assert not (tmp_path / "strict").exists()
  fine = maxlm("prepare", code, prose, "--vocab-size", 400, "--workers", 1, "--strict",
               "--out", tmp_path / "fine")
  assert fine.returncode == 0, fine.stderr
  typo = maxlm("prepare", code, prose, "--vocab-size", 400, "--workers", 1, "--strict",
               "--kind", "cod=code", "--out", tmp_path / "typo")
  assert typo.returncode == 2 and typo.stderr.splitlines()[-1].endswith(
      "--kind cod=code: no source is named 'cod' (the sources: code, prose)")


def test_show_doc_prints_the_cleaned_text_and_the_removed_lines_with_their_rules(tmp_path):
  import random
  pages = realtext.web_pages(4, random.Random(0))
  inp = write_jsonl(tmp_path / "web.jsonl", [{"id": f"w{i}", "text": t}
                                             for i, t in enumerate(pages)])
  assert maxlm("prepare", inp, "--out", tmp_path / "data", "--vocab-size", 400,
               "--workers", 1).returncode == 0
  shown = maxlm("show-doc", tmp_path / "data", "w1")
  assert shown.returncode == 0, shown.stderr
  body = pages[1].split("\n")
  assert shown.stdout.rstrip("\n") == "\n".join(body[5:-4])  # the paragraphs, nothing else
  diff = maxlm("show-doc", tmp_path / "data", "w1", "--diff", inp)
  assert diff.returncode == 0, diff.stderr
  out = diff.stdout.splitlines()
  assert out[0] == "w1: kind web (from default), kept, lines removed"
  assert out[1].startswith(f"- {body[0]}") and out[1].endswith("[c4_no_terminal]")
  assert f"  {body[5]}" in out
  missing = maxlm("show-doc", tmp_path / "data", "nope")
  assert missing.returncode == 2 and "holds no document 'nope'" in missing.stderr

  cfg = tmp_path / "cfg.yaml"
  cfg.write_text(yaml.safe_dump({"data": {"dir": str(tmp_path / "data"), "mix": {"web": 1}},
                                 "stages": [{"seq_len": 128, "batch": 2, "steps": 1}]}))
  batch = maxlm("show-batch", cfg, "--out", tmp_path / "row.png", "--text")
  assert batch.returncode == 0, batch.stderr
  segments = batch.stdout.split("--- segment ")[1:]
  assert segments and all(": web: w" in s for s in segments)
  texts = "\n".join(body for page in pages for body in page.split("\n"))
  assert all(s.split("\n", 1)[1].strip()[:20] in texts for s in segments)


def test_kinds_from_a_quality_file_and_the_datatrove_engine_give_the_same_data_dir(tmp_path):
  code = write_jsonl(tmp_path / "code.jsonl", [{"id": f"c{i}", "text": t} for i, t in
                                               enumerate(realtext.python_sources(5))])
  prose = write_jsonl(tmp_path / "prose.jsonl", [
      {"id": f"p{i}", "text": t} for i, t in enumerate(planted.english_docs(5, words=150))])
  (tmp_path / "q.yaml").write_text("kinds:\n  prose: prose\n")
  config = quality.load(str(tmp_path / "q.yaml"))
  assert config.kinds == {"prose": "prose"}
  run = lambda name, **kw: prepare.prepare([str(code), str(prose)], str(tmp_path / name),
                                           prepare.Options(vocab_size=400, workers=1,
                                                           progress=False, quality=config, **kw))
  local = run("local")
  sources = local["funnel"]["sources"]
  assert sources["code"]["kinds_from"] == {"content": 5}
  assert sources["prose"]["kinds"] == {"prose": 5} and sources["prose"]["kinds_from"] == {
      "flag": 5}
  try:
    import datatrove.executor  # noqa: F401
  except ImportError:
    return  # the cluster extra is not installed: the local half is all there is to check
  tasks = run("tasks", engine="datatrove", tasks=2)
  assert tasks["fingerprint"] == local["fingerprint"]

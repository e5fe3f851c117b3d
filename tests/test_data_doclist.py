"""`maxlm docs DATA_DIR` (maxlm/data/doclist.py): every document's id, kept or removed and why,
ids a record names by `path`, and the ids working in `show-doc`."""

import json

import pytest

import realtext
import smallrun


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  root = tmp_path_factory.mktemp("docs")
  topics = realtext.pydoc_topics(6)
  rows = [{"path": f"guide/{name}.md", "text": text} for name, text in topics]
  rows += [{"path": "guide/copy.md", "text": topics[0][1]},  # an exact copy: removed
           {"path": "guide/raw.md", "content": "text under another name"}]  # missing_text
  with open(root / "mine.jsonl", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  proc = smallrun.maxlm("prepare", root / "mine.jsonl", "--out", root / "data",
                        "--vocab-size", 400, "--workers", 1, "--kind", "mine=prose")
  assert proc.returncode == 0, proc.stderr
  assert ("mine.jsonl:8 (a `text` string or chat `messages` needed; its fields: 'content', "
          "'path')") in proc.stdout
  return root / "data", topics


def test_kept_and_removed_ids_with_their_source_tokens_and_fate(data, here):
  data_dir, topics = data
  proc = here("docs", data_dir, "--json")
  assert proc.returncode == 0, proc.stderr
  rows = list(map(json.loads, proc.stdout.splitlines()))
  found = {r["id"]: r for r in rows if r["id"] is not None}
  kept = [f"guide/{name}.md" for name, _ in topics]
  assert {found[i]["status"] for i in kept} <= {"train", "held out"}
  assert all(found[i]["source"] == "mine" and found[i]["tokens"] > 0 for i in kept)
  assert found["guide/copy.md"]["status"] == "removed: exact_dup/exact"
  (reject,) = [r for r in rows if r["id"] is None]  # no id: named by where it was read
  assert reject["status"] == "removed: input/missing_text" and "mine.jsonl:8 " in reject["where"]
  assert "(no id: rejected at " in here("docs", data_dir, "--removed").stdout
  only = here("docs", data_dir, "--removed", "--grep", "copy")
  assert only.stdout.splitlines()[1].split() == ["-", "mine", "removed:", "exact_dup/exact",
                                                 "guide/copy.md"]
  assert here("docs", data_dir, "--kept", "--grep", r"copy|raw").stdout.count("\n") == 1


def test_the_listed_ids_work_in_show_doc_and_mistakes_are_one_line(data, here):
  data_dir, topics = data
  shown = here("show-doc", data_dir, f"guide/{topics[1][0]}.md")
  assert shown.returncode == 0 and shown.stdout.rstrip("\n") == topics[1][1].rstrip("\n")
  gone = here("show-doc", data_dir, "guide/copy.md")
  assert gone.returncode == 2 and "was removed by exact_dup/exact" in gone.stderr
  for args, words in ((["--grep", "("], "not a regular expression"),
                      (["--source", "nope"], "has sources mine"),
                      (["--removed", "--source", "nope"], "has sources mine"),
                      (["--kept", "--removed"], "not both")):
    proc = here("docs", data_dir, *args)
    assert proc.returncode == 2 and words in proc.stderr and proc.stderr.count("\n") == 1
  unknown = here("show-doc", data_dir, "nope")
  assert unknown.returncode == 2 and "`maxlm docs" in unknown.stderr

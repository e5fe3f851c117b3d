"""Verifiable answers (maxlm/eval/verify.py): the extraction rule, matching, pass@k, and the
prompts file's bad lines counted by reason."""

import json

import pytest

from maxlm import MaxlmError
from maxlm.eval import verify


@pytest.mark.parametrize("text, mode, want", [
    ("so it is 12 and then 15", "numeric", "15"),
    ("costs 1,234.5 dollars", "numeric", "1,234.5"),
    ("<answer>7</answer> and later 9", "numeric", "7"),
    ("<answer> a </answer> x <answer>b c</answer>", "exact", "b c"),
    ("\n  Paris\nis the capital", "exact", "Paris"),
    ("no digits here", "numeric", None),
    ("   \n ", "exact", None),
    ("-3 then .5", "numeric", ".5"),
])
def test_extraction_rule(text, mode, want):
  assert verify.extract(text, mode) == want


def test_matching():
  assert verify.correct("1,234.0", "1234", "numeric")
  assert verify.correct("2e3", 2000, "numeric")
  assert not verify.correct("12", "13", "numeric") and not verify.correct("x", "1", "numeric")
  assert verify.correct(" Paris  France ", "Paris France", "exact")
  assert not verify.correct("paris", "Paris", "exact") and not verify.correct(None, "1", "exact")


def test_pass_at_k_is_the_unbiased_estimator():
  assert verify.pass_at(4, 1, 1) == 0.25 and verify.pass_at(4, 1, 4) == 1.0
  assert verify.pass_at(4, 0, 4) == 0.0 and verify.pass_at(5, 2, 2) == pytest.approx(1 - 3 / 10)
  prompts = [{"id": "a", "prompt": "1+1", "gold": "2"}, {"id": "b", "prompt": "2+2", "gold": "4"}]
  answers = {"1+1": ["2", "3", "2"], "2+2": ["5", "5", "4"]}
  res = verify.evaluate(lambda p, i: f"the answer is {answers[p][i]}", prompts, "numeric", 3)
  assert res["pass@1"] == pytest.approx((2 / 3 + 1 / 3) / 2) and res["pass@3"] == 1.0
  assert [r["correct"] for r in res["prompts"]] == [2, 1]


def test_prompts_file_counts_bad_lines(tmp_path):
  f = tmp_path / "p.jsonl"
  f.write_bytes(b'{"prompt": "q", "gold": 3}\nnot json\n{"prompt": "q"}\n{"prompt": "", '
                b'"gold": 1}\n{"prompt": "q", "gold": " "}\n\xff\n[1]\n')
  prompts, bad = verify.read_prompts(str(f))
  assert prompts == [{"id": "1", "source": "", "prompt": "q", "gold": "3"}]
  assert {k: n for k, n in bad.items() if n} == {"malformed_json": 3, "missing_field": 2,
                                                 "empty_answer": 1}
  f.write_text(json.dumps({"prompt": "q"}) + "\n")
  with pytest.raises(MaxlmError, match="no usable"):
    verify.read_prompts(str(f))
  with pytest.raises(MaxlmError, match="cannot be read"):
    verify.read_prompts(str(tmp_path / "missing.jsonl"))

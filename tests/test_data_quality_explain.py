"""`maxlm show-doc --diff`'s explanation (maxlm/data/quality/explain.py): each input line of a
document with the rule that removed it or none, as the quality steps judge it. The command
itself runs in tests/test_data_prepare_funnel.py."""

import pytest

from maxlm import MaxlmError
from maxlm.data.quality import QualityConfig, explain

from planted import english_docs

NAV = ["Home | Docs | Blog | Download | About", "Sign in | Register"]


def _page(kind="web"):
  body = english_docs(2, words=120)
  return {"id": "page", "source": "web", "kind": kind, "kind_from": "default",
          "text": "\n".join(NAV + ["", body[0], "", body[1]])}


def test_each_line_is_kept_or_removed_by_a_named_rule():
  other = {"id": "other", "source": "web", "kind": "web", "text": "Not this one."}
  kind, kind_from, judged, verdict = explain.explain([other, _page()], "page", QualityConfig())
  assert (kind, kind_from, verdict["step"]) == ("web", "default", None)
  assert [line for line, _ in judged][:2] == NAV
  rules = dict(judged)
  assert all(rules[line] for line in NAV), judged[:2]
  assert [rule for line, rule in judged[2:]] == [None] * (len(judged) - 2)
  diff = explain.format_diff(judged, width=20).split("\n")
  assert diff[0] == f"- {NAV[0][:17] + '...':<20}  [{rules[NAV[0]]}]"
  assert diff[1] == f"- {NAV[1]:<20}  [{rules[NAV[1]]}]"
  assert diff[3].startswith("  ") and diff[3][2:] == judged[3][0]


def test_other_kinds_and_unfiltered_web_keep_every_line():
  for page, config in ((_page("prose"), QualityConfig()),
                       (_page(), QualityConfig(filters=False))):
    _, _, judged, _ = explain.explain([page], "page", config)
    assert [line for line, _ in judged] == page["text"].split("\n")
    assert {rule for _, rule in judged} == {None}


def test_a_missing_document_and_a_data_dir_without_quality_settings():
  with pytest.raises(MaxlmError, match="no document 'gone' in the inputs given"):
    explain.explain([_page()], "gone", QualityConfig())
  assert explain.config_of({}) is None
  assert explain.config_of({"quality": {"lang": ["de"]}}).lang == ("de",)

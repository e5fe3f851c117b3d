"""C4's line rules by paragraph (quality/lines.py), the lorem-ipsum rule on the kept text only,
and Gopher's punctuation as datatrove's."""

import textwrap

import pytest
from pydoc_data import topics

from maxlm.data.quality import lines, rules

T = rules.Thresholds()


def paragraphs(n):
  """n English paragraphs of Python's own documentation, each on one line."""
  out = [" ".join(p.split()) for text in topics.topics.values() for p in text.split("\n\n")
         if len(p.split()) > 40 and p.strip().endswith(".") and not p.lstrip().startswith("*")]
  return list(dict.fromkeys(out))[:n]


def test_hard_wrapped_paragraphs_are_kept_whole_and_navigation_dropped():
  body = paragraphs(6)
  nav = ["Home | Docs | Blog | About", "Search", "Share on Twitter | Facebook"]
  for width in (60, 72, 79):
    wrapped = [textwrap.fill(p, width) for p in body]
    text = "\n".join(nav[:2] + ["\n\n".join(wrapped)] + nav[2:])
    cleaned, rule = rules.c4_clean(text, T)
    assert rule is None
    assert cleaned == "\n\n".join(wrapped), width  # every line of every paragraph, in place
    judged, doc_rule, _ = lines.explain(text, T)
    assert doc_rule is None
    assert [(line, r) for line, r in judged if r] == [(n, "c4_no_terminal") for n in nav]


def test_per_line_c4_would_have_shredded_the_same_text():
  wrapped = "\n\n".join(textwrap.fill(p, 72) for p in paragraphs(6))
  per_line = [line for line in wrapped.split("\n") if line.strip().endswith(lines.TERMINAL)
              and len(line.split()) >= 3]
  assert len("\n".join(per_line)) < 0.5 * len(wrapped)  # what C4 line by line keeps
  assert rules.c4_clean(wrapped, T)[0] == wrapped


def test_wrap_width_is_what_decides_a_continuation():
  assert lines.paragraphs(["a b c", "d e f."]) == [(0, 1)]  # 'd' does not fit beside 'a b c'
  text = ["x" * 70, "short line", "next one"]  # 'next' fits after 'short line': not wrapped
  assert lines.paragraphs(text) == [(0, 1), (2, 2)]
  assert lines.paragraphs(["Ends here.", "Another"]) == [(0, 0), (1, 1)]


def test_lorem_ipsum_in_a_dropped_line_keeps_the_page():
  body = "\n".join(paragraphs(3))
  sample = "<p>Lorem ipsum dolor sit amet</p>"  # a code sample: no terminal punctuation
  cleaned, rule = rules.c4_clean(body + "\n" + sample, T)
  assert rule is None and "Lorem" not in cleaned
  quoted = body + "\nThe filler text starts with Lorem ipsum dolor sit amet, as usual."
  assert rules.c4_clean(quoted, T) == (None, "c4_lorem_ipsum")


def test_removed_line_bytes_are_named_by_rule():
  body = "\n".join(paragraphs(3))
  text = "Home | Docs\n" + body + "\nWe use cookies. See our privacy policy for details."
  cleaned, rule, dropped = lines.clean(text, T)
  assert rule is None and cleaned == body
  assert dropped == {"c4_no_terminal": len("Home | Docs") + 1,
                     "c4_policy": len("We use cookies. See our privacy policy for details.") + 1}


def test_symbols_count_as_punctuation_as_datatrove_counts_them():
  nav = "Home | Docs | Blog | $ | + | < = > |"
  words = " ".join(["the history of the world and its people"] * 8)
  assert rules.gopher_quality(f"{words} {nav}", T) is None
  few = " ".join(["word"] * 47)  # 49 words, and five bars that are not words
  assert rules.gopher_quality(f"the of {few} | | | | |", T) == "gopher_min_words"
  filters = pytest.importorskip("datatrove.pipeline.filters", reason="datatrove (the "
                                "quality-check extra) is not installed")
  from datatrove.data import Document
  from datatrove.utils.text import PUNCTUATION_SET
  from datatrove.utils.word_tokenizers import WordTokenizer

  class Whitespace(WordTokenizer):
    def word_tokenize(self, text):
      return text.split()

    def sent_tokenize(self, text):
      return [text]

    def span_tokenize(self, text):
      return [(0, len(text))]

  theirs = filters.GopherQualityFilter(language=Whitespace())
  for n in range(44, 56):  # around gopher_min_words, with nav bars of symbols
    text = "the of " + " ".join(["word"] * n) + " | $ + < = > | |"
    assert (theirs.filter(Document(text=text, id="x")) is True) == \
        (rules.gopher_quality(text, T) is None), n
  # The difference left (docs/data.md): rare punctuation datatrove does not list.
  assert "§" not in PUNCTUATION_SET and rules._is_punct("§")
  text = "the of " + " ".join(["word"] * 47) + " §"
  assert rules.gopher_quality(text, T) == "gopher_min_words"
  assert theirs.filter(Document(text=text, id="x")) is True

"""Language identification (maxlm/data/quality/lang.py): py3langid's bundled model, no
download; a code and a probability, the same on every call; only the first characters count."""

from maxlm.data.quality import lang

from planted import english_docs, foreign_docs


def test_english_and_other_languages_are_told_apart():
  text = english_docs(1, words=80)[0]
  code, prob = lang.identify(text)
  assert code == "en" and 0.9 < prob <= 1.0 and isinstance(prob, float)
  assert lang.identify(text) == (code, prob)
  assert {"en", "de", "fr", "ja", "zh"} <= lang.known()
  for other in foreign_docs(3):
    assert lang.identify(other)[0] in lang.known() - {"en"}, other[:80]


def test_only_the_first_characters_decide():
  english = english_docs(1, words=500)[0][:lang.MAX_CHARS]
  assert lang.identify(english + " " + foreign_docs(1)[0] * 3) == lang.identify(english)

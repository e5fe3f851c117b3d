"""The text of the quality tests' planted cases, real text from this machine: English
documents from Python's own documentation (pydoc_data), other-language ones from translation
catalogs, near-copies, their word 5-gram Jaccard similarity, and junk pages. Used by
tests/test_data_quality.py, tests/test_data_prepare_funnel.py, tests/realtext.py and
tools/bench_prepare.py."""

import gettext
import glob
import re

import pytest
from pydoc_data import topics

from maxlm.data.quality import minhash


def english_docs(n, words=400):
  """n distinct English documents of ~`words` words, each from its own run of paragraphs."""
  paragraphs = list(dict.fromkeys(  # the topics repeat sections: each paragraph once
      " ".join(p.split()) for text in topics.topics.values() for p in text.split("\n\n")
      if len(p.split()) > 25 and p.strip().endswith(".") and not p.lstrip().startswith("*")))
  docs, at = [], 0
  while len(docs) < n and at < len(paragraphs):
    take = []
    while sum(len(p.split()) for p in take) < words and at < len(paragraphs):
      take.append(" ".join(paragraphs[at].split()))
      at += 1
    docs.append("\n\n".join(take))
  assert len(docs) == n, "pydoc_data has fewer paragraphs than the test needs"
  return docs


def foreign_docs(n):
  texts = []
  for path in sorted(glob.glob("/usr/share/locale/*/LC_MESSAGES/*.mo") +
                     glob.glob("/usr/share/vim/vim*/lang/*/LC_MESSAGES/*.mo")):
    lang = re.search(r"/(?:locale|lang)/([a-z]{2})[_/.]", path)
    if not lang or lang[1] in ("en",):
      continue
    try:
      catalog = gettext.GNUTranslations(open(path, "rb"))._catalog
    except Exception:  # noqa: BLE001 (a catalog this parser cannot read)
      continue
    strings = [v for k, v in catalog.items() if k and isinstance(v, str) and len(v) > 30]
    if len(strings) > 40:
      texts.append(" ".join(strings[:60]))
    if len(texts) >= n:
      break
  if len(texts) < n:
    pytest.skip("this machine has too few translation catalogs for other languages")
  return texts


def perturb(text, rng, fraction=0.03):
  words = text.split(" ")
  for i in rng.sample(range(len(words)), max(1, int(fraction * len(words)))):
    words[i] = "changed"
  return " ".join(words) + "\n\nShare this article with your friends and colleagues today."


def jaccard(a, b, n=5):
  def grams(t):
    w = minhash.normalize(t).split()
    return {" ".join(w[i:i + n]) for i in range(len(w) - n + 1)}
  ga, gb = grams(a), grams(b)
  return len(ga & gb) / len(ga | gb)


JUNK = {
    "nav": "\n".join(["Home | About | Products | Contact | Login", "Menu Search Cart",
                      "Copyright 2024 All rights reserved", "Follow us on social media"] * 12),
    "spam": ("buy cheap shoes online best cheap shoes discount shoes " * 80).strip() + ".",
    "lorem": ("Lorem ipsum dolor sit amet, consectetur adipiscing elit. Sed do eiusmod tempor "
              "incididunt ut labore et dolore magna aliqua. " * 20),
    "cookies": "\n".join(["This website uses cookies to improve your experience."] * 30),
}

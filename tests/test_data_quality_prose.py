"""Prose documents judged by their prose (maxlm/data/quality/prose.py): literal blocks out of the
statistics, short files kept, templates not taken for spam; on this machine's docs and man
pages, with junk given as prose still removed."""

import random

from maxlm.data import quality
from maxlm.data.quality import prose

import realtext

README = """Intro paragraph with words.

```json
{"a": 1}
```

The following example lists buckets::

    aws s3 ls

    more

Output::

  {"b": 2}

After it.

.. code-block:: python

   x = 1

End.
"""
MAN = """NAME
       ls - list directory contents

DESCRIPTION
       List  information  about the FILEs.

       -a, --all
              do not ignore entries starting with .
"""


def test_literal_blocks_leave_the_judged_text_and_indented_prose_stays():
  assert prose.prose_only(README) == ("Intro paragraph with words.\n\n\nThe following example "
                                      "lists buckets:\n\n\nAfter it.\n\n\nEnd.\n")
  assert prose.prose_only(MAN) == MAN  # man pages indent their prose: not a literal block
  assert prose.prose_only("```\nnever closed\n") == ""


def _kept(docs, kind):
  """(share of bytes kept, documents removed) by steps 1-5 for documents of `kind`."""
  inspect = quality.Inspector(quality.QualityConfig(dedup=False))
  removed = [text for text in docs if inspect(
      {"source": "s", "id": "d", "kind": kind, "text": text})["verdict"]["step"]]
  total = sum(len(t.encode()) for t in docs)
  return 1 - sum(len(t.encode()) for t in removed) / total, len(removed)


def test_a_short_file_is_kept_whole_and_never_language_guessed():
  inspect = quality.Inspector(quality.QualityConfig())
  doc = inspect({"source": "s", "id": "r", "kind": "prose", "text": "Hallo Welt. Siehe setup."})
  assert doc["verdict"]["step"] is None and doc["verdict"]["lang"] is None
  web = inspect({"source": "s", "id": "w", "kind": "web", "text": "Hallo Welt. Siehe setup."})
  assert web["verdict"]["step"] is not None  # a crawled stub is still judged


def test_junk_inside_a_fence_is_judged_as_literal_text():
  inspect = quality.Inspector(quality.QualityConfig())
  for text, rule in (("```\n" + "\x01\x02\x03 garbage \x7f" * 5000, "literal_max_line_length"),
                     ("```\n" + "\x01\x02 garbage \x7f\n" * 50, "literal_control_chars"),
                     ("Intro.\n```\n" + "#$%^&*(){}[]\n" * 300, "literal_alnum_fraction")):
    verdict = inspect({"source": "s", "id": "j", "kind": "prose", "text": text})["verdict"]
    assert (verdict["step"], verdict["rule"]) == ("quality", rule)
  example = "Lists buckets::\n\n    {\n        \"Buckets\": [\"a\", \"b\"]\n    }\n"
  kept = inspect({"source": "s", "id": "k", "kind": "prose", "text": example})
  assert kept["verdict"]["step"] is None  # indented JSON: a fifth alphanumeric with spaces


def test_this_machines_docs_and_man_pages_keep_90_percent_and_junk_as_prose_goes():
  docs = [t for _, t in realtext.site_docs(150)]
  man = [t for _, t in realtext.hard_wrapped(60)]
  junk = realtext.junk_pages(random.Random(0))
  assert len(docs) >= 100 and len(man) == 60
  share, _ = _kept(docs, "prose")
  assert share >= 0.9, share
  assert _kept(docs, "web")[0] < share  # web rules would cost these docs more
  assert _kept(man, "prose")[0] >= 0.9
  assert _kept(junk, "prose") == (0.0, len(junk))

import pathlib
import sysconfig

import numpy as np
import pytest

from maxlm.data import sections, tokenizer

PROSE = """# Title

A first paragraph that runs on for a while. It has sentences! Does it have questions? Yes, \
"quoted ones." And then words follow words for long enough that the planner needs cuts within \
this one line, which is how unwrapped markdown is written.
A hard-wrapped line of a second thought
that continues on this line, and on
this one, to its end.

Title two
=========

Short.
"""


def test_coarse_boundaries_are_unchanged_and_fine_ones_lie_between():
  found = sections.boundaries(PROSE, "prose")
  coarse = [(c, lv) for c, lv in found if lv > 0]
  assert [(PROSE[c:c + 5], lv) for c, lv in coarse] == [("A fir", 1), ("Title", 2), ("Short", 1)]
  fine = [(c, lv) for c, lv in found if lv < 0]
  assert {lv for _, lv in fine} <= {sections.LINE, sections.SENTENCE, sections.WORD}
  for c, lv in fine:
    if lv == sections.LINE:
      assert PROSE[c - 1] == "\n"
    else:  # before the space, which starts the next block
      assert PROSE[c] == " " and PROSE[c - 1] != " "
    if lv == sections.SENTENCE:
      assert PROSE[c - 1] in ".!?\""
  offsets = [0] + [c for c, _ in found] + [len(PROSE)]
  assert offsets == sorted(offsets)
  assert max(np.diff(offsets)) <= sections.FINE_CHARS + 20, "no long stretch without a cut"
  assert min(b - a for (a, la), (b, lb) in zip(found, found[1:])
             if la < 0 and lb < 0) >= sections.FINE_CHARS // 2


def test_a_sentence_end_outranks_a_word_and_a_line_start_outranks_both():
  text = "word " * 5 + "end. Next " + "word " * 20
  found = dict(sections.boundaries(text, "prose"))
  assert found.get(text.index(" Next")) == sections.SENTENCE
  lines = "\n".join(["alpha beta gamma delta epsilon."] * 6)
  assert {lv for _, lv in sections.boundaries(lines, "prose")} == {sections.LINE}
  code = "x = call(a, b)  # what. Then\n" * 5
  assert sections.SENTENCE not in {lv for _, lv in sections.boundaries(code, "code")}


def test_text_without_spaces_gets_no_fine_boundary():
  assert sections.boundaries("0123456789abcdef" * 20, "prose") == []


@pytest.fixture(scope="module")
def small_tokenizer():
  texts = [p.read_text() for p in sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob(
      "[a-c]*.py"))[:12]]
  return tokenizer.load(tokenizer.train(texts + [PROSE], 400)), texts


def test_blocks_encode_to_the_tokens_of_the_whole_text(small_tokenizer):
  sp, texts = small_tokenizer
  for text, kind in [(PROSE, "prose")] + [(t, "code") for t in texts] + [(t, "prose")
                                                                         for t in texts[:3]]:
    blocks = [b for b, _ in sections.split(text, kind)]
    assert len(blocks) > 3
    assert [t for ids in sp.encode(blocks) for t in ids] == sp.encode(text)

import numpy as np
from hypothesis import given, settings, strategies as st

from maxlm.data import chunk


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 3000), st.integers(16, 600), st.data())
def test_pieces_tile_the_document_and_fit(length, capacity, data):
  overlap = data.draw(st.integers(0, capacity // 2 - 2))
  bounds = np.array(sorted(data.draw(st.sets(st.integers(1, max(1, length - 1)), max_size=20))),
                    np.int32)
  levels = np.array(data.draw(st.lists(st.sampled_from([2, 1, -1, -2, -3]), min_size=len(bounds),
                                       max_size=len(bounds))), np.int8)
  pieces = chunk.cut(length, 0, length, bounds, levels, capacity, overlap, 0.5,
                     data.draw(st.integers(0, 40)))
  assert pieces[0][0] == 0 and pieces[-1][1] == length
  for (a, b, ctx), nxt in zip(pieces, pieces[1:] + [None]):
    assert b > a
    assert ctx == min(overlap, a)
    bos, eos = int(a == 0), int(b == length)
    assert bos + ctx + (b - a) + eos <= capacity
    if nxt is not None:
      assert nxt[0] == b


def test_prefers_section_then_paragraph_then_fixed():
  # room is 100 tokens; a section boundary at 70 beats a paragraph at 90
  pieces = chunk.cut(1000, 0, 1000, np.array([70, 90]), np.array([2, 1], np.int8), 101, 0, 0.5)
  assert pieces[0][1] == 70
  pieces = chunk.cut(1000, 0, 1000, np.array([30, 90]), np.array([2, 1], np.int8), 101, 0, 0.5)
  assert pieces[0][1] == 90  # the section at 30 keeps under half the room
  pieces = chunk.cut(1000, 0, 1000, np.array([30]), np.array([2], np.int8), 101, 0, 0.5)
  assert pieces[0][1] == 100  # BOS takes one of the 101 tokens


def test_overlap_becomes_context():
  pieces = chunk.cut(250, 0, 250, np.zeros(0, np.int32), np.zeros(0, np.int8), 101, 10, 0.5)
  assert [p[2] for p in pieces] == [0, 10, 10]
  assert all(b - a + int(a == 0) + ctx + int(b == 250) <= 101 for a, b, ctx in pieces)


def test_a_fine_boundary_beats_a_cut_inside_a_word():
  # room 100: no section or paragraph in the upper half; fine boundaries (line -1, word -3)
  pos, lvl = np.array([20, 80, 95, 97]), np.array([2, -1, -1, -3], np.int8)
  assert chunk.cut(1000, 0, 1000, pos, lvl, 101, 0, 0.5, slack=16)[0][1] == 95  # line > word
  assert chunk.cut(1000, 0, 1000, pos[:2], lvl[:2], 101, 0, 0.5, slack=16)[0][1] == 80
  # the only fine boundary is under the min_cut share: a cut where the room ends
  assert chunk.cut(1000, 0, 1000, pos[:1], lvl[:1], 101, 0, 0.5, slack=16)[0][1] == 100


def test_fill_end_takes_the_coarsest_within_the_slack_then_the_nearest():
  pos = np.array([40, 70, 84, 90, 96, 99])
  lvl = np.array([2, 1, 1, -2, -1, -3], np.int8)
  assert chunk.fill_end(0, 100, pos, lvl, 16) == (84, 1)  # a paragraph 16 back beats a word
  assert chunk.fill_end(0, 100, pos, lvl, 10) == (96, -1)  # within 10: a line beats a word
  assert chunk.fill_end(0, 100, pos, lvl, 0) == (100, None)  # nothing at 100 itself: in a word
  assert chunk.fill_end(0, 100, pos[:3], lvl[:3], 5) == (84, 1)  # none within 5: the nearest
  assert chunk.fill_end(0, 100, pos[:1], lvl[:1], 5) == (100, None)  # within 20: in a word
  assert chunk.fill_end(85, 100, pos[:3], lvl[:3], 16) == (100, None)  # never at or before pos

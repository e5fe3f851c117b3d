import numpy as np
from hypothesis import given, settings, strategies as st

from maxlm.data import chunk


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 3000), st.integers(16, 600), st.data())
def test_pieces_tile_the_document_and_fit(length, capacity, data):
  overlap = data.draw(st.integers(0, capacity // 2 - 2))
  bounds = np.array(sorted(data.draw(st.sets(st.integers(1, max(1, length - 1)), max_size=20))),
                    np.int32)
  levels = np.array(data.draw(st.lists(st.sampled_from([1, 2]), min_size=len(bounds),
                                       max_size=len(bounds))), np.int8)
  pieces = chunk.cut(length, 0, length, bounds, levels, capacity, overlap, 0.5)
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

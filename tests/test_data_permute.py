import numpy as np
from hypothesis import given, settings, strategies as st

from maxlm.data import permute


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 5000), seed=st.integers(0, 2**40), epoch=st.integers(0, 50),
       cut=st.integers(0, 5000))
def test_is_a_bijection_and_the_same_in_any_window(n, seed, epoch, cut):
  keys = permute.round_keys("pool", seed, "src", epoch)
  whole = permute.permute(n, keys, np.arange(n))
  assert np.array_equal(np.sort(whole), np.arange(n))
  cut = min(cut, n)
  parts = np.concatenate([permute.permute(n, keys, np.arange(0, cut)),
                          permute.permute(n, keys, np.arange(cut, n))])
  assert np.array_equal(parts, whole)


def test_matches_the_pinned_vectors():
  # A change here changes every batch of every run: it needs a new plan.VERSION.
  assert permute.permute(10, permute.round_keys("pool", 0, "src", 0),
                         np.arange(10)).tolist() == [2, 3, 9, 8, 0, 1, 6, 5, 7, 4]
  assert permute.permute(10**9, permute.round_keys("pool", 5, "web", 3),
                         [0, 1, 2, 999999999]).tolist() == [319543172, 464370919, 631644626,
                                                            323814812]


def test_keys_give_different_orders():
  orders = {tuple(permute.permute(1000, permute.round_keys("pool", 0, "src", e),
                                  np.arange(20)).tolist()) for e in range(20)}
  assert len(orders) == 20

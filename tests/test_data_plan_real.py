"""Packing on this machine's real text: tools/bench_packing.py's comparison, smaller.

Documents from the standard library, site-packages docs, man pages and /usr/share/doc go
through `maxlm prepare`; our plan's padding must be at most what Grain's BestFit leaves on the
same pieces (and on the same documents cut at L), and within the goals of docs/performance.md.
"""

import importlib.util
import pathlib

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def real_text(tmp_path_factory):
  spec = importlib.util.spec_from_file_location("bench_packing", ROOT / "tools" /
                                                "bench_packing.py")
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  data_dir = str(tmp_path_factory.mktemp("real_text") / "data")
  bench.prepared(data_dir, 300_000, vocab_size=1024)
  bench.ROUNDS = 1  # no timing here
  return bench, data_dir, {L: bench.compare(data_dir, L) for L in (1024, 4096)}


@pytest.mark.parametrize("L, goal", [(1024, 0.02), (4096, 0.01)])
def test_padding_is_at_most_grain_best_fit_on_the_same_pieces(real_text, L, goal):
  result, rows = real_text[2][L]
  ours = result["maxlm"]["padding"]
  assert ours <= goal, result["maxlm"]
  for inputs in ("pieces", "section_pieces", "docs"):
    assert ours <= result[f"grain_{inputs}_best_fit"]["padding"], (inputs, result)
  cuts = result["maxlm"]["cuts"]
  assert cuts.get("in_word", 0) <= 0.01 * sum(cuts.values()), cuts


def test_quotas_stay_within_a_piece_at_every_shuffle_window_end(real_text):
  bench, data_dir, compared = real_text
  from maxlm.data import store
  index = store.load_index(data_dir)
  quota = index.pool_tokens / index.pool_tokens.sum()
  _, rows = compared[1024]
  taken, largest = np.zeros(len(quota)), 1
  window = bench.DATA_SETTINGS["shuffle_rows"]  # rows are shuffled only within these
  for first in range(0, len(rows), window):
    for row in rows[first:first + window]:
      for _, body, _, doc, _, _ in row:
        taken[index.source[doc]] += body
        largest = max(largest, body)
    assert np.abs(taken - quota * taken.sum()).max() <= largest

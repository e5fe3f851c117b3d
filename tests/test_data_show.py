"""`maxlm show-batch`'s picture, read off the figure: padding white as docs/batch.md says,
every segment named by source and document, the legend matching the docs."""

import matplotlib.colors as mcolors
import numpy as np
import yaml

from maxlm import config as config_lib
from maxlm.data import loader, show

import datagen


def _batch_and_pieces(tmp_path):
  lengths = np.random.default_rng(0).integers(3, 30, 80)
  data_dir = datagen.write_data_dir(tmp_path / "data", datagen.make_docs(
      lengths, ["a" if i % 2 else "b" for i in range(len(lengths))]))
  cfg = config_lib.from_dict(yaml.safe_load(yaml.safe_dump({
      "data": {"dir": data_dir, "mix": {"a": 1, "b": 1}, "overlap": 4, "shuffle_rows": 2,
               "block_rows": 8},
      "stages": [{"seq_len": 96, "batch": 4, "steps": 4}]})))
  data = loader.Data(cfg)
  batch = loader.stage_dataset(data, 0)[1]
  return batch, data.provenance(data.global_batch_pieces(0, 1))


def test_padding_is_white_and_each_segment_is_named(tmp_path):
  batch, pieces = _batch_and_pieces(tmp_path)
  padded = [r for r in range(len(batch["segment_ids"])) if (batch["segment_ids"][r] == 0).any()]
  row = padded[0] if padded else show.busiest_row(batch)
  seg = batch["segment_ids"][row]
  fig = show.row_figure(batch, row, "t", pieces[row])
  image = fig.axes[0].get_images()[0].get_array()[0]  # [L, 3] RGB of the segment strip
  legend = fig.axes[1].get_legend()  # the axes under the strip holds its legend
  assert np.all(image[seg == 0] == 1.0)  # padding: white
  assert not np.any(np.all(image[seg > 0] == 1.0, axis=-1))  # pieces: never white
  for i in range(1, seg.max() + 1):  # one colour per piece, distinct from its neighbours
    assert len({tuple(c) for c in image[seg == i]}) == 1
  labels = [t.get_text() for t in legend.get_texts()]
  assert labels[0] == "padding (segment 0)"
  assert len(labels) == 1 + len(pieces[row]) == 1 + seg.max()
  for i, (label, piece) in enumerate(zip(labels[1:], pieces[row]), 1):
    assert label.startswith(f"{i}: {piece['source']}: {piece['doc_id']}, tokens "
                            f"{piece['start']}-{piece['end']}")
    color = legend.legend_handles[i].get_facecolor()
    assert np.allclose(mcolors.to_rgb(color), image[seg == i][0])
  out = tmp_path / "row.png"
  show.save_row_png(batch, row, str(out), "t", pieces[row])
  assert out.read_bytes()[:4] == b"\x89PNG"


def test_docs_describe_the_same_colours():
  import pathlib
  text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "batch.md").read_text()
  assert "white for padding" in text and "names its source and document" in text
  assert tuple(show.segment_colors(3)[0]) == show.PADDING_RGB == (1.0, 1.0, 1.0)

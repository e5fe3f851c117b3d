"""A picture of one batch row: segment ids, who-sees-whom, positions and the loss mask."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

_MAX_PIXELS = 512


def visibility(segment_ids):
  """[L, L] bool: i sees j iff j <= i and segment_ids[i] == segment_ids[j] != 0."""
  seg = np.asarray(segment_ids)
  same = (seg[:, None] == seg[None, :]) & (seg[:, None] != 0)
  return same & np.tri(len(seg), dtype=bool)


def busiest_row(batch):
  """The row holding the most segments (the most instructive one to look at)."""
  return int(np.argmax(batch["segment_ids"].max(axis=1)))


def save_row_png(batch, row, path, title=""):
  seg = batch["segment_ids"][row]
  L = len(seg)
  stride = max(1, -(-L // _MAX_PIXELS))
  vis = visibility(seg)
  if stride > 1:  # a block is shown visible if any pair inside it is
    n = -(-L // stride)
    padded = np.zeros((n * stride, n * stride), bool)
    padded[:L, :L] = vis
    vis = padded.reshape(n, stride, n, stride).any(axis=(1, 3))
  fig, axes = plt.subplots(4, 1, figsize=(10, 12), height_ratios=[1, 1, 1, 8])
  x = np.arange(L)
  axes[0].imshow(seg[None, :], aspect="auto", cmap="tab20", interpolation="nearest")
  axes[0].set_ylabel("segment")
  axes[1].plot(x, batch["positions"][row], lw=0.8)
  axes[1].set_ylabel("position")
  axes[1].set_xlim(0, L - 1)
  axes[2].imshow(batch["loss_mask"][row][None, :], aspect="auto", cmap="Greys", vmin=0,
                 vmax=1, interpolation="nearest")
  axes[2].set_ylabel("loss\n(black: 1)")
  axes[3].imshow(vis, cmap="Blues", interpolation="nearest",
                 extent=(0, L, L, 0))
  axes[3].set_xlabel("key position j")
  axes[3].set_ylabel("query position i  (dark: i sees j)")
  for ax in axes[[0, 2]]:
    ax.set_yticks([])
  n_docs, loss = int(seg.max()), int(batch["loss_mask"][row].sum())
  fig.suptitle(f"{title}  row {row}: {n_docs} segments, {int((seg > 0).sum())}/{L} "
               f"positions used, {loss} count toward the loss")
  fig.tight_layout()
  fig.savefig(path, dpi=80)
  plt.close(fig)

"""A picture of one batch row, drawn as docs/batch.md describes it: the segments (one colour
per piece, padding white, each numbered and named by source and document), positions, the loss
mask and who-sees-whom."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.patches as mpatches  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

_MAX_PIXELS = 512
_MAX_NAMED = 24  # pieces named in the legend; the rest are counted
_MAX_ID = 70  # characters of a document id shown
PADDING_RGB = (1.0, 1.0, 1.0)


def visibility(segment_ids):
  """[L, L] bool: i sees j iff j <= i and segment_ids[i] == segment_ids[j] != 0."""
  seg = np.asarray(segment_ids)
  same = (seg[:, None] == seg[None, :]) & (seg[:, None] != 0)
  return same & np.tri(len(seg), dtype=bool)


def busiest_row(batch):
  """The row holding the most segments (the most instructive one to look at)."""
  return int(np.argmax(batch["segment_ids"].max(axis=1)))


def segment_colors(n):
  """RGB per segment id 0..n: white for padding (0), then tab20's colours in turn."""
  tab = plt.get_cmap("tab20").colors
  return np.array([PADDING_RGB] + [tab[(i - 1) % len(tab)] for i in range(1, n + 1)])


def piece_label(piece):
  """'prose: doc-12, tokens 0-118 (+16 context, FIM psm)' from a provenance dict."""
  extra = []
  if piece.get("context"):
    extra.append(f"+{piece['context']} context")
  if piece.get("fim") not in (None, "none", 0):
    extra.append(f"FIM {piece['fim']}")
  if piece.get("role"):
    extra.append(f"pair, {piece['role']}")
  more = f" ({', '.join(extra)})" if extra else ""
  doc = str(piece["doc_id"])
  doc = doc if len(doc) <= _MAX_ID else "..." + doc[-(_MAX_ID - 3):]  # a path's end names it
  return f"{piece['source']}: {doc}, tokens {piece['start']}-{piece['end']}{more}"


def row_figure(batch, row, title="", pieces=None):
  """The figure of one row; `pieces`: the row's provenance dicts (source, doc_id, start, end,
  context, fim), in segment order, to name each segment (a preference pair's piece names its
  two segments, chosen then rejected)."""
  pieces = None if pieces is None else [
      dict(p, role=r) for p in pieces for r in (("chosen", "rejected") if p.get("pair") else
                                                (None,))]
  seg = np.asarray(batch["segment_ids"][row])
  L, n = len(seg), int(seg.max())
  colors = segment_colors(n)
  stride = max(1, -(-L // _MAX_PIXELS))
  vis = visibility(seg)
  if stride > 1:  # a block is shown visible if any pair inside it is
    m = -(-L // stride)
    padded = np.zeros((m * stride, m * stride), bool)
    padded[:L, :L] = vis
    vis = padded.reshape(m, stride, m, stride).any(axis=(1, 3))
  named = min(len(pieces or []), _MAX_NAMED) + 2
  fig, axes = plt.subplots(5, 1, figsize=(11, 13 + 0.17 * named),
                           height_ratios=[1, 0.17 * named, 1, 1, 8])
  legend_ax, axes = axes[1], axes[[0, 2, 3, 4]]
  legend_ax.axis("off")
  x = np.arange(L)
  axes[0].imshow(colors[seg][None, :, :], aspect="auto", interpolation="nearest",
                 extent=(-0.5, L - 0.5, 1, 0))
  for i in range(1, n + 1):
    at = np.flatnonzero(seg == i)
    if len(at) >= L / 60:  # wide enough to carry its number
      role = {1: "c", 2: "r"}.get(int(batch["roles"][row][at[0]]), "") if "roles" in batch else ""
      axes[0].text(at.mean(), 0.5, f"{i}{role}", ha="center", va="center", fontsize=7)
  axes[0].set_ylabel("segment")
  handles = [mpatches.Patch(facecolor=PADDING_RGB, edgecolor="black", lw=0.5,
                            label="padding (segment 0)")]
  for i, piece in enumerate((pieces or [])[:_MAX_NAMED], 1):
    handles.append(mpatches.Patch(color=colors[i], label=f"{i}: {piece_label(piece)}"))
  if pieces and len(pieces) > _MAX_NAMED:
    handles.append(mpatches.Patch(color="none", label=f"... {len(pieces) - _MAX_NAMED} more "
                                  "(maxlm batches writes them all)"))
  legend_ax.legend(handles=handles, fontsize=8, loc="upper left", borderaxespad=0,
                   title="segments (legend)", title_fontsize=8, alignment="left", frameon=False)
  axes[1].plot(x, batch["positions"][row], lw=0.8)
  axes[1].set_ylabel("position")
  axes[1].set_xlim(-0.5, L - 0.5)
  axes[2].imshow(batch["loss_mask"][row][None, :], aspect="auto", cmap="Greys", vmin=0,
                 vmax=1, interpolation="nearest", extent=(-0.5, L - 0.5, 1, 0))
  axes[2].set_ylabel("loss\n(black: 1)")
  axes[3].imshow(vis, cmap="Blues", interpolation="nearest", extent=(0, L, L, 0))
  axes[3].set_xlabel("key position j")
  axes[3].set_ylabel("query position i  (dark: i sees j)")
  for ax in axes[[0, 2]]:
    ax.set_yticks([])
  loss = int(batch["loss_mask"][row].sum())
  fig.suptitle(f"{title}  row {row}: {n} segments, {int((seg > 0).sum())}/{L} "
               f"positions used, {loss} count toward the loss")
  fig.tight_layout()
  return fig


def save_row_png(batch, row, path, title="", pieces=None):
  fig = row_figure(batch, row, title, pieces)
  fig.savefig(path, dpi=80, bbox_inches="tight")
  plt.close(fig)

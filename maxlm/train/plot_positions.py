"""`maxlm plot`'s loss-by-position panel: held-out loss against log position, one curve per
stage (its last evaluation), all sources pooled by their tokens in each bucket
(maxlm/eval/positions.py). After a longer stage the curve should fall beyond the old length."""

import math

from maxlm.eval import positions

TITLE = "held-out loss by position (last evaluation of each stage)"


def present(rows):
  """Whether any row holds loss by position."""
  return any(k.startswith("val_pos_loss/") for r in rows for k in r)


def curves(rows):
  """{stage: [(bucket start, bucket end, loss)]} from each stage's last evaluation, sources
  pooled: sum(loss x tokens) / sum(tokens) per bucket."""
  last = {}
  for r in rows:
    if any(k.startswith("val_pos_loss/") for k in r):
      last[r.get("stage", 0)] = r
  out = {}
  for stage, r in sorted(last.items()):
    pooled = {}
    for source, cells in positions.from_metrics(r).items():
      for bucket, loss in cells.items():
        n = r.get(f"val_pos_tokens/{source}/{bucket}", 0)
        acc = pooled.setdefault(bucket, [0.0, 0])
        acc[0] += loss * n
        acc[1] += n
    points = sorted((*map(int, b.split("-")), s / n) for b, (s, n) in pooled.items() if n)
    out[stage] = points
  return out


def draw(ax, rows, labels):
  """One line per stage at each bucket's geometric middle (the first bucket's at its end / 2)."""
  ax.set_title(TITLE, fontsize=9, loc="left")
  ax.grid(alpha=0.3)
  for stage, points in curves(rows).items():
    xs = [math.sqrt(max(a, 1) * b) if a else b / 2 for a, b, _ in points]
    ax.plot(xs, [p[2] for p in points], "o-", lw=1.2, ms=3,
            label=labels.get(stage, f"stage {stage}"))
  ax.set_xscale("log")
  ax.set_xlabel("tokens of context (position in the document)")
  ax.legend(fontsize=7, loc="best")

"""`maxlm plot RUN_DIR`: the seven curves of a run as one PNG."""

import io as io_lib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from maxlm import MaxlmError, io  # noqa: E402
from maxlm.train import metrics  # noqa: E402

CURVES = ("loss", "val_loss", "lr", "grad_norm", "param_norm", "max_logit", "tokens_per_s")


def save(run_dir, out):
  rows = metrics.read_jsonl(run_dir)
  if not rows:
    raise MaxlmError(f"{run_dir} has no metrics.jsonl yet; run `maxlm train` first")
  latest = {}
  for row in rows:  # a resumed run rewrites steps: keep the last value of each
    latest[row["step"]] = row
  steps = sorted(latest)
  fig, axes = plt.subplots(len(CURVES), 1, figsize=(9, 2.2 * len(CURVES)), sharex=True)
  for ax, name in zip(axes, CURVES):
    xs = [s for s in steps if name in latest[s]]
    ax.plot(xs, [latest[s][name] for s in xs], marker="o" if name == "val_loss" else None,
            lw=1)
    ax.set_ylabel(name)
    ax.grid(alpha=0.3)
    for s in steps[1:]:
      if latest[s].get("stage") != latest[s - 1 if s - 1 in latest else s].get("stage"):
        ax.axvline(s, color="grey", ls="--", lw=0.7)
  axes[-1].set_xlabel("step (dashed: stage boundaries)")
  fig.suptitle(run_dir)
  fig.tight_layout()
  png = io_lib.BytesIO()
  fig.savefig(png, format="png", dpi=80)
  plt.close(fig)
  io.write_bytes(out, png.getvalue())  # a local path or gs://

"""`maxlm plot RUN_DIR`: a run's curves as one PNG, from metrics.jsonl (and config.yaml for
the stage names).

Panels, top to bottom: training loss (the raw per-step line faint, an exponential moving
average over ~`smoothing_span` steps on top; the average restarts at each stage, whose length
change moves the loss; red crosses on the steps training flagged as spikes, which
`maxlm trace RUN_DIR --step K` takes apart), held-out loss and bits per byte (all sources, and
one curve per source across the stages from its `val_loss/<source>` / `val_bpb/<source>` keys:
every evaluation scores the same text, maxlm/eval/bpb.py; a source with under
bpb.SMALL_TOKENS tokens held out is flagged in the legend), learning rate, gradient and
parameter norms, the largest attention logit, and MFU with tokens/s; then, when the run has
them, the GRPO reward and the passkey accuracy per prompt length (train.eval_passkey: a
model that reads its context climbs towards 1); last, when evaluations
logged it, held-out loss against log position, one curve per stage
(maxlm/train/plot_positions.py). Dashed lines mark stage boundaries, labelled with the stage's
name (or index) and L. A resumed run logs recomputed
steps again: the last row of each step wins. The first step a process runs in a stage includes
compiling it, so its MFU and tokens/s are left out of their panel (found in file order: a step
that does not follow the previous row's step in the same stage).
"""

import io as io_lib
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import yaml  # noqa: E402

from maxlm import MaxlmError, io  # noqa: E402
from maxlm.data import plan  # noqa: E402
from maxlm.eval import bpb  # noqa: E402
from maxlm.train import metrics, plot_positions  # noqa: E402

PANELS = ("loss", "val_loss", "val_bpb", "lr", "norms", "max_logit", "mfu")
TITLES = {"loss": "training loss", "val_loss": "held-out loss per token",
          "val_bpb": "held-out bits per byte", "lr": "learning rate",
          "norms": "gradient and parameter norm", "max_logit": "largest attention logit",
          "mfu": "MFU and tokens/s",
          "reward": "GRPO reward (mean over rollouts) and held-out pass@1",
          "passkey": "retrieval accuracy (passkey, multikey, vartrack) by prompt length, mean "
                     "over depths"}
RETRIEVAL = ("passkey", "multikey", "vartrack")  # train.eval_passkey.tasks' metrics


def smoothing_span(n_steps):
  """Steps an EMA averages over: ~1/10 of the run, between 1 and 200."""
  return max(1, min(200, n_steps // 10))


def ema(values, span):
  """Bias-corrected exponential moving average (alpha = 2 / (span + 1)); NaNs are skipped."""
  alpha, acc, weight, out = 2 / (span + 1), 0.0, 0.0, []
  for v in values:
    if math.isfinite(v):
      acc = (1 - alpha) * acc + alpha * v
      weight = (1 - alpha) * weight + alpha
    out.append(acc / weight if weight else float("nan"))
  return out


def stage_labels(run_dir):
  """{stage index: 'name (L=...)'} from run_dir/config.yaml, or {} if it cannot be read."""
  try:
    raw = yaml.safe_load(io.read_bytes(io.join(run_dir, "config.yaml")))
    return {i: f"{st.get('name') or f'stage {i}'} (L={st['seq_len']})"
            for i, st in enumerate(raw["stages"])}
  except Exception:  # a missing or foreign config only costs the labels
    return {}


def untrained(run_dir, sources):
  """The sources no stage of the run's config.yaml trains on (maxlm/data/plan.py), or []."""
  try:
    raw = yaml.safe_load(io.read_bytes(io.join(run_dir, "config.yaml")))
    mixes = [st.get("mix") or raw.get("data", {}).get("mix") or {} for st in raw["stages"]]
  except Exception:  # a missing or foreign config only costs the marks
    return []
  return plan.unmixed(mixes, sources)


def step_rows(rows):
  """The step rows (not events), the last of each step, sorted; a row that compiled (the
  first of its stage in its process) is marked `compiled`."""
  latest, previous = {}, None
  for row in rows:  # a resumed run rewrites steps: keep the last value of each
    if "loss" in row and "step" in row:  # other rows (events) are not steps
      follows = previous is not None and (previous["step"], previous.get("stage")) == (
          row["step"] - 1, row.get("stage"))
      latest[row["step"]] = {**row, "compiled": not follows}
      previous = row
  return [latest[s] for s in sorted(latest)]


def figure(rows, labels=None, title="", untrained=()):
  """The matplotlib figure of these metrics rows (one axes per name in PANELS); the sources in
  `untrained` are marked so in the legends."""
  rows = step_rows(rows)
  labels = labels or {}
  extra = plot_positions.present(rows)  # its own x axis (position): not shared
  passkey_keys = sorted({k for r in rows for k in r if k.count("/") == 1
                         and k.split("/")[0] in RETRIEVAL},
                        key=lambda k: (k.split("/")[0], int(k.split("/")[1])))
  panels = (PANELS + (("reward",) if any("reward_mean" in r for r in rows) else ())
            + (("passkey",) if passkey_keys else ()))
  fig, axes = plt.subplots(len(panels) + extra, 1, figsize=(10, 2.4 * (len(panels) + extra)))
  if extra:
    plot_positions.draw(axes[-1], rows, labels)
    axes = axes[:-1]
  for ax in axes[:-1]:
    ax.sharex(axes[-1])
    ax.tick_params(labelbottom=False)
  ax_of = dict(zip(panels, axes))
  for name, ax in ax_of.items():
    ax.set_title(TITLES[name], fontsize=9, loc="left")
    ax.grid(alpha=0.3)
  _loss(ax_of["loss"], rows)
  for name in ("val_loss", "val_bpb"):
    _per_source(ax_of[name], rows, name, untrained)
  _lines(ax_of["lr"], rows, ("lr",))
  _lines(ax_of["norms"], rows, ("grad_norm", "param_norm"))
  ax_of["norms"].set_yscale("log")
  _lines(ax_of["max_logit"], rows, ("max_logit",))
  _mfu(ax_of["mfu"], rows)
  if "reward" in ax_of:  # a GRPO stage (maxlm/train/grpo.py)
    _lines(ax_of["reward"], rows, ("reward_mean", "eval_pass@1"))
  if "passkey" in ax_of:  # train.eval_passkey (maxlm/eval/passkey.py)
    _lines(ax_of["passkey"], rows, passkey_keys)
    ax_of["passkey"].set_ylim(-0.05, 1.05)
  _stage_lines(axes, rows, labels)
  axes[-1].set_xlabel("step")
  fig.suptitle(title)
  fig.tight_layout()
  return fig


def _series(rows, key, scale=1.0, steady=False):
  pts = [(r["step"], r[key] * scale) for r in rows if isinstance(r.get(key), (int, float))
         and not (steady and r.get("compiled"))]
  return [p[0] for p in pts], [p[1] for p in pts]


def _lines(ax, rows, keys):
  for key in keys:
    xs, ys = _series(rows, key)
    if xs:
      ax.plot(xs, ys, lw=1, label=key)
  if len(keys) > 1:
    ax.legend(fontsize=7, loc="upper right")


def _loss(ax, rows):
  xs, ys = _series(rows, "loss")
  ax.plot(xs, ys, lw=0.8, alpha=0.3, color="tab:blue", label="loss (per step)")
  span = smoothing_span(len(xs))
  smooth = []
  for stage in sorted({r.get("stage", 0) for r in rows}):  # restart at each stage
    part = [r["loss"] for r in rows if r.get("stage", 0) == stage]
    smooth += ema(part, span)
  ax.plot(xs, smooth, lw=1.6, color="tab:blue", label=f"EMA over ~{span} steps")
  spikes = [(r["step"], r["loss"]) for r in rows if r.get("spike")]
  if spikes:
    ax.plot(*zip(*spikes), "x", color="tab:red", ms=7, label="spike (maxlm trace --spikes)")
  ax.legend(fontsize=7, loc="lower left")  # the stage names are along the top


def _per_source(ax, rows, name, untrained):
  xs, ys = _series(rows, name)
  if xs:
    ax.plot(xs, ys, "o-", color="black", lw=1.4, ms=3, label="all sources")
  sources = sorted({k.split("/", 1)[1] for r in rows for k in r if k.startswith(name + "/")})
  for source in sources:
    xs, ys = _series(rows, f"{name}/{source}")
    ax.plot(xs, ys, "o--", lw=1, ms=2.5, label=source_label(rows, source, untrained))
  if xs or sources:  # beside the panel, not over its curves
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
  else:
    ax.text(0.5, 0.5, "not evaluated yet (train.eval_every)", transform=ax.transAxes,
            ha="center", va="center", color="grey")


def source_label(rows, source, untrained=()):
  """A source's legend entry: its name, flagged when its held-out set is small (under
  bpb.SMALL_TOKENS tokens scored: a noisy curve), when evaluations scored different text
  (runs from before every evaluation scored the same documents), or when no stage's mix
  names it (not trained on)."""
  tokens = [r[f"val_tokens/{source}"] for r in rows if f"val_tokens/{source}" in r]
  label = source
  if tokens and tokens[-1] < bpb.SMALL_TOKENS:
    label += f" (small: {tokens[-1]:,} tokens)"
  if len(set(tokens)) > 1:
    label += " (scored text changed)"
  if source in untrained:
    label += " (not trained on)"
  return label


def _mfu(ax, rows):
  xs, ys = _series(rows, "mfu", 100, steady=True)
  ax.plot(xs, ys, lw=1, color="tab:green", label="MFU %")
  ax.set_ylabel("MFU %")
  twin = ax.twinx()
  xs, ys = _series(rows, "tokens_per_s", steady=True)
  twin.plot(xs, ys, lw=0.8, alpha=0.5, color="tab:orange", label="tokens/s")
  twin.set_ylabel("tokens/s")
  handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
  ax.legend(handles, [h.get_label() for h in handles], fontsize=7, loc="upper right")


def _stage_lines(axes, rows, labels):
  first = {}
  for r in rows:
    first.setdefault(r.get("stage", 0), r["step"])
  for stage, step in sorted(first.items()):
    label = labels.get(stage, f"stage {stage}")
    for ax in axes:
      if stage != min(first):
        ax.axvline(step - 0.5, color="grey", ls="--", lw=0.7)
    axes[0].text(step, 0.96, " " + label, transform=axes[0].get_xaxis_transform(), fontsize=8,
                 color="dimgrey", va="top")


def save(run_dir, out):
  rows = metrics.read_jsonl(run_dir)
  if not step_rows(rows):
    raise MaxlmError(f"{run_dir} has no metrics.jsonl yet; run `maxlm train` first")
  sources = sorted({k.split("/", 1)[1] for r in rows for k in r if k.startswith("val_loss/")})
  fig = figure(rows, stage_labels(run_dir), run_dir, untrained(run_dir, sources))
  png = io_lib.BytesIO()
  fig.savefig(png, format="png", dpi=80)
  plt.close(fig)
  io.write_bytes(out, png.getvalue())  # a local path or gs://

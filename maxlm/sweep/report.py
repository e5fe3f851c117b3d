"""What a sweep leaves behind: the printed tables, sweep.json, isoflop.png, recommended.yaml."""

import json
import math
import os

import numpy as np
import yaml

from maxlm import outputs
from maxlm.sweep import fit, grid, runner

N_CONVENTION = ("N counts every parameter, embeddings included (Chinchilla's convention); "
                "D = C / (6 N) training tokens per point; for a mixture of experts N counts "
                "the ACTIVE parameters (router, top_k routed and shared experts of each MoE "
                "layer), as FLOPs do")


def point_rows(points):
  rows = []
  for p in points:
    r = p.result() or {}
    rows.append({"budget": p.budget, "size": p.shape.label, "n_params": p.n_params,
                 "tokens": p.tokens, "steps": p.steps, "flops": 6 * p.n_params * p.tokens,
                 "epochs": p.epochs, "val_loss": r.get("val_loss", float("nan")),
                 "val_bpb": r.get("val_bpb", float("nan")), "run_dir": p.run_dir})
  return rows


def warnings(rows):
  return [f"{r['size']} at {r['budget']:.3g} FLOPs repeats the data {r['epochs']:.1f} times "
          f"(beyond {fit.MAX_EPOCHS_USEFUL} epochs extra tokens are worth little; its loss "
          f"understates what fresh data would give)" for r in rows
          if r["epochs"] > fit.MAX_EPOCHS_USEFUL]


def tables(rows, fitted, exponents, recommendation, target):
  lines = [N_CONVENTION, "",
           f"{'budget':>9} {'size':>10} {'N':>11} {'D':>12} {'epochs':>7} {'val_loss':>9} "
           f"{'val_bpb':>8}"]
  for r in rows:
    lines.append(f"{r['budget']:>9.3g} {r['size']:>10} {r['n_params']:>11,} {r['tokens']:>12,} "
                 f"{r['epochs']:>7.2f} {r['val_loss']:>9.4f} {r['val_bpb']:>8.3f}")
  lines += ["", f"{'budget':>9} {'N_opt':>11} {'D_opt':>12} {'D/N':>7} {'L_min':>8}  fit"]
  for f in fitted:
    if f["n_opt"]:
      lines.append(f"{f['budget']:>9.3g} {f['n_opt']:>11,.0f} {f['d_opt']:>12,.0f} "
                   f"{f['d_opt'] / f['n_opt']:>7.1f} {f['loss_min']:>8.4f}  {f['status']}")
    else:
      why = f["status"]
      if why == "at_edge":
        way = "smaller" if f["edge"] == "smallest" else "larger"
        why += f": the best point is the {f['edge']} size (N={f['best']:,.0f}); add {way} sizes"
      lines.append(f"{f['budget']:>9.3g} {'-':>11} {'-':>12} {'-':>7} {'-':>8}  {why}")
  if exponents["a"] is not None:
    lines.append(f"\nN_opt ~ C^{exponents['a']:.3f}, D_opt ~ C^{exponents['b']:.3f} "
                 f"(from {exponents['budgets_fitted']} budgets)")
  if recommendation:
    lines.append(f"\nfor {target:.3g} FLOPs: N = {recommendation['n_params']:,.0f}, D = "
                 f"{recommendation['tokens']:,.0f} tokens; {recommendation['rule']}")
  return "\n".join(lines)


def write_json(out, rows, fitted, exponents, recommendation, target):
  body = {"convention": N_CONVENTION, "points": rows, "fits": fitted, "exponents": exponents,
          "target_flops": target, "recommendation": recommendation}
  with outputs.writing(os.path.join(out, "sweep.json")) as tmp, open(tmp, "w") as f:
    f.write(json.dumps(body, indent=1, allow_nan=True) + "\n")


def write_recommended(out, raw, recommendation, vocab, tied, per_step, target, model=None):
  """A runnable config: the ladder shape nearest to the recommended N, D in whole steps.
  model: the base config's model section (an MoE model's N is its active parameters)."""
  if not recommendation:
    return None
  count = lambda s: grid.n_params(s, vocab, tied, model, active=True)  # noqa: E731
  shape = min(grid.ladder(), key=lambda s: abs(math.log(count(s))
                                               - math.log(recommendation["n_params"])))
  n = count(shape)
  steps = max(1, round(target / (6 * n) / per_step))
  if recommendation["rule"].startswith("data-limited"):
    steps = max(1, round(recommendation["tokens"] / per_step))
  cfg = runner._point_config(raw, shape, steps, os.path.join(out, "recommended"), None,
                             None)
  cfg["stages"][0]["name"] = "recommended"
  cfg["train"]["eval_every"] = max(1, steps // 10)
  cfg["train"]["checkpoint_every"] = raw["train"]["checkpoint_every"]
  header = (f"# maxlm sweep's recommendation for {target:.3g} FLOPs: {shape.label}, "
            f"N = {n:,} ({N_CONVENTION.split(';')[0]}),\n# D = {steps * per_step:,} tokens "
            f"in {steps} steps; {recommendation['rule']}.\n# Run: maxlm train "
            f"{os.path.join(out, 'recommended.yaml')}\n")
  path = os.path.join(out, "recommended.yaml")
  with outputs.writing(path) as tmp, open(tmp, "w") as f:
    f.write(header + yaml.safe_dump(cfg, sort_keys=False))
  return path


def write_png(out, rows, fitted, exponents, target):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
  colors = plt.cm.viridis(np.linspace(0, 0.85, max(len(fitted), 1)))
  for color, f in zip(colors, fitted):
    pts = [r for r in rows if r["budget"] == f["budget"] and math.isfinite(r["val_loss"])]
    n = np.array([r["n_params"] for r in pts], float)
    loss = np.array([r["val_loss"] for r in pts])
    left.plot(n, loss, "o", color=color, label=f"C = {f['budget']:.3g}")
    if f.get("coef_ln_n"):
      xs = np.linspace(*np.log(f["fitted_n"]), 100)
      left.plot(np.exp(xs), np.polyval(f["coef_ln_n"], xs), "-", color=color, alpha=0.7)
    if f["n_opt"]:
      left.plot([f["n_opt"]], [f["loss_min"]], "*", color=color, markersize=14,
                markeredgecolor="black")
  left.set(xscale="log", xlabel="N (parameters, embeddings included)",
           ylabel="held-out loss (nats/token)", title="iso-FLOP curves (star: fitted optimum)")
  left.legend()
  good = [f for f in fitted if f["n_opt"]]
  if good:
    right.plot([f["budget"] for f in good], [f["n_opt"] for f in good], "o", label="N_opt")
    right.plot([f["budget"] for f in good], [f["d_opt"] for f in good], "s", label="D_opt")
  if exponents["a"] is not None:
    cs = np.geomspace(min(f["budget"] for f in good), target, 50)
    right.plot(cs, np.exp(exponents["ln_n_prefactor"]) * cs ** exponents["a"], "-",
               label=f"N_opt ~ C^{exponents['a']:.2f}")
    right.plot(cs, np.exp(exponents["ln_d_prefactor"]) * cs ** exponents["b"], "--",
               label=f"D_opt ~ C^{exponents['b']:.2f}")
    right.axvline(target, color="gray", linestyle=":", label=f"target {target:.3g}")
  right.set(xscale="log", yscale="log", xlabel="C (training FLOPs)",
            ylabel="parameters / tokens", title="compute-optimal size")
  if good:
    right.legend()
  else:
    right.text(0.5, 0.5, "no budget has an optimum inside its sizes", ha="center",
               transform=right.transAxes)
  fig.tight_layout()
  path = os.path.join(out, "isoflop.png")
  try:
    with outputs.writing(path) as tmp:
      fig.savefig(tmp, dpi=100)
  finally:
    plt.close(fig)
  return path

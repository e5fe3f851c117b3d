"""The fits of an iso-FLOP sweep, and the size it recommends for a target budget.

Per budget C, the final held-out loss L(N) of the points is fitted by a parabola in ln N
(least squares); its vertex gives N_opt(C) and L_min(C), and D_opt(C) = C / (6 N_opt). A fit
whose parabola opens downwards has no optimum; one whose vertex lies outside the sizes swept
is extrapolated: both are reported, not hidden. Across the budgets with an optimum,
ln N_opt = a ln C + c and ln D_opt = b ln C + c' (so a + b = 1 up to rounding).

The recommendation for a target budget C_T follows the data, not the compute alone: with U
unique training tokens, the compute-optimal D_T = C_T / (6 N_T) is used if D_T <= 3 U;
otherwise D = 3 U (repeating data beyond about four epochs is nearly worthless; Muennighoff
et al., 2023) and N = C_T / (6 D), the larger model that spends the budget on that D.
"""

import math

import numpy as np

MAX_EPOCHS_USEFUL = 4
DATA_LIMITED_EPOCHS = 3


def parabola(sizes, losses):
  """{n_opt, loss_min, status} for one budget: status is ok, extrapolated or no_minimum."""
  x = np.log(np.asarray(sizes, np.float64))
  y = np.asarray(losses, np.float64)
  keep = np.isfinite(y)
  x, y = x[keep], y[keep]
  if len(x) < 3:
    return {"n_opt": None, "loss_min": None, "status": "too_few_points"}
  p2, p1, p0 = np.polyfit(x, y, 2)
  if not p2 > 0:
    return {"n_opt": None, "loss_min": None, "status": "no_minimum"}
  vertex = -p1 / (2 * p2)
  status = "ok" if x.min() <= vertex <= x.max() else "extrapolated"
  return {"n_opt": float(math.exp(vertex)), "loss_min": float(p0 - p1 * p1 / (4 * p2)),
          "status": status}


def power_law(budgets, values):
  """(exponent, ln prefactor) of values = exp(c) * budgets^exponent, or (None, None)."""
  if len(budgets) < 2:
    return None, None
  slope, intercept = np.polyfit(np.log(budgets), np.log(values), 1)
  return float(slope), float(intercept)


def fits(points):
  """(fits per budget, exponents) from point dicts with budget, n_params, val_loss."""
  by_budget = {}
  for p in points:
    by_budget.setdefault(p["budget"], []).append(p)
  out = []
  for budget in sorted(by_budget):
    row = by_budget[budget]
    f = parabola([p["n_params"] for p in row], [p["val_loss"] for p in row])
    f.update(budget=budget, d_opt=budget / (6 * f["n_opt"]) if f["n_opt"] else None)
    out.append(f)
  good = [f for f in out if f["status"] in ("ok", "extrapolated")]
  a, c_n = power_law([f["budget"] for f in good], [f["n_opt"] for f in good])
  b, c_d = power_law([f["budget"] for f in good], [f["d_opt"] for f in good])
  return out, {"a": a, "b": b, "ln_n_prefactor": c_n, "ln_d_prefactor": c_d,
               "budgets_fitted": len(good)}


def recommend(target, exponents, fitted, unique_tokens, points=()):
  """{n_params, tokens, epochs, rule} for a target budget (the module docstring's rule);
  points (with budget, size, n_params, tokens, val_loss) serve when no budget has an optimum."""
  if exponents["a"] is not None:
    n = math.exp(exponents["ln_n_prefactor"]) * target ** exponents["a"]
    rule = "compute-optimal (N_opt ~ C^a from the fits)"
  else:
    good = [f for f in fitted if f["n_opt"]]
    if good:  # one usable budget: keep its tokens per parameter
      best = good[-1]
      ratio = best["d_opt"] / best["n_opt"]
      rule = f"compute-optimal (D/N of the one fitted budget, {best['budget']:.3g})"
    else:
      finite = [p for p in points if math.isfinite(p["val_loss"])]
      if not finite:
        return None
      top = max(p["budget"] for p in finite)
      best = min((p for p in finite if p["budget"] == top), key=lambda p: p["val_loss"])
      ratio = best["tokens"] / best["n_params"]
      rule = (f"no budget has an optimum inside its sizes, so the D/N of the best point "
              f"({best['size']} at {top:.3g}) is kept: widen --sizes")
    n = math.sqrt(target / ratio / 6)
  d = target / (6 * n)
  if unique_tokens and d > DATA_LIMITED_EPOCHS * unique_tokens:
    d = DATA_LIMITED_EPOCHS * unique_tokens
    n = target / (6 * d)
    rule = (f"data-limited: D = {DATA_LIMITED_EPOCHS} epochs of the {unique_tokens:,} unique "
            f"training tokens, and the larger model that spends the budget on it")
  return {"n_params": n, "tokens": d, "epochs": d / unique_tokens if unique_tokens else None,
          "rule": rule}

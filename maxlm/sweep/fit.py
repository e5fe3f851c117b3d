"""The fits of an iso-FLOP sweep, and the size it recommends for a target budget.

Per budget C, the final held-out loss L(N) is fitted by a parabola in ln N (least squares)
through the best point and the points within half a decade of N around it (its neighbours at
least); the vertex gives N_opt(C) and L_min(C), and D_opt(C) = C / (6 N_opt). Only the
neighbourhood is fitted because L(ln N) is a parabola near its minimum, not across two
decades: the curve rises more steeply towards large N, so far points drag the vertex. The
status of a fit says how far to trust it:
  ok         the best point is inside the sizes and the vertex lies among the points fitted;
  at_edge    the best point is the smallest or largest size: the optimum is beyond the sizes
             tried (no N_opt; the sweep says which way to widen --sizes);
  extrapolated / no_minimum   the vertex lies outside the points fitted / the fit opens down.
Across the budgets whose fit is ok, ln N_opt = a ln C + c and ln D_opt = b ln C + c' (so
a + b = 1 up to rounding).

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
  """{n_opt, loss_min, status, best} for one budget (statuses in the module docstring)."""
  n = np.asarray(sizes, np.float64)
  y = np.asarray(losses, np.float64)
  keep = np.isfinite(y)
  n, y = n[keep], y[keep]
  none = {"n_opt": None, "loss_min": None}
  if len(n) < 3:
    return {**none, "status": "too_few_points", "best": None}
  order = np.argsort(n)
  n, y = n[order], y[order]
  best = int(np.argmin(y))
  if best in (0, len(n) - 1):
    return {**none, "status": "at_edge", "best": float(n[best]),
            "edge": "smallest" if best == 0 else "largest"}
  x = np.log(n)
  near = np.abs(x - x[best]) <= math.log(10) / 2
  near[best - 1:best + 2] = True  # the neighbours at least, however far
  p2, p1, p0 = np.polyfit(x[near], y[near], 2)
  if not p2 > 0:
    return {**none, "status": "no_minimum", "best": float(n[best])}
  vertex = -p1 / (2 * p2)
  status = "ok" if x[near].min() <= vertex <= x[near].max() else "extrapolated"
  return {"n_opt": float(math.exp(vertex)), "loss_min": float(p0 - p1 * p1 / (4 * p2)),
          "status": status, "best": float(n[best]), "coef_ln_n": [p2, p1, p0],
          "fitted_n": [float(n[near].min()), float(n[near].max())]}


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
  good = [f for f in out if f["status"] == "ok"]
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
    good = [f for f in fitted if f["status"] == "ok"]
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

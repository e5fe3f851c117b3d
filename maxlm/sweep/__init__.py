"""`maxlm sweep`: choosing a model size by an iso-FLOP experiment (Hoffmann et al., 2022).

For a few compute budgets C it trains a row of model sizes N, each for D = C / (6N) tokens,
fits the final held-out loss against ln N by a parabola per budget (N_opt, L_min), fits
N_opt ~ C^a and D_opt ~ C^b across budgets, and writes a runnable config for a larger target
budget, data-limited where the data cannot feed the compute-optimal D. Rooms: `grid` (sizes and
N), `runner` (points as ordinary runs, resumable and parallel), `fit` (the fits and the rule),
`report` (tables, sweep.json, isoflop.png, recommended.yaml). We wrote it ourselves: no
training stack we know of ships this as a command, and its parts are small.
"""

import os

from maxlm import MaxlmError, outputs
from maxlm.sweep import fit, grid, report, runner


def parse_budgets(text):
  try:
    budgets = sorted({float(b) for b in text.split(",") if b.strip()})
  except ValueError:
    raise MaxlmError(f"--budgets: expected FLOP counts such as 1e13,3e13,1e14, got {text!r}")
  if not budgets or not all(1e6 <= b <= 1e30 for b in budgets):
    raise MaxlmError(f"--budgets: expected FLOP counts in [1e6, 1e30], got {text!r}")
  return budgets


def sweep(config_path, overrides, budgets, sizes, out, *, workers=1, target=None, lr=None,
          eval_tokens=None, log=print):
  """Runs (or finishes) the sweep in `out`; returns the summary dict written to sweep.json."""
  if "://" in out:
    raise MaxlmError(f"--out {out}: a sweep writes to a local folder (its runs may still use "
                     "a gs:// data.dir)")
  if workers < 1 or (eval_tokens is not None and eval_tokens < 1):
    raise MaxlmError("--workers and --eval-tokens must be >= 1")
  if target is not None and not 1e6 <= target <= 1e30:
    raise MaxlmError(f"--target-flops: expected a FLOP count in [1e6, 1e30], got {target}")
  if lr is not None and not 0 < lr < 1e3:
    raise MaxlmError(f"--lr: expected a learning rate > 0, got {lr}")
  if os.path.exists(out) and not os.path.isdir(out):
    raise MaxlmError(f"--out {out} is a file; pass a folder")
  found = outputs.enclosing(out)
  if found:
    where = "is" if found[0] == os.path.realpath(out) else "lies inside"
    raise MaxlmError(f"--out {out} {where} the {found[1]} {found[0]}: a sweep writes its own "
                     "runs and reports; choose a folder outside any run dir or data dir")
  if lr is None:  # a train.lr= override fixes the rate too
    lr = _override_lr(overrides)
  base, raw = runner.base_config(config_path, overrides)
  if sizes == "auto":
    shapes_for = grid.auto_grid
  else:
    explicit = grid.parse_sizes(sizes)
    shapes_for = lambda *_: explicit  # noqa: E731
  out = os.path.abspath(out)
  held = runner.lock(out)
  try:
    points, vocab, unique = runner.plan_points(base, raw, budgets, shapes_for, out, lr,
                                               eval_tokens)
    runner.check_out(out, points)
    log(f"{len(points)} points over {len(budgets)} budgets in {out}/runs; "
        f"{report.N_CONVENTION}")
    for warning in report.warnings(report.point_rows(points)):
      log(f"warning: {warning}")
    failures = runner.run_points(points, workers, log)
    rows = report.point_rows(points)
    fitted, exponents = fit.fits(rows)  # failed points have no loss
    target = target or max(budgets) * 10
    recommendation = fit.recommend(target, exponents, fitted, unique, rows)
    report.write_json(out, rows, fitted, exponents, recommendation, target)
    first = base.stages[0]
    recommended = report.write_recommended(out, raw, recommendation, vocab,
                                           base.model.tied_embeddings,
                                           first.batch * first.seq_len, target, base.model)
    png = report.write_png(out, rows, fitted, exponents, target)
    log(report.tables(rows, fitted, exponents, recommendation, target))
    for warning in report.warnings(rows):
      log(f"warning: {warning}")
    log(f"wrote {out}/sweep.json, {png}" + (f", {recommended}" if recommended else
                                            " (no recommendation: no budget has an optimum)"))
    if failures:
      raise MaxlmError(f"{len(failures)} point{'s' * (len(failures) > 1)} failed: " + "; ".join(
          f"{k}: {v}" for k, v in failures.items()))
    return {"points": rows, "fits": fitted, "exponents": exponents,
            "recommendation": recommendation}
  finally:
    held.close()


def _override_lr(overrides):
  for o in overrides:
    key, _, value = o.partition("=")
    if key.strip() == "train.lr":
      try:
        return float(value)
      except ValueError:
        return None  # the config loader names the bad value
  return None

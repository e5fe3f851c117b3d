"""maxlm sweep: parameter and FLOP accounting, the fits, the data-limited rule, and a real tiny
sweep that is deterministic and resumes after a kill."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import yaml

from maxlm import MaxlmError, cli, config as config_lib
from maxlm.model import build
from maxlm.sweep import fit, grid, report, runner
import maxlm.sweep as sweep_lib
from limits import HANG_S


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("d_model,n_layers", [(16, 1), (40, 1), (96, 2), (256, 6)])
def test_n_params_counts_every_parameter_of_the_model(d_model, n_layers, tied):
  shape = grid.shape_for(d_model, n_layers)
  cfg = config_lib.from_dict({"stages": [{"seq_len": 16, "batch": 1, "steps": 1}],
                              "model": {**shape.model_keys(), "tied_embeddings": tied}})
  model = build.model_for(cfg, 0, vocab_size=300)
  params = jax.eval_shape(lambda: build.init_params_abstract(model, 16))
  assert grid.n_params(shape, 300, tied) == build.count_params(params)


def test_auto_grid_spans_the_window_and_every_point_gets_enough_steps():
  for budget in (3e11, 1e12, 3e12, 1e14):
    shapes = grid.auto_grid(budget, 4096, False, 2048)
    sizes = [grid.n_params(s, 4096, False) for s in shapes]
    assert len(shapes) >= 4 and sizes == sorted(sizes) and len(set(sizes)) == len(sizes)
    assert all(round(budget / (6 * n) / 2048) >= runner.MIN_STEPS for n in sizes)
    assert sizes[-1] / sizes[0] >= 5
  with pytest.raises(MaxlmError, match="too small"):
    grid.auto_grid(1e9, 4096, False, 2048)


def test_sizes_parse_names_and_shapes_and_reject_typos():
  shapes = grid.parse_sizes("tiny,128x4, 64×2")
  assert [s.label for s in shapes] == ["tiny", "128x4", "64x2"]
  assert shapes[1].n_layers == 4 and shapes[1].d_model == 128
  for bad in ("huge", "128x0", "128", "tiny,tiny"):
    with pytest.raises(MaxlmError, match="--sizes"):
      grid.parse_sizes(bad)


def test_budgets_parse():
  assert sweep_lib.parse_budgets("1e13, 3e12,1e13") == [3e12, 1e13]
  for bad in ("1e13,x", "", "-5", "1e40"):
    with pytest.raises(MaxlmError, match="--budgets"):
      sweep_lib.parse_budgets(bad)


def _curves(budgets, n0_of, a=0.08, noise=0.0, seed=0):
  rng = np.random.default_rng(seed)
  points = []
  for c in budgets:
    for n in np.geomspace(n0_of(c) / 8, n0_of(c) * 8, 7):
      loss = a * (math.log(n) - math.log(n0_of(c))) ** 2 + 3 - 0.1 * math.log10(c)
      points.append({"budget": c, "n_params": float(n), "val_loss": loss + noise *
                     rng.standard_normal()})
  return points


def test_fits_recover_a_known_optimum_and_exponent():
  n0 = lambda c: 0.1 * c ** 0.5  # noqa: E731
  fitted, exps = fit.fits(_curves([1e12, 1e13, 1e14], n0))
  for f in fitted:
    assert f["status"] == "ok"
    assert f["n_opt"] == pytest.approx(n0(f["budget"]), rel=1e-6)
    assert f["d_opt"] == pytest.approx(f["budget"] / (6 * n0(f["budget"])), rel=1e-6)
  assert exps["a"] == pytest.approx(0.5, abs=1e-6) and exps["b"] == pytest.approx(0.5, abs=1e-6)
  noisy, exps = fit.fits(_curves([1e12, 1e13, 1e14], n0, noise=0.002))
  assert exps["a"] == pytest.approx(0.5, abs=0.05)


def test_fits_say_when_the_optimum_is_beyond_the_sizes():
  falling = [{"budget": 1e12, "n_params": n, "val_loss": 0.01 * (math.log(n / 1e7)) ** 2}
             for n in (1e5, 2e5, 4e5)]
  rising = [{"budget": 1e13, "n_params": n, "val_loss": v}
            for n, v in ((1e5, 3.0), (2e5, 3.5), (4e5, 4.0))]
  fitted, exps = fit.fits(falling + rising)
  assert [(f["status"], f["edge"]) for f in fitted] == [("at_edge", "largest"),
                                                       ("at_edge", "smallest")]
  assert all(f["n_opt"] is None for f in fitted) and exps["a"] is None


def test_fits_use_the_neighbourhood_of_the_best_point():
  # a parabola near the optimum, far points off it: only the neighbourhood of the best counts
  sizes = [1e4, 1e5, 2e5, 4e5, 8e5, 1e7]
  losses = [9.0] + [0.05 * math.log(n / 3e5) ** 2 + 2 for n in sizes[1:5]] + [9.0]
  f = fit.parabola(sizes, losses)
  assert f["status"] == "ok" and f["n_opt"] == pytest.approx(3e5, rel=1e-6)
  assert f["fitted_n"] == [2e5, 8e5]


def test_recommendation_is_data_limited_when_the_data_cannot_feed_the_compute():
  exps = {"a": 0.5, "b": 0.5, "ln_n_prefactor": math.log(0.1), "ln_d_prefactor": 0}
  plenty = fit.recommend(1e14, exps, [], unique_tokens=10**12)
  assert plenty["n_params"] == pytest.approx(0.1 * 1e7)
  assert plenty["tokens"] == pytest.approx(1e14 / 6 / 1e6)
  assert plenty["rule"].startswith("compute-optimal")
  scarce = fit.recommend(1e14, exps, [], unique_tokens=10**6)
  assert scarce["tokens"] == 3 * 10**6 and scarce["epochs"] == 3
  assert scarce["n_params"] == pytest.approx(1e14 / (6 * 3e6))
  assert scarce["rule"].startswith("data-limited")


def _sweep_cmd(demo_data, out, *extra):
  return [sys.executable, "-m", "maxlm.cli", "sweep", "configs/demo.yaml",
          f"data.dir={demo_data}", "stages.0.batch=8", "stages.0.seq_len=64",
          "--budgets", "1e10", "--sizes", "16x1,24x1,32x1", "--eval-tokens", "2048",
          "--out", str(out), *extra]


def _results(out):
  with open(os.path.join(out, "sweep.json")) as f:
    body = json.load(f)
  return [(p["size"], p["n_params"], p["tokens"], p["val_loss"], p["val_bpb"])
          for p in body["points"]], body


@pytest.mark.slow
def test_a_tiny_sweep_is_deterministic_and_resumes_after_a_kill(demo_data, tmp_path, capsys,
                                                               monkeypatch):
  cwd = os.path.dirname(os.path.dirname(__file__))
  whole = subprocess.run(_sweep_cmd(demo_data, tmp_path / "a"), cwd=cwd, capture_output=True,
                         text=True)
  assert whole.returncode == 0, whole.stderr
  assert "embeddings included" in whole.stdout and "N_opt" in whole.stdout
  results, body = _results(tmp_path / "a")
  assert len(results) == 3 and all(math.isfinite(r[3]) and math.isfinite(r[4]) for r in results)
  for p in body["points"]:  # 6 N D within 2% of the budget (41 to 90 steps a point)
    assert abs(p["flops"] - 1e10) / 1e10 <= 0.02
    assert 6 * p["n_params"] * p["tokens"] == p["flops"]
  assert os.path.getsize(tmp_path / "a" / "isoflop.png") > 10_000
  recommended = yaml.safe_load((tmp_path / "a" / "recommended.yaml").read_text())
  config_lib.from_dict(recommended)  # a valid, runnable config

  # killed while its second point trains, then rerun: the first point is reused
  out = tmp_path / "b"
  proc = subprocess.Popen(_sweep_cmd(demo_data, out), cwd=cwd, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
  second = out / "runs" / "c1e10_24x1" / "metrics.jsonl"
  deadline = time.time() + HANG_S
  while proc.poll() is None and not second.exists() and time.time() < deadline:
    time.sleep(0.1)
  assert proc.poll() is None, "the sweep ended before its second point started"
  os.killpg(proc.pid, signal.SIGKILL)
  proc.wait()
  rerun = subprocess.run(_sweep_cmd(demo_data, out), cwd=cwd, capture_output=True, text=True)
  assert rerun.returncode == 0, rerun.stderr
  assert "1 of 3 points already finished" in rerun.stdout
  assert _results(out)[0] == results  # bitwise the same numbers as the uninterrupted sweep

  # refused before any point runs: in this process (the failing-point test below sees a
  # sweep's exit code 2 and one line from a process of its own)
  monkeypatch.chdir(cwd)
  capsys.readouterr()
  assert cli.main([str(a) for a in _sweep_cmd(demo_data, out, "--lr", "0.01")[3:]]) == 2
  other = capsys.readouterr().err
  assert "holds another sweep" in other and "Traceback" not in other


def test_a_failing_point_stops_the_sweep_with_one_line(demo_data, tmp_path):
  cwd = os.path.dirname(os.path.dirname(__file__))
  cmd = [a if a != "stages.0.batch=8" else "stages.0.batch=4" for a in
         _sweep_cmd(demo_data, tmp_path / "bad")]  # 8 simulated devices cannot split 4 rows
  proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=HANG_S)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  assert "1 point failed: c1e10_16x1" in proc.stderr and "not divisible" in proc.stderr
  assert not (tmp_path / "bad" / "runs" / "c1e10_24x1").exists()  # not started


def test_a_full_disk_is_one_line_and_leaves_the_old_file(tmp_path):
  """sweep.json, recommended.yaml and the point configs are written whole or not at all: a
  real ENOSPC (the temporary name is /dev/full) names the file and leaves no temporary."""
  target = tmp_path / "sweep.json"
  target.write_text("old")
  (tmp_path / f"sweep.json.tmp-{os.getpid()}.json").symlink_to("/dev/full")
  with pytest.raises(MaxlmError, match=r"cannot write .*sweep.json: No space left on device "
                                       r"\(errno 28\)"):
    report.write_json(str(tmp_path), [], [], {"big": "new" * 100_000}, None, 1e18)
  assert target.read_text() == "old" and sorted(os.listdir(tmp_path)) == ["sweep.json"]


def test_out_never_lands_in_a_run_dir_or_data_dir(tmp_path):
  data, run = tmp_path / "data", tmp_path / "run"
  data.mkdir()
  (data / "manifest.json").write_text("{}")
  (run / "checkpoints").mkdir(parents=True)
  (run / "config.yaml").write_text("seed: 0\n")
  for out, message in ((data, "is the data dir"), (data / "sw", "lies inside the data dir"),
                       (run, "is the run dir"), (run / "sw", "lies inside the run dir")):
    with pytest.raises(MaxlmError, match=f"--out .* {message} .*: a sweep writes its own runs"):
      sweep_lib.sweep("never-read.yaml", [], [1e10], "32x2", str(out))
  assert sorted(p.name for p in data.iterdir()) == ["manifest.json"]
  assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.yaml"]

"""Training mixture-of-experts models (maxlm/model/moe_state.py, maxlm/train/step.py,
maxlm/model/build.py): the balancing bias and its update, the auxiliary losses in the loss, the
routing metrics, FLOPs and parameter counts of active vs all experts, and a bitwise resume."""

import dataclasses
import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm import MaxlmError, config as config_lib
from maxlm.train import open_run
from maxlm.model import build, moe_state
from maxlm.parallel import mesh as mesh_lib
from maxlm.train import memory
from maxlm.sweep import grid
from maxlm.train import console, optimizer, resume, step as step_lib, verify
from maxlm.train import metrics as metrics_lib

from smallrun import small_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
MOE = ["model.moe.experts=4", "model.moe.top_k=2", "model.moe.shared_experts=1",
       "model.moe.d_ff=32", "model.n_layers=3", "model.moe.every=1", "model.moe.first_dense=1"]


def test_bias_falls_for_an_overloaded_expert_and_rises_for_idle_ones():
  bias = {"layers": {"moe": {"bias": jnp.zeros((2, 4), jnp.float32)}}}
  stats = {"layers": {"moe": {"load": jnp.array([[10.0, 2, 2, 2], [4, 4, 4, 4]]),
                              "entropy": jnp.zeros(2)}}}
  new = moe_state.update(bias, stats, 0.01)["layers"]["moe"]["bias"]
  np.testing.assert_array_equal(new, np.float32([[-0.01, 0.01, 0.01, 0.01], [0, 0, 0, 0]]))
  again = moe_state.update({"layers": {"moe": {"bias": new}}}, stats, 0.01)
  assert float(again["layers"]["moe"]["bias"][0, 0]) == pytest.approx(-0.02)


def _tiny(tmp_path, data_dir, *overrides):
  cfg = config_lib.load(str(small_config(tmp_path, data_dir)), [*MOE, *overrides])
  model = build.model_for(cfg, 0, mesh_lib.make_mesh(cfg.stages[0].mesh, jax.devices()[:1]),
                          1000)
  return cfg, model


def _batch(seq_len=32, rows=4, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(11, 1000, (rows, seq_len + 1)).astype(np.int32)
  seg = np.ones((rows, seq_len), np.int32)
  seg[:, seq_len // 2:] = 2  # two documents a row
  pos = np.concatenate([np.arange(seq_len // 2)] * 2)[None].repeat(rows, 0).astype(np.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg,
          "positions": pos, "loss_mask": np.ones((rows, seq_len), np.int32)}


def _state_and_step(cfg, model, grad_accum=1):
  mesh = model.settings.mesh
  opt, schedule = optimizer.make(cfg.train, 10)
  state = step_lib.init_state(model, opt, mesh, cfg.rules, 0, 32)
  step = jax.jit(step_lib.make_train_step(model, opt, schedule, cfg.rules, model.cfg,
                                          grad_accum))
  return state, step


def test_train_step_moves_the_bias_by_its_rule_and_never_by_a_gradient(tmp_path, data_dir):
  cfg, model = _tiny(tmp_path, data_dir, "model.moe.bias_rate=0.125")
  state, step = _state_and_step(cfg, model)
  batch = _batch()
  bias0 = jax.tree_util.tree_map(np.asarray, state["moe_bias"])
  _, sums = build.loss_fn(model, state["params"], batch, cfg.rules, chunk=32,
                          moe_bias=state["moe_bias"])
  grad = jax.grad(lambda b: build.loss_fn(model, state["params"], batch, cfg.rules, chunk=32,
                                          moe_bias=b)[0])(state["moe_bias"])
  assert all(not np.any(g) for g in jax.tree_util.tree_leaves(grad))  # selection only
  new, metrics = step(state, batch)
  load = sums["moe"]["group_1"]["block_0"]["moe"]["load"]  # layers 1 and 2, stacked
  assert load.shape == (2, 4) and float(load.sum()) == 2 * 4 * 32 * 2  # rows x L x top_k
  want = 0.125 * np.sign(load.mean(-1, keepdims=True) - load)
  got = new["moe_bias"]["group_1"]["block_0"]["moe"]["bias"] - bias0["group_1"]["block_0"][
      "moe"]["bias"]
  np.testing.assert_array_equal(got, want)
  assert "moe_bias" not in json.dumps(jax.tree_util.tree_map(lambda _: 0, new["opt_state"]),
                                      default=str)
  for i in (1, 2):
    ratio = metrics[f"moe/max_load_over_mean/{i}"]
    assert ratio == pytest.approx(float(load[i - 1].max() / load[i - 1].mean()))
    assert 0 < metrics[f"moe/entropy/{i}"] <= np.log(4) + 1e-6
  assert "moe/max_load_over_mean/0" not in metrics  # layer 0 is dense
  assert not any(k.startswith("moe/dropped") for k in metrics)  # dropless


def test_grad_accumulation_updates_the_bias_from_the_whole_batch(tmp_path, data_dir):
  cfg, model = _tiny(tmp_path, data_dir)
  state, one = _state_and_step(cfg, model)
  _, two = _state_and_step(cfg, model, grad_accum=2)
  batch = _batch()
  copy = jax.tree_util.tree_map(jnp.array, state)
  a, ma = one(state, batch)
  b, mb = two(copy, batch)
  for x, y in zip(jax.tree_util.tree_leaves(a["moe_bias"]),
                  jax.tree_util.tree_leaves(b["moe_bias"])):
    np.testing.assert_array_equal(x, y)
  assert ma["moe/max_load_over_mean/1"] == pytest.approx(mb["moe/max_load_over_mean/1"])


def test_loss_adds_the_weighted_aux_and_router_z_losses(tmp_path, data_dir):
  cfg, model = _tiny(tmp_path, data_dir)
  state, _ = _state_and_step(cfg, model)
  batch = _batch()
  weighted = dataclasses.replace(model.cfg, moe=dataclasses.replace(
      model.cfg.moe, aux_loss=0.25, router_z_loss=0.03))
  plain_loss, plain = build.loss_fn(model, state["params"], batch, cfg.rules, chunk=32,
                                    moe_bias=state["moe_bias"])
  loss, sums = build.loss_fn(model.clone(cfg=weighted), state["params"], batch, cfg.rules,
                             chunk=32, moe_bias=state["moe_bias"])
  stats = sums["moe"]["group_1"]["block_0"]["moe"]
  added = 0.25 * float(stats["aux_loss"].sum()) + 0.03 * float(stats["z_loss"].sum())
  assert added > 0.01
  assert float(loss - plain_loss) == pytest.approx(added, rel=1e-5)
  assert float(sums["total"] - plain["total"]) == pytest.approx(added * 4 * 32, rel=1e-4)
  assert float(sums["nll"]) == float(plain["nll"])  # the logged loss stays the NLL


def test_capacity_mode_reports_dropped_slots_and_console_the_worst_layer(tmp_path, data_dir):
  cfg, model = _tiny(tmp_path, data_dir, "model.moe.capacity_factor=0.5")
  state, step = _state_and_step(cfg, model)
  _, m = step(state, _batch())
  dropped = [float(m[f"moe/dropped/{i}"]) for i in (1, 2)]
  assert all(d >= 4 * 32 * 2 / 2 for d in dropped)  # at most half of the slots fit
  row = {"loss": 1.0, "lr": 1e-3, "tokens_per_s": 10.0, **{k: float(v) for k, v in m.items()}}
  worst = max((1, 2), key=lambda i: row[f"moe/max_load_over_mean/{i}"])
  line = console.progress_line(0, 0, 5, 0, 5, row, None)
  assert f"moe max/mean {row[f'moe/max_load_over_mean/{worst}']:.2f} (layer {worst})" in line


def _model_cfg(**moe):
  base = config_lib.load(str(ROOT / "configs/demo.yaml"), ["model.vocab_size=1000"]).model
  return dataclasses.replace(base, n_layers=4, moe=dataclasses.replace(base.moe, **moe))


def test_flops_count_the_active_experts_by_hand():
  cfg = _model_cfg(experts=8, top_k=2, shared_experts=1, d_ff=64, every=2)
  d, hd, h, kv, v, f, e = 256, 64, 4, 2, 1000, 64, 8
  attention_w = d * hd * (2 * h + 2 * kv)
  dense_layer = attention_w + 3 * d * 768
  moe_layer = attention_w + d * e + 3 * d * f * (2 + 1)  # router + top_k + shared
  attended = (128 + 1) / 2
  want = 6 * (2 * dense_layer + 2 * moe_layer + d * v) + 3 * 4 * 4 * h * hd * attended
  assert build.flops_per_token(cfg, 128) == pytest.approx(want)
  dense = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, experts=0))
  assert build.flops_per_token(dense, 128) == pytest.approx(
      6 * (4 * dense_layer + d * v) + 3 * 4 * 4 * h * hd * attended)
  windowed = dataclasses.replace(cfg, attention=dataclasses.replace(
      cfg.attention, window=16, global_every=2))  # layers 0 and 2 local
  local = (16 * 17 / 2 + (128 - 16) * 16) / 128
  assert build.flops_per_token(windowed, 128) == pytest.approx(
      want - 3 * 2 * 4 * h * hd * (attended - local))
  model = build.Decoder(cfg, build.Settings(rope=config_lib.RopeConfig(), impl="reference"))
  params = jax.eval_shape(lambda: build.init_params_abstract(model))
  matmul = sum(x.size for p, x in jax.tree_util.tree_leaves_with_path(params)
               if "norm" not in jax.tree_util.keystr(p) and "embedding" not in
               jax.tree_util.keystr(p))
  skipped = 2 * (8 - 2) * 3 * d * f  # the experts a token is not routed to, in 2 MoE layers
  assert build.flops_per_token(cfg, 128, attended=0) == 6 * (matmul - skipped)
  seg = np.array([[1] * 20 + [2] * 100 + [0] * 8])
  assert build.mean_attended(seg, 16) == pytest.approx(
      (16 * 17 / 2 + 4 * 16 + 16 * 17 / 2 + 84 * 16) / 120)  # a query sees at most 16 keys


def test_param_counts_total_for_memory_active_for_flops():
  cfg = _model_cfg(experts=8, top_k=2, shared_experts=1, d_ff=64, every=2)
  params = jax.eval_shape(lambda: build.init_params_abstract(build.Decoder(
      cfg, build.Settings(rope=config_lib.RopeConfig(), impl="reference"))))
  total = build.count_params(params)
  assert total == grid.n_params(grid.Shape(256, 4, 4, 2, 64, 768), 1000, False, cfg)
  unused = 2 * (8 - 2) * 3 * 256 * 64  # two MoE layers, six experts a token skips
  assert build.active_params(cfg, total) == total - unused
  assert grid.n_params(grid.Shape(256, 4, 4, 2, 64, 768), 1000, False, cfg, active=True) == (
      total - unused)
  full = config_lib.load(str(ROOT / "configs/demo.yaml"), [
      "model.vocab_size=1000", "model.n_layers=4", "model.moe.experts=8", "model.moe.d_ff=64",
      "model.moe.every=2", "model.moe.shared_experts=1"])
  counts = memory.param_counts(full, 1000)
  assert counts == {"total": total, "active": total - unused}
  est = memory.estimate(full, 0, 1, 1000, platform="cpu")
  assert est["params"] == 4 * total and est["optimizer"] == 8 * total  # every expert
  table = memory.format_table(full, [est], 1, counts)
  assert f"memory counts all {total:,} parameters" in table and f"{total - unused:,}" in table


def test_a_resume_that_would_drop_or_add_the_bias_is_one_line(tmp_path, data_dir):
  path = small_config(tmp_path, data_dir)
  biased = config_lib.load(str(path), MOE)
  meta = {"config": config_lib.to_dict(biased), "vocab": 1000}
  resume.check_same_model(biased, 1000, meta)  # the same model: fine
  other = config_lib.load(str(path), [*MOE, "model.moe.balance=aux_loss"])
  with pytest.raises(MaxlmError, match="checkpoints hold MoE balancing bias"):
    resume.check_same_model(other, 1000, meta)


@pytest.mark.slow
def test_moe_run_resumes_bitwise_and_maxlm_eval_routes_with_the_runs_bias(tmp_path, data_dir):
  """A biased MoE run killed and resumed is bitwise the uninterrupted one; and `maxlm eval`
  scores its checkpoint as training's own eval did: with the balancing bias (without it the
  routing, and so the loss, would differ). The run trains with Muon and DeepSeek-V4's routing,
  so Muon's state is in the proof."""
  path = small_config(tmp_path, data_dir, eval_every=11)  # once, after the last of 11 steps
  lines = []
  v4 = ["train.optimizer=muon", "model.moe.score=sqrt_softplus",
        "model.moe.route_scale=1.5", "model.moe.swiglu_limit=10"]
  assert verify.verify(str(path), [*MOE, "model.moe.bias_rate=0.05", *v4], kills=1,
                       workdir=str(tmp_path / "verify"), log=lines.append)
  assert not any("DIFFERENT" in line for line in lines), lines
  run_dir = tmp_path / "verify" / "uninterrupted"
  *_, collections = open_run.open_run(str(run_dir))
  assert max(float(np.abs(b).max()) for b in jax.tree_util.tree_leaves(collections)) > 0
  trained = [r for r in metrics_lib.read_jsonl(str(run_dir)) if "val_loss" in r][-1]
  proc = subprocess.run([sys.executable, "-m", "maxlm.cli", "eval", str(run_dir), "--json"],
                        capture_output=True, text=True, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert json.loads(proc.stdout)["all"]["loss"] == pytest.approx(trained["val_loss"], rel=1e-6)

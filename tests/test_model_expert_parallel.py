"""Expert parallelism (maxlm/model/expert_parallel.py) on 8 fake CPU devices (tests/conftest.py):
any mesh with the experts split equals one device's `experts_grouped`, outputs and gradients."""

import functools
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from maxlm import MaxlmError, config as config_lib
from maxlm.model import build, expert_parallel, experts
from maxlm.parallel import mesh as mesh_lib
from maxlm.typed_yaml import ConfigError
from limits import HANG_S
import xlaflags

ROOT = pathlib.Path(__file__).resolve().parents[1]
MESHES = [dict(data=1, expert=8), dict(data=1, fsdp=2, expert=4),
          dict(data=2, expert=2, context=2)]


def _mesh(**sizes):
  return mesh_lib.make_mesh(config_lib.MeshConfig(**sizes), jax.devices()[:8])


def _inputs(tokens=64, d=16, f=8, n_experts=8, k=2, seed=0, skew=False):
  """Random routing (or, with skew, every slot to experts 0 and 1, one device's), the last five
  tokens padding (expert id E)."""
  rng = np.random.default_rng(seed)
  x_TxD = rng.normal(size=(tokens, d)).astype(np.float32)
  expert_TxK = np.stack([rng.choice(n_experts, k, replace=False) for _ in range(tokens)])
  if skew:
    expert_TxK = np.tile(np.arange(k), (tokens, 1))
  expert_TxK[-5:] = n_experts
  weight_TxK = rng.uniform(size=(tokens, k)).astype(np.float32)
  gate_up = (rng.normal(size=(n_experts, d, 2, f)) * 0.3).astype(np.float32)
  down = (rng.normal(size=(n_experts, f, d)) * 0.3).astype(np.float32)
  return x_TxD, jnp.asarray(expert_TxK, jnp.int32), weight_TxK, gate_up, down


def _value_and_grads(experts_fn, inputs, capacity):
  """y and the gradients of sum(y * fixed noise) w.r.t. x, weights, gate_up and down."""
  x_TxD, expert_TxK, weight_TxK, gate_up, down = inputs
  probe = jnp.asarray(np.random.default_rng(1).normal(size=x_TxD.shape), jnp.float32)

  def loss(x, w, gu, dn):
    y = experts_fn(x, expert_TxK, w, gu, dn, capacity)
    return jnp.sum(y * probe), y

  grad_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
  (_, y), grads = grad_fn(x_TxD, weight_TxK, gate_up, down)
  return y, grads


def _sharded(mesh):
  return functools.partial(expert_parallel.experts_sharded, mesh=mesh, batch_axes=
                           expert_parallel.token_axes(config_lib.DEFAULT_RULES, mesh.axis_names))


def _assert_same(got, want):
  y, grads = got
  y_ref, grads_ref = want
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  for g, g_ref, name in zip(grads, grads_ref, ("x", "weight", "gate_up", "down")):
    np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-5, err_msg=name)


@functools.lru_cache(maxsize=None)
def _one_device(capacity):
  """One device's experts_grouped on _inputs(), computed once for every mesh below."""
  return _value_and_grads(experts.experts_grouped, _inputs(), capacity)


@pytest.mark.parametrize("sizes", MESHES, ids=lambda s: "x".join(f"{k}{v}" for k, v in s.items()))
def test_sharded_equals_one_device_dropless_and_capacity(sizes):
  mesh = _mesh(**sizes)
  inputs = _inputs()
  dropless = _one_device(0)
  _assert_same(_value_and_grads(_sharded(mesh), inputs, 0), dropless)
  capped = _one_device(5)  # ~15 slots per expert: most dropped
  assert not np.allclose(capped[0], dropless[0])
  _assert_same(_value_and_grads(_sharded(mesh), inputs, 5), capped)


def test_every_slot_to_one_device_is_still_dropless():
  """The worst case the padded buffers are sized for: all slots of all devices to device 0."""
  mesh = _mesh(data=1, expert=8)
  inputs = _inputs(skew=True)
  _assert_same(_value_and_grads(_sharded(mesh), inputs, 0),
               _value_and_grads(experts.experts_loop, inputs, 0))


def test_tokens_split_over_the_expert_axis_even_when_the_batch_rule_omits_it():
  mesh = _mesh(data=2, expert=4)
  rules = {**config_lib.DEFAULT_RULES, "batch": ("data",)}
  assert expert_parallel.token_axes(rules, mesh.axis_names) == ("data", "expert", "context")
  assert expert_parallel.token_axes(config_lib.DEFAULT_RULES, mesh.axis_names) == (
      "data", "fsdp", "expert", "context")
  inputs = _inputs(tokens=32)
  fn = functools.partial(expert_parallel.experts_sharded, mesh=mesh, batch_axes=("data",))
  _assert_same(_value_and_grads(fn, inputs, 0),
               _value_and_grads(experts.experts_grouped, inputs, 0))


def test_indivisible_experts_or_tokens_are_one_clear_error():
  mesh = _mesh(data=1, expert=8)
  x_TxD, expert_TxK, weight_TxK, gate_up, down = _inputs(n_experts=4)
  with pytest.raises(MaxlmError, match="4 experts do not split over mesh expert=8"):
    expert_parallel.experts_sharded(x_TxD, expert_TxK, weight_TxK, gate_up, down, mesh=mesh)
  x_TxD, expert_TxK, weight_TxK, gate_up, down = _inputs(tokens=60)
  with pytest.raises(MaxlmError, match="60 tokens do not split over the 8 devices"):
    expert_parallel.experts_sharded(x_TxD, expert_TxK, weight_TxK, gate_up, down, mesh=mesh)


def test_mesh_expert_axis_sizes():
  assert config_lib.MESH_AXES[2] == "expert"
  assert mesh_lib.mesh_shape(config_lib.MeshConfig(data=1, fsdp=2, expert=-1), 8) == (1, 2, 4, 1,
                                                                                        1)
  assert _mesh(data=2, expert=4).shape["expert"] == 4
  with pytest.raises(ConfigError, match="mesh.expert: expected a positive size or -1"):
    config_lib.MeshConfig(expert=0).check("mesh")


def test_gpu_moe_check_dry_run_measures_and_agrees(tmp_path):
  """tools/gpu_moe_check.sh --dry-run: the device check's code at tiny sizes on the CPU."""
  proc = subprocess.run(["bash", str(ROOT / "tools" / "gpu_moe_check.sh"), str(tmp_path),
                         "--dry-run"], capture_output=True, text=True, timeout=HANG_S)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  report = json.loads((tmp_path / "gpu_moe.json").read_text())
  assert report["dry_run"] and report["devices"] == 8 and report["dispatch"]["expert_axis"] == 8
  for impl in ("tiled", "ragged_dot"):  # the CPU's grouped matmul and jax's
    assert report["grouped"][f"grouped_{impl}_vs_loop_max_abs_diff"] < 1e-5
  assert report["dispatch"]["sharded_vs_grouped_max_abs_diff"] < 1e-5
  assert report["grouped"]["loop_ms"] > 0 and report["dispatch"]["all_to_all_ms"] > 0


def _moe_config(**moe):
  return config_lib.from_dict({
      "model": {"size": "tiny", "vocab_size": 128, "dtype": "float32", "d_model": 32,
                "n_heads": 2, "n_kv_heads": 1, "head_dim": 16, "d_ff": 64, "n_layers": 3,
                "moe": {"experts": 8, "top_k": 2, "shared_experts": 1, "d_ff": 16,
                        "first_dense": 1, "aux_loss": 0.01, "router_z_loss": 0.001, **moe}},
      "stages": [{"seq_len": 32, "batch": 8, "steps": 1, "attention": "blockwise",
                  "block_q": 16, "block_k": 16}]})


def _model_loss_and_grads(cfg, sizes, n_devices):
  mesh = _mesh_of(sizes, n_devices)
  model = build.model_for(cfg, 0, mesh)
  params = build.init_params(model, jax.random.key(0), mesh, cfg.rules, 32)
  rng = np.random.default_rng(0)
  seg = np.repeat(np.arange(1, 5), 8)[None].repeat(8, 0).astype(np.int32)
  seg[1, 20:] = 0  # padding: routed nowhere
  pos = np.tile(np.arange(8), 4)[None].repeat(8, 0).astype(np.int32)
  batch = {"inputs": rng.integers(0, 128, (8, 32)).astype(np.int32),
           "targets": rng.integers(0, 128, (8, 32)).astype(np.int32), "segment_ids": seg,
           "positions": pos, "loss_mask": (seg > 0).astype(np.int32)}
  placed = mesh_lib.place_batch(batch, mesh, cfg.rules)
  fn = jax.value_and_grad(lambda p, b: build.loss_fn(model, p, b, cfg.rules, chunk=16),
                          has_aux=True)
  with mesh:
    (loss, aux), grads = jax.jit(fn)(params, placed)
  return float(loss), jax.tree_util.tree_map(np.asarray, aux["moe"]), jax.tree_util.tree_map(
      np.asarray, grads)


def _mesh_of(sizes, n_devices):
  return mesh_lib.make_mesh(config_lib.MeshConfig(**sizes), jax.devices()[:n_devices])


@pytest.mark.parametrize("sizes, moe_keys", [
    (dict(data=1, fsdp=2, expert=4), {}),
    (dict(data=2, expert=2, context=2), {"capacity_factor": 1.0, "score": "sigmoid"})],
    ids=["fsdp2xexpert4", "data2xexpert2xcontext2-capacity"])
def test_moe_model_loss_and_grads_on_an_expert_mesh_equal_one_device(sizes, moe_keys):
  cfg = _moe_config(**moe_keys)
  loss1, stats1, grads1 = _model_loss_and_grads(cfg, dict(data=1), 1)
  loss, stats, grads = _model_loss_and_grads(cfg, sizes, 8)
  assert abs(loss - loss1) <= 1e-5 * abs(loss1)
  for got, want in zip(jax.tree_util.tree_leaves(stats), jax.tree_util.tree_leaves(stats1)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  dropped = sum(float(np.sum(x)) for p, x in jax.tree_util.tree_leaves_with_path(stats)
                if "dropped" in jax.tree_util.keystr(p))
  assert (dropped > 0) == bool(moe_keys)  # capacity mode drops here, and the same slots
  paths = [p for p, _ in jax.tree_util.tree_leaves_with_path(grads1)]
  assert any("experts" in jax.tree_util.keystr(p) for p in paths)
  for g, g1 in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(grads1)):
    assert np.abs(g - g1).max() <= 1e-5 * np.abs(g1).max()


@pytest.mark.slow
def test_maxlm_train_of_a_moe_model_on_fsdp2_x_expert4_matches_one_device(tmp_path):
  """Three steps of `maxlm train` (bias balancing, a shared expert) on 8 devices as 2 x 4
  (fsdp x expert) and on one device: the same losses, gradient norms and routing metrics."""
  sys.path.insert(0, str(ROOT / "tests"))
  import datagen  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  lengths = rng.lognormal(np.log(40), 0.8, 200).astype(int) + 1
  data = datagen.write_data_dir(tmp_path / "data", datagen.make_docs(
      lengths, ["prose" if i % 2 else "code" for i in range(len(lengths))]), val_fraction=0.1)
  config = tmp_path / "moe.yaml"
  config.write_text(yaml.safe_dump({
      "seed": 0, "data": {"dir": str(data), "mix": {"prose": 0.5, "code": 0.5}, "overlap": 4,
                          "shuffle_rows": 8, "block_rows": 64},
      "stages": [{"seq_len": 32, "batch": 8, "steps": 3}],
      "model": {"size": "tiny", "dtype": "float32", "remat": "none", "d_model": 32,
                "n_heads": 2, "n_kv_heads": 1, "head_dim": 16, "d_ff": 64, "loss_chunk": 32,
                "n_layers": 3, "moe": {"experts": 8, "top_k": 2, "shared_experts": 1,
                                       "d_ff": 16, "first_dense": 1, "bias_rate": 0.01}},
      "train": {"lr": 0.01, "warmup_steps": 1, "eval_every": 0, "eval_tokens": 256}}))
  metrics = {}
  for devices, mesh in ((1, []), (8, ["stages.0.mesh.data=1", "stages.0.mesh.fsdp=2",
                                      "stages.0.mesh.expert=4"])):
    run = tmp_path / f"run{devices}"
    env = {**os.environ, "XLA_FLAGS": xlaflags.flags(devices)}
    proc = subprocess.run([sys.executable, "-m", "maxlm.cli", "train", str(config),
                           f"run_dir={run}", *mesh], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=HANG_S)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    metrics[devices] = [json.loads(line) for line in (run / "metrics.jsonl").read_text()
                        .splitlines() if '"loss"' in line]
  assert len(metrics[1]) == len(metrics[8]) == 3
  for one, eight in zip(metrics[1], metrics[8]):
    assert one["fingerprint"] == eight["fingerprint"]  # the same rows
    for key in [k for k in one if k == "loss" or k == "grad_norm" or k.startswith("moe/")]:
      assert eight[key] == pytest.approx(one[key], rel=1e-4), key

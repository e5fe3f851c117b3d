"""`train.optimizer: muon` (maxlm/train/muon.py): which parameters Muon takes and how it reads
their axes, and its first update against the algorithm written out in numpy."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from maxlm import config
from maxlm.train import muon, optimizer

D, F, H, K = 8, 12, 2, 4  # D splits over 8 devices


@pytest.mark.parametrize("names, expected", [
    (("vocab", "embed"), None),
    (("embed", "vocab"), None),
    (("layers", "norm"), None),
    (("layers", "mhc_maps"), None),
    (("layers", "embed", "q_heads", "head_dim"), ((1,), (2, 3))),
    (("layers", "q_heads", "head_dim", "embed"), ((1, 2), (3,))),
    (("layers", "expert", "mlp", "embed"), ((2,), (3,))),
    (("layers", "expert", "embed", "gate_up", "mlp"), ((2,), (3, 4))),
    (("layers", "embed", None), ((1,), (2,))),
    (("layers", "mhc_maps", "mhc_in"), ((2,), (1,))),
    (("layers", "mqa_group", None, None), ((2,), (3,))),
    (("layers", "mqa_slot", None), None),
])
def test_the_split_and_the_matrix_axes_follow_the_logical_names(names, expected):
  dims = muon.dimension_numbers(names)
  assert (dims is None if expected is None else
          (tuple(dims.reduction_axis), tuple(dims.output_axis)) == expected)


def _orthogonalize(x_2d):
  """DeepSeek-V4's hybrid Newton-Schulz on one matrix, after optax's Frobenius scaling."""
  x = x_2d / (np.linalg.norm(x_2d) + 1e-8)
  flip = x.shape[0] > x.shape[1]
  x = x.T if flip else x
  for a, b, c in muon.V4_COEFFICIENTS:
    gram = x @ x.T
    x = a * x + (b * gram + c * gram @ gram) @ x
  return x.T if flip else x


@pytest.mark.parametrize("spread", [False, True], ids=["in-place", "spread-over-8"])
def test_first_update_equals_the_algorithm_written_out(spread):
  """Muon on a stacked [layers, D, F] matrix and an attention output [layers, H, K, D]: Nesterov
  momentum (optax's bias-corrected form), the hybrid iteration per layer, RMS matched to AdamW,
  decay, the learning rate; AdamW, unchanged, on the embedding and a norm. Spread: the stage's
  mesh of 8 devices, the parameters split over fsdp, each matrix orthogonalised on one device
  (2 layers padded to 8 matrices)."""
  train = config.from_dict({"train": {"optimizer": "muon", "lr": 0.01, "warmup_steps": 0,
                                      "weight_decay": 0.1},
                            "stages": [{"seq_len": 8, "batch": 1, "steps": 4}]}).train
  names = {"embedding": ("vocab", "embed"), "norm": ("layers", "norm"),
           "mlp": ("layers", "embed", "mlp"), "out": ("layers", "q_heads", "head_dim", "embed")}
  keys = jax.random.split(jax.random.PRNGKey(0), 8)
  shapes = {"embedding": (16, D), "norm": (2, D), "mlp": (2, D, F), "out": (2, H, K, D)}
  params = {k: jax.random.normal(keys[i], s) for i, (k, s) in enumerate(shapes.items())}
  grads = {k: jax.random.normal(keys[4 + i], s) for i, (k, s) in enumerate(shapes.items())}
  mesh = None
  if spread:
    mesh = jax.make_mesh((8,), ("fsdp",), devices=jax.devices()[:8],
                         axis_types=(jax.sharding.AxisType.Auto,))
    at = {"embedding": P(None, "fsdp"), "norm": P(None, "fsdp"), "mlp": P(None, "fsdp"),
          "out": P(None, None, None, "fsdp")}
    params, grads = ({k: jax.device_put(v, NamedSharding(mesh, at[k])) for k, v in t.items()}
                     for t in (params, grads))
  opt, schedule = optimizer.make(train, 4, names, mesh)
  updates, _ = jax.jit(opt.update)(grads, opt.init(params), params)
  clipped = optax.clip_by_global_norm(train.clip).update(grads, None)[0]
  beta, lr = train.muon_momentum, float(schedule(0))
  for name, (fan_in, fan_out) in (("mlp", (D, F)), ("out", (H * K, D))):
    g = np.asarray(clipped[name], np.float64)
    nesterov = beta * (1 - beta) * g / (1 - beta ** 2) + g
    direction = np.stack([_orthogonalize(m.reshape(fan_in, fan_out)).reshape(m.shape)
                          for m in nesterov])
    step = (np.sqrt(max(fan_in, fan_out)) * muon.RMS_LIKE_ADAMW * direction
            + train.weight_decay * np.asarray(params[name]))
    np.testing.assert_allclose(updates[name], -lr * step, rtol=2e-4, atol=1e-6)
  adamw, _ = optimizer.make(config.from_dict({"train": {"lr": 0.01, "warmup_steps": 0,
                                                        "weight_decay": 0.1},
                                              "stages": [{"seq_len": 8, "batch": 1,
                                                          "steps": 4}]}).train, 4)
  plain = adamw.update(grads, adamw.init(params), params)[0]
  for name in ("embedding", "norm"):
    np.testing.assert_allclose(updates[name], plain[name], rtol=1e-6)


def test_muon_needs_the_names_and_the_config_checks_its_keys():
  train = config.from_dict({"train": {"optimizer": "muon"},
                            "stages": [{"seq_len": 8, "batch": 1, "steps": 4}]}).train
  with pytest.raises(ValueError, match="logical names"):
    optimizer.make(train, 4)
  for bad, message in (({"optimizer": "sgd"}, "expected adamw or muon"),
                       ({"muon_momentum": 1.0}, "muon_momentum")):
    with pytest.raises(config.ConfigError, match=message):
      config.from_dict({"train": bad, "stages": [{"seq_len": 8, "batch": 1, "steps": 4}]})


def test_spread_orthogonalises_whole_matrices_one_device_each():
  """16 stacked [64, 32] matrices split over 8 devices along their rows: in place each device
  iterates all 16 on a slice of each (the compiler's dots are [16, ...]); spread, 2 whole
  matrices each ([2, ...]), with a fraction of the temporaries."""
  import re
  mesh = jax.make_mesh((8,), ("fsdp",), devices=jax.devices()[:8],
                       axis_types=(jax.sharding.AxisType.Auto,))
  x = jax.device_put(jax.random.normal(jax.random.PRNGKey(1), (16, 64, 32)),
                     NamedSharding(mesh, P(None, "fsdp")))
  dims = optax.contrib.MuonDimensionNumbers((1,), (2,))
  coeffs = np.asarray(muon.V4_COEFFICIENTS)
  compiled = {m is not None: jax.jit(lambda x, m=m: muon.orthogonalize(x, dims, coeffs, m))
              .lower(x).compile() for m in (None, mesh)}
  batches = {k: {int(b) for b in re.findall(r"f32\[(\d+),\d+,\d+\]\{[0-9,]+\} dot\(",
                                            c.as_text())} for k, c in compiled.items()}
  assert batches == {False: {16}, True: {2}}
  temps = {k: c.memory_analysis().temp_size_in_bytes for k, c in compiled.items()}
  assert temps[True] * 3 < temps[False]
  np.testing.assert_allclose(*(jax.jit(lambda x, m=m: muon.orthogonalize(x, dims, coeffs, m))(x)
                               for m in (None, mesh)), atol=1e-5)

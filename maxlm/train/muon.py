"""Muon for the model's matrices, AdamW for the rest (`train.optimizer: muon`, DeepSeek-V4's
split).

Muon takes each matrix's momentum (Nesterov), makes it nearly orthogonal by a Newton-Schulz
iteration, and scales it so its RMS matches AdamW's (0.2 sqrt(max(fan_in, fan_out)), Moonlight's
rule), so one learning rate and schedule serve both halves. The iteration is DeepSeek-V4's
hybrid: 8 steps with (3.4445, -4.7750, 2.0315), then 2 with (2, -1.5, 0.5).

The update itself is optax.contrib's (`scale_by_muon`, `scale_by_shape`): its iteration takes a
coefficient triple per step, so V4's schedule is a table here, not code. What is ours is the
split, read from the logical axis names every parameter carries (maxlm/model/):
- AdamW (the same as `train.optimizer: adamw`, decay mask included): the embedding and head
  (axis `vocab`), norm scales, V4's compressor slot biases, and every parameter with fewer
  than two axes beyond the stacked `layers`, `expert` and output-group axes (the mHC biases and
  gates, the attention sinks);
- Muon: the rest, each a matrix from its reduction axes to its output axes, per layer and per
  expert. The reduction axes are the first axis (`embed` into a projection) or, for a
  projection back to `embed` (attention output, MLP down), every axis before `embed`; an mHC
  map is applied transposed, so it reduces over `mhc_in`.
"""

import jax
import jax.numpy as jnp
import optax
from optax.contrib import _muon as optax_muon

V4_COEFFICIENTS = ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2
BATCH_AXES = ("layers", "expert", "mqa_group")  # each its own matrix
NOT_MATRICES = ("vocab", "norm", "mqa_slot")  # embeddings and head, scales, a slot bias
RMS_LIKE_ADAMW = 0.2


def dimension_numbers(names):
  """optax's MuonDimensionNumbers for a parameter with these logical axis names, or None when
  AdamW updates it."""
  axes = [i for i, n in enumerate(names) if n not in BATCH_AXES]
  if len(axes) < 2 or any(n in NOT_MATRICES for n in names):
    return None
  if names[axes[-1]] == "mhc_in":
    reduction, output = axes[-1:], axes[:-1]
  elif names[axes[-1]] == "embed":
    reduction, output = axes[:-1], axes[-1:]
  else:
    reduction, output = axes[:1], axes[1:]
  return optax_muon.MuonDimensionNumbers(tuple(reduction), tuple(output))


def labels(names_tree):
  return jax.tree.map(lambda n: "adamw" if dimension_numbers(n) is None else "muon", names_tree,
                      is_leaf=lambda x: isinstance(x, tuple))


def transform(train, schedule, adamw, names_tree):
  """Muon on the matrices of `names_tree` (a params-shaped tree of logical-name tuples),
  `adamw` on the rest."""
  is_names = lambda x: isinstance(x, tuple)  # noqa: E731
  muon_names = jax.tree.map(lambda n: n if dimension_numbers(n) is not None else None,
                            names_tree, is_leaf=is_names)

  def dims(_params):  # the muon half's tree, as optax.partition hands it over
    return jax.tree.map(
        lambda n: optax.MaskedNode() if n is None else dimension_numbers(n), muon_names,
        is_leaf=lambda x: x is None or is_names(x))

  muon = optax.chain(
      optax_muon.scale_by_muon(ns_coeffs=jnp.asarray(V4_COEFFICIENTS),
                               ns_steps=len(V4_COEFFICIENTS), beta=train.muon_momentum,
                               nesterov=True, weight_dimension_numbers=dims),
      optax_muon.scale_by_shape(weight_dimension_numbers=dims, consistent_rms=RMS_LIKE_ADAMW),
      optax.add_decayed_weights(train.weight_decay),
      optax.scale_by_learning_rate(schedule))
  return optax.partition({"muon": muon, "adamw": adamw}, labels(names_tree))

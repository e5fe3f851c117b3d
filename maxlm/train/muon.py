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

**Spread over the slice.** optax runs the iteration on every matrix of a stacked parameter at
once, vmapped, wherever the parameter's shards lie: a matrix split over fsdp is gathered whole
on every fsdp device and all of a device's matrices iterate together. For V4-Flash's experts
(43 layers x 256 experts on 256 v5p chips) the TPU compiler asked 196.6 GiB a chip for that.
So ours lays each parameter's matrices out one matrix per device (the stacked matrices padded
to a multiple of the devices and split over every mesh axis, whole inside a device) before the
iteration and leaves the way back to the compiler, the layout of distributed Muon (Moonlight):
each device orthogonalises E x L / devices whole matrices, an all-to-all each way. The
momentum, Nesterov step and state are optax's, unchanged, so checkpoints are the same.
"""

import math

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


def transform(train, schedule, adamw, names_tree, mesh=None):
  """Muon on the matrices of `names_tree` (a params-shaped tree of logical-name tuples),
  `adamw` on the rest; `mesh`: the stage's, whose devices share the orthogonalisation."""
  is_names = lambda x: isinstance(x, tuple)  # noqa: E731
  muon_names = jax.tree.map(lambda n: n if dimension_numbers(n) is not None else None,
                            names_tree, is_leaf=is_names)

  def dims(_params):  # the muon half's tree, as optax.partition hands it over
    return jax.tree.map(
        lambda n: optax.MaskedNode() if n is None else dimension_numbers(n), muon_names,
        is_leaf=lambda x: x is None or is_names(x))

  muon = optax.chain(
      scale_by_spread_muon(train.muon_momentum, dims, mesh),
      optax_muon.scale_by_shape(weight_dimension_numbers=dims, consistent_rms=RMS_LIKE_ADAMW),
      optax.add_decayed_weights(train.weight_decay),
      optax.scale_by_learning_rate(schedule))
  return optax.partition({"muon": muon, "adamw": adamw}, labels(names_tree))


def scale_by_spread_muon(beta, dims, mesh):
  """optax's scale_by_muon (Nesterov momentum, V4's iteration, its state) with each matrix
  orthogonalised whole on one device of `mesh` (None: where it lies)."""
  base = optax_muon.scale_by_muon(ns_coeffs=jnp.asarray(V4_COEFFICIENTS),
                                  ns_steps=len(V4_COEFFICIENTS), beta=beta, nesterov=True,
                                  weight_dimension_numbers=dims)

  def update(updates, state, params=None):
    del params
    mu = optax.tree.update_moment(updates, state.mu, beta, 1)
    count = optax.safe_increment(state.count)
    mu_hat = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g,
                          optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                          optax.tree.bias_correction(updates, beta, count))
    out = jax.tree.map(lambda x, d: orthogonalize(x, d, state.ns_coeffs, mesh), mu_hat,
                       dims(updates),
                       is_leaf=lambda x: isinstance(x, optax_muon.MuonDimensionNumbers))
    return out, optax_muon.MuonState(count=count, mu=mu, ns_coeffs=state.ns_coeffs)
  return optax.GradientTransformation(base.init, update)


def orthogonalize(x, dims, coeffs, mesh):
  """optax's Newton-Schulz on each matrix of `x` (axes per `dims`), the matrices laid out
  whole and spread over `mesh`'s devices by their stacked axes (spread_spec)."""
  reduction, output = (tuple(a % x.ndim for a in axes) for axes in dims)
  batch = tuple(a for a in range(x.ndim) if a not in reduction + output)
  order = batch + reduction + output
  x = x.transpose(order)
  sizes = x.shape[:len(batch)]
  spec = spread_spec(sizes, mesh)
  if spec is not None:
    padded = [-(-n // _ways(mesh, axes)) * _ways(mesh, axes) for n, axes in zip(sizes, spec)]
    x = jnp.pad(x, [(0, p - n) for p, n in zip(padded, sizes)] + [(0, 0)] * (x.ndim - len(batch)))
    x = jax.lax.with_sharding_constraint(
        x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)))
  shape = x.shape
  fan = [math.prod(x.shape[len(batch):len(batch) + len(reduction)]),
         math.prod(x.shape[len(batch) + len(reduction):])]
  one = lambda m: optax_muon.orthogonalize_via_newton_schulz(m, coeffs, len(V4_COEFFICIENTS))
  for _ in batch:
    one = jax.vmap(one)
  y = one(x.reshape(*x.shape[:len(batch)], *fan)).reshape(shape)
  y = y[tuple(slice(0, n) for n in sizes)]
  return y.transpose(sorted(range(y.ndim), key=order.__getitem__))


def spread_spec(sizes, mesh):
  """Mesh axes for each stacked axis of these sizes (layers, experts, groups), every mesh axis
  of more than one device used once: on an axis it divides when there is one, else on the
  longest, which is padded. None when nothing is stacked or the mesh is one device."""
  axes = [n for n in (mesh.axis_names if mesh is not None else ()) if mesh.shape[n] > 1]
  if not sizes or not axes:
    return None
  spec = [() for _ in sizes]
  for axis in axes:
    fits = [i for i, n in enumerate(sizes)
            if n % (_ways(mesh, spec[i]) * mesh.shape[axis]) == 0]
    i = fits[0] if fits else max(range(len(sizes)), key=sizes.__getitem__)
    spec[i] = (*spec[i], axis)
  return [s or None for s in spec]


def _ways(mesh, axes):
  return math.prod(mesh.shape[a] for a in (axes or ()))

"""What mixture-of-experts layers add to training: the balancing bias in the train state, its
update, and the routing metrics of each MoE layer.

The bias is DeepSeek-V3's auxiliary-loss-free balancing (Wang et al. 2024, "Auxiliary-Loss-Free
Load Balancing Strategy for Mixture-of-Experts"): every MoE layer holds a per-expert bias
that is added to the router's scores for the top-k choice only (maxlm/model/moe.py). It is not
a parameter: it gets no gradient and no optimizer state. After each step, from that step's
load (tokens routed to each expert, summed over the whole global batch, every micro-batch of
gradient accumulation included):

  bias_e += bias_rate * sign(mean_e' load_e' - load_e)

so an overloaded expert's bias falls and an idle one's rises. It lives in the train state as
`state["moe_bias"]` (the model's "moe_bias" variable collection, stacked like the parameters)
only when `model.moe.experts > 0` and `model.moe.balance == "bias"`, so dense checkpoints are
unchanged; it is saved and restored with the rest of the state, so a resume is bitwise.

The layers sow their statistics into the "moe" collection (`load` [E], `aux_loss`, `z_loss`,
`dropped`, `entropy`); `build.loss_fn` returns that tree, the step sums it over micro-batches
and `metrics` turns it into one value per MoE layer for metrics.jsonl.
"""

import jax
import jax.numpy as jnp
import numpy as np

from maxlm.model import layers

BIAS = "moe_bias"  # the variable collection (and the train state's key)
STATS = "moe"  # the collection the layers sow their routing statistics into
SUMMED = ("load", "dropped")  # summed over micro-batches; the others are averaged


def enabled(model_cfg):
  """Whether the train state carries the balancing bias."""
  return model_cfg.moe.experts > 0 and model_cfg.moe.balance == "bias"


def _key(entry):
  return getattr(entry, "key", getattr(entry, "idx", entry))


def module_path(path):
  """The names of the modules above a leaf of a variable tree: the leaf's own name and the
  tuple index a sown value carries are dropped."""
  names = [_key(k) for k in path]
  while names and not isinstance(names[-1], str):
    names.pop()  # the tuple index of a sown value
  return tuple(names[:-1])


def init(abstract_bias):
  """Zeros shaped like the "moe_bias" collection of an abstract init (a tree of
  ShapeDtypeStruct), float32."""
  return jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, jnp.float32), abstract_bias)


def shardings(bias, mesh):
  """The bias is small ([layers, E] floats): replicated on every device."""
  return jax.tree_util.tree_map(
      lambda _: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), bias)


def by_module(stats, name):
  """{module path: the statistic `name`} from a (summed, unwrapped) "moe" collection."""
  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(stats):
    if _key(path[-1]) == name:
      out[module_path(path)] = leaf
  return out


def update(bias, stats, rate):
  """The bias after one step: bias += rate * sign(mean load - load), per MoE layer (stacked
  layers: per row). `stats` is the step's "moe" collection with loads summed over the step."""
  loads = by_module(stats, "load")

  def one(path, b):
    load = jnp.asarray(loads[module_path(path)], jnp.float32)
    mean = jnp.mean(load, axis=-1, keepdims=True)
    return b + jnp.float32(rate) * jnp.sign(mean - load)
  return jax.tree_util.tree_map_with_path(one, jax.lax.stop_gradient(bias))


def combine(a, b):
  """Two micro-batches' "moe" statistics: every statistic summed (`finish` turns the averaged
  ones back into means)."""
  return jax.tree_util.tree_map(jnp.add, a, b)


def finish(stats, micro_batches):
  """Summed statistics -> the step's: loads and drops stay sums, the rest become means."""
  def one(path, x):
    return x if _key(path[-1]) in SUMMED else x / micro_batches
  return jax.tree_util.tree_map_with_path(one, stats)


def layer_names(model_cfg):
  """{module path of an MoE layer's statistics: [its layer indices as names]}, one name per
  row of a scanned stack (maxlm/model/layers.py decides where each layer lives)."""
  index_trees = [{"moe": {"index": i}} if spec.moe else {}
                 for i, spec in enumerate(layers.specs(model_cfg))]
  tree = layers.from_per_layer(index_trees, model_cfg)
  return {module_path(path): [str(i) for i in np.atleast_1d(leaf)]
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def layer_rows(stats, layer_names):
  """[(layer name, {statistic: value of that layer})] for every MoE layer. `layer_names`
  maps a module path of the collection to the names of the layers it holds, one per row of
  its stacked statistics (a scanned group), or one name for an unstacked layer."""
  rows = []
  for path, names in layer_names.items():
    values = {_key(p[-1]): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(stats)
              if module_path(p) == path}
    stacked = values["load"].ndim == 2
    for i, name in enumerate(names):
      rows.append((name, {k: (v[i] if stacked else v) for k, v in values.items()}))
  return rows


def metrics(stats, layer_names, capacity):
  """The flat per-layer metrics of one step: moe/max_load_over_mean/<layer> (the busiest
  expert's load over the mean load), moe/entropy/<layer> (the router's mean entropy), in
  capacity mode moe/dropped/<layer> (token-expert assignments dropped); and the totals over
  layers moe/aux_loss and moe/z_loss (unweighted)."""
  out = {"moe/aux_loss": jnp.float32(0.0), "moe/z_loss": jnp.float32(0.0)}
  for name, v in layer_rows(stats, layer_names):
    load = jnp.asarray(v["load"], jnp.float32)
    out[f"moe/max_load_over_mean/{name}"] = jnp.max(load) / jnp.maximum(jnp.mean(load), 1e-9)
    if "entropy" in v:
      out[f"moe/entropy/{name}"] = v["entropy"]
    if capacity and "dropped" in v:
      out[f"moe/dropped/{name}"] = v["dropped"]
    for total in ("aux_loss", "z_loss"):
      if total in v:
        out[f"moe/{total}"] = out[f"moe/{total}"] + v[total]
  return out


def bias_spread(bias):
  """max - min of every layer's bias (a number for tests and tools)."""
  return max(float(np.ptp(np.asarray(b), axis=-1).max())
             for b in jax.tree_util.tree_leaves(bias))

"""What the indexer stages change in training: frozen main weights, a grown state, metrics.

- indexer_warmup: only the indexer's parameters train (those under an `indexer` module, or
  DeepSeek-V4's `index_q`, `index_weights` and `index_compressor`, maxlm/model/mqa.py). Their
  gradients alone enter the optimizer (clipping and grad_norm see only them), and the main
  parameters and their optimizer moments are carried over unchanged (weight decay would
  otherwise move them).
- A stage whose model has indexer parameters the state lacks (the first non-dense stage) adds
  them, initialised from the run's seed as a fresh init of that stage's model would, and grows
  the optimizer state by the same leaves; everything already there is kept bit for bit, so a
  resume across dense -> warm-up -> sparse is exact.
"""

import jax
import jax.numpy as jnp

from maxlm.model import build
from maxlm.train import update


INDEXER_MODULES = ("'indexer'", "'index_q'", "'index_weights'", "'index_compressor'")


def is_indexer(path):
  key = jax.tree_util.keystr(path)
  return any(name in key for name in INDEXER_MODULES)


def mode_of(model):
  sp = model.settings.sparse
  return "dense" if sp is None else sp.mode


def only_indexer(grads):
  return jax.tree_util.tree_map_with_path(
      lambda p, g: g if is_indexer(p) else jnp.zeros_like(g), grads)


def keep_main(new, old):
  """`new` with every leaf outside the indexer taken from `old` (same structure)."""
  return jax.tree_util.tree_map_with_path(lambda p, n, o: n if is_indexer(p) else o, new, old)


def keep_main_opt(new_opt, old_opt):
  """The optimizer state with the main parameters' moments unchanged; counters advance."""
  def pick(p, n, o):
    if is_indexer(p) or n.ndim == 0:
      return n
    return o
  return jax.tree_util.tree_map_with_path(pick, new_opt, old_opt)


def freeze(model):
  """The update's Freeze in an indexer warm-up stage (only the indexer trains), else None."""
  if mode_of(model) != "indexer_warmup":
    return None
  return update.Freeze(
      grads=only_indexer,
      keep=lambda new, old, new_opt, old_opt: (keep_main(new, old),
                                               keep_main_opt(new_opt, old_opt)))


def _merge(fresh, old):
  """`fresh` with the leaves whose paths `old` also has taken from `old`."""
  have = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(old)}
  return jax.tree_util.tree_map_with_path(
      lambda p, x: have.get(jax.tree_util.keystr(p), x), fresh)


def grow(state, model, opt, mesh, rules, seed, seq_len, shardings):
  """The state with the stage model's missing (indexer) parameters and their optimizer state
  added; the state itself when nothing is missing."""
  want = build.abstract_params(model, seq_len)
  if (jax.tree_util.tree_structure(want)
      == jax.tree_util.tree_structure(state["params"])):
    return state
  fresh = build.init_params(model, jax.random.key(seed), mesh, rules, seq_len)
  params = jax.device_put(_merge(fresh, state["params"]), shardings["params"])
  with mesh:
    opt_state = _merge(jax.jit(opt.init, out_shardings=shardings["opt_state"])(params),
                       state["opt_state"])
  return {**state, "params": params, "opt_state": opt_state}


METRICS = {"indexer_kl": ("kl", "queries"), "indexer_recall": ("recall", "recall_queries"),
           "selected_keys": ("selected", "queries")}


def metrics(sums):
  """Per-query means over layers from build.loss_fn's indexer sums (those present); recall is
  over the queries it was measured on (all in warm-up, sampled blocks in sparse mode)."""
  return {name: sums[f"indexer_{key}_sum"] / jnp.maximum(sums[f"indexer_{over}_sum"], 1.0)
          for name, (key, over) in METRICS.items()
          if f"indexer_{key}_sum" in sums and f"indexer_{over}_sum" in sums}


def sum_keys(model):
  """The indexer sums build.loss_fn returns for this stage's model."""
  mode = mode_of(model)
  if mode == "dense":
    return ()
  sp = model.settings.sparse
  measured = not model.cfg.mqa.enabled and (
      mode == "indexer_warmup" or (sp.select == "block" and sp.recall_blocks > 0))
  keys = ("kl", "selected", "queries") + (("recall", "recall_queries") if measured else ())
  return tuple(f"indexer_{k}_sum" for k in keys)

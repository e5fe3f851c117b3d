"""From config to a runnable model: sharded parameters, the loss, and FLOPs per token."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from maxlm.model import loss as loss_lib, mtp as mtp_lib, sharding
from maxlm.model.transformer import Decoder, Settings


def model_for(config, stage_index, mesh=None, vocab_size=None, platform=None):
  """The Decoder for one stage (the stage sets RoPE, attention impl and tiles) on `platform`
  (cpu, tpu or gpu; default this process's backend), which picks the implementations."""
  cfg = config.model
  if vocab_size is not None:
    cfg = dataclasses.replace(cfg, vocab_size=vocab_size)
  if cfg.vocab_size <= 0:
    raise ValueError("model.vocab_size is unresolved; pass the tokenizer's vocab size")
  stage = config.stages[stage_index]
  settings = Settings(rope=stage.rope, impl=stage.attention, block_q=stage.block_q,
                      block_k=stage.block_k, mesh=mesh, rules=dict(config.rules),
                      sparse=stage.sparse, platform=platform)
  return Decoder(cfg, settings)


def _dummy(model, seq_len):
  """A batch shaped so every mesh axis divides it (init traces the sharded attention too)."""
  s = model.settings
  batch = 1
  if s.mesh is not None:
    batch = int(np.prod([s.mesh.shape[a] for a in s.rules.get("batch", ())]))
  z = jnp.zeros((batch, seq_len), jnp.int32)
  return z, z, z + 1


_ABSTRACT = {}  # (id(model), seq_len) -> (model, its abstract variables)


def abstract_variables(model, seq_len=8):
  """jax.eval_shape of model.init, boxed with logical axis names. Traced once per model object
  and length: tracing a scanned model's init takes about a second on a CPU, and a stage asks for
  it four times (shardings, parameter shapes, the MoE bias, the sparse stage's growth)."""
  key = (id(model), seq_len)
  hit = _ABSTRACT.get(key)
  if hit is None or hit[0] is not model:
    if len(_ABSTRACT) >= 32:
      _ABSTRACT.clear()
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), *_dummy(model, seq_len)))
    hit = _ABSTRACT[key] = (model, variables)
  return hit[1]


def abstract_params(model, seq_len=8):
  """The parameters' shapes and dtypes (jax.ShapeDtypeStruct leaves), unboxed."""
  return nn.meta.unbox(abstract_variables(model, seq_len)["params"])


def param_shardings(model, mesh, rules, seq_len=8):
  abstract = abstract_variables(model, seq_len)
  specs = nn.get_partition_spec(abstract)
  return nn.logical_to_mesh_sharding(specs, mesh, sharding.rules_list(rules))["params"]


def param_axes(config, vocab_size):
  """(path, shape, logical axis names) of every parameter, from an abstract init."""
  cfg = dataclasses.replace(config.model, vocab_size=vocab_size)
  model = Decoder(cfg, Settings(rope=config.stages[0].rope, impl="reference"))
  boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), *_dummy(model, 8)))["params"]
  leaves = jax.tree_util.tree_leaves_with_path(
      boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
  return [("/".join(str(getattr(k, "key", k)) for k in path), leaf.value.shape, leaf.names)
          for path, leaf in leaves]


def param_names(model, seq_len=8):
  """The params-shaped tree of each parameter's logical axis names (tuples)."""
  boxed = abstract_variables(model, seq_len)["params"]
  return jax.tree_util.tree_map(lambda leaf: tuple(leaf.names), boxed,
                                is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))


def init_params_abstract(model, seq_len=8):
  """Unboxed parameters, for tracing under jax.eval_shape (no arrays are made)."""
  return nn.meta.unbox(model.init(jax.random.key(0), *_dummy(model, seq_len))["params"])


def abstract_collection(model, name, seq_len=8):
  """The variable collection `name` of an abstract init, unboxed ({} if the model has none)."""
  return nn.meta.unbox(abstract_variables(model, seq_len).get(name, {}))


def init_params(model, rng, mesh, rules, seq_len=8):
  """Parameters initialised directly into their shardings (no host copy of the whole model)."""
  shardings = param_shardings(model, mesh, rules, seq_len)

  def init(key):
    with nn.logical_axis_rules(sharding.rules_list(rules)):
      return nn.meta.unbox(model.init(key, *_dummy(model, seq_len))["params"])

  with mesh:  # not jax.set_mesh: flax's scanned logical params then mis-rank their specs
    return jax.jit(init, out_shardings=shardings)(rng)


def loss_fn(model, params, batch, rules, *, chunk, z_loss=0.0, moe_bias=None):
  """(loss, aux) for one batch: aux has the NLL sum, loss count and max attention logit, in
  indexer stages the indexer's sums (`sparse_sums`; its weighted KL is in aux["total"]), and
  under MoE the layers' sown routing statistics (aux["moe"], unwrapped; {} for a dense model).

  MoE adds `moe.aux_loss x (load-balancing loss summed over MoE layers) + moe.router_z_loss x
  (router z-loss summed over MoE layers)` to the loss: both are means over this batch's
  tokens, so they enter aux["total"] (a sum over loss positions) times the loss count.
  `moe_bias`: the train state's balancing bias (maxlm/model/moe_state.py), or None."""
  sp = model.settings.sparse
  indexed = sp is not None and sp.mode != "dense"
  moe = model.cfg.moe
  mutable = ((["sparse"] if indexed else []) + (["moe"] if moe.experts > 0 else [])
             + (["mtp"] if model.cfg.mtp.depth else []))
  variables = {"params": params, **({"moe_bias": moe_bias} if moe_bias is not None else {})}
  with nn.logical_axis_rules(sharding.rules_list(rules)):
    result = model.apply(variables, batch["inputs"], batch["positions"],
                         batch["segment_ids"], mutable=mutable or False)
    (h, head, peak), sown = result if mutable else (result, {})
    loss, sums = loss_lib.chunked_cross_entropy(h, head, batch["targets"], batch["loss_mask"],
                                                chunk=chunk, z_loss=z_loss)
    if model.cfg.mtp.depth:
      loss, sums = _with_mtp(loss, sums, sown["mtp"]["hidden"][0], head, batch, chunk,
                             model.cfg.mtp.weight)
  if indexed:
    extra = sparse_sums(sown["sparse"])
    sums = {**sums, **extra, "total": sums["total"] + sp.kl_weight * extra["indexer_kl_sum"]
            / model.cfg.n_layers}
  if moe.experts > 0:
    stats = moe_stats(sown.get("moe", {}))
    added = moe_loss(stats, moe)
    sums = {**sums, "moe": stats, "total": sums["total"] + added * sums["count"]}
    loss = loss + added
  return loss, {**sums, "max_logit": peak}


def _with_mtp(loss, sums, h_BxLxD, head_DxV, batch, chunk, weight):
  """The main loss plus `weight` x the MTP NLL summed over its positions and divided by the
  main loss's count (so the sum over micro-batches is exact); sums gain `mtp_nll` and
  `mtp_count` for the metric (maxlm/model/mtp.py)."""
  targets_BxL, mask_BxL = mtp_lib.targets_and_mask(batch["targets"], batch["loss_mask"],
                                                   batch["segment_ids"])
  _, extra = loss_lib.chunked_cross_entropy(h_BxLxD, head_DxV, targets_BxL, mask_BxL,
                                            chunk=chunk)
  added = jnp.float32(weight) * extra["total"]
  return (loss + added / jnp.maximum(sums["count"], 1.0),
          {**sums, "total": sums["total"] + added, "mtp_nll": extra["nll"],
           "mtp_count": extra["count"]})


def moe_stats(sown):
  """The "moe" collection with every sown tuple replaced by its value (float32)."""
  def one(x):
    x = sum(x[1:], x[0]) if isinstance(x, tuple) else x
    return jnp.asarray(x, jnp.float32)
  return jax.tree_util.tree_map(one, sown, is_leaf=lambda x: isinstance(x, tuple))


def moe_loss(stats, moe):
  """aux_loss x sum of the layers' balancing losses + router_z_loss x sum of their z-losses."""
  total = jnp.float32(0.0)
  for name, weight in (("aux_loss", moe.aux_loss), ("z_loss", moe.router_z_loss)):
    if weight:
      for path, leaf in jax.tree_util.tree_leaves_with_path(stats):
        if getattr(path[-1], "key", None) == name:
          total = total + jnp.float32(weight) * jnp.sum(leaf)
  return total


def sparse_sums(sown):
  """The indexer's sums over layers: indexer_{kl,selected,queries[,recall]}_sum."""
  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(sown):
    name = [getattr(k, "key", None) for k in path if isinstance(getattr(k, "key", None), str)][-1]
    out[f"indexer_{name}_sum"] = out.get(f"indexer_{name}_sum", 0.0) + jnp.sum(leaf)
  return out


def count_params(params):
  return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))


def flops_per_token(cfg, seq_len, attended=None, attended_local=None):
  """Training FLOPs (forward + backward) per token, of the ACTIVE parameters.

  6 per weight multiply-add of every matmul a token goes through (the head included, the
  embedding lookup not): in an MoE layer the router, its top_k routed experts and the shared
  experts, not the experts it is not routed to. Plus attention: QK^T and PV each cost
  2 * heads * head_dim per visible key, times 3 for the backward. `attended` is the mean number
  of keys a query of a global layer sees: (L + 1) / 2 for a causal row, or `mean_attended` of a
  packed batch; `attended_local` the same for the local (sliding-window) layers, by default
  that of a causal row of length L under model.attention.window.
  """
  from maxlm.model import layers
  attended = (seq_len + 1) / 2 if attended is None else attended
  window = cfg.attention.window
  if attended_local is None:
    attended_local = _causal_attended(seq_len, window) if window else attended
  d, hd = cfg.d_model, cfg.head_dim
  matmul, attention = d * cfg.vocab_size, 0.0
  for spec in layers.specs(cfg):
    matmul += d * hd * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) + mlp_weights(cfg, spec.moe,
                                                                            active=True)
    attention += 4 * cfg.n_heads * hd * (attended_local if spec.window else attended)
  return 6 * matmul + 3 * attention


def mlp_weights(cfg, moe_layer, active):
  """Weights of one layer's MLP: the dense SwiGLU's 3 D F, or an MoE layer's router D E plus
  3 D F_e for each of its experts (active: only the top_k routed and the shared ones)."""
  d, moe = cfg.d_model, cfg.moe
  if not moe_layer:
    return 3 * d * cfg.d_ff
  f = moe.d_ff or cfg.d_ff
  experts = (moe.top_k if active else moe.experts) + moe.shared_experts
  return d * moe.experts + 3 * d * f * experts


def active_params(cfg, total):
  """Parameters a token goes through, from the model's total count: every MoE layer's
  (experts - top_k) routed experts it is not sent to are left out."""
  from maxlm.model import layers
  moe_layers = sum(spec.moe for spec in layers.specs(cfg))
  unused = mlp_weights(cfg, True, active=False) - mlp_weights(cfg, True, active=True)
  return total - moe_layers * unused


def batch_flops_per_token(cfg, seq_len, segment_ids):
  """flops_per_token of a packed batch: keys seen per query counted per document."""
  window = cfg.attention.window
  return flops_per_token(cfg, seq_len, mean_attended(segment_ids),
                         mean_attended(segment_ids, window) if window else None)


def _causal_attended(length, window):
  return _keys_seen(np.array([length]), window) / length


def _keys_seen(counts, window=0):
  """Keys seen by all queries of documents of these lengths: n(n+1)/2 each, or under a
  window W (a query sees itself and the W - 1 positions before it) W(W+1)/2 + (n - W) W."""
  counts = np.asarray(counts, np.int64)
  if not window:
    return int((counts * (counts + 1) // 2).sum())
  w = np.minimum(counts, window)
  return int((w * (w + 1) // 2 + (counts - w) * window).sum())


def mean_attended(segment_ids, window=0):
  """Mean keys seen per non-padding query in a packed batch (within its own document, and
  under a sliding window the last `window` positions of it)."""
  seg = np.asarray(segment_ids)
  total, tokens = 0, 0
  for row in seg:
    _, counts = np.unique(row[row > 0], return_counts=True)
    total += _keys_seen(counts, window)
    tokens += int(counts.sum())
  return total / max(tokens, 1)

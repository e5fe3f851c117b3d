"""From config to a runnable model: sharded parameters, the loss, and FLOPs per token."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from maxlm.model import loss as loss_lib
from maxlm.model.transformer import Decoder, Settings
from maxlm.parallel import mesh as mesh_lib


def model_for(config, stage_index, mesh=None, vocab_size=None):
  """The Decoder for one stage (the stage sets RoPE, attention impl and tiles)."""
  cfg = config.model
  if vocab_size is not None:
    cfg = dataclasses.replace(cfg, vocab_size=vocab_size)
  if cfg.vocab_size <= 0:
    raise ValueError("model.vocab_size is unresolved; pass the tokenizer's vocab size")
  stage = config.stages[stage_index]
  settings = Settings(rope=stage.rope, impl=stage.attention, block_q=stage.block_q,
                      block_k=stage.block_k, mesh=mesh, rules=dict(config.rules),
                      sparse=stage.sparse)
  return Decoder(cfg, settings)


def _dummy(model, seq_len):
  """A batch shaped so every mesh axis divides it (init traces the sharded attention too)."""
  s = model.settings
  batch = 1
  if s.mesh is not None:
    batch = int(np.prod([s.mesh.shape[a] for a in s.rules.get("batch", ())]))
  z = jnp.zeros((batch, seq_len), jnp.int32)
  return z, z, z + 1


def param_shardings(model, mesh, rules, seq_len=8):
  abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), *_dummy(model, seq_len)))
  specs = nn.get_partition_spec(abstract)
  return nn.logical_to_mesh_sharding(specs, mesh, mesh_lib.rules_list(rules))["params"]


def param_axes(config, vocab_size):
  """(path, shape, logical axis names) of every parameter, from an abstract init."""
  cfg = dataclasses.replace(config.model, vocab_size=vocab_size)
  model = Decoder(cfg, Settings(rope=config.stages[0].rope, impl="reference"))
  boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), *_dummy(model, 8)))["params"]
  leaves = jax.tree_util.tree_leaves_with_path(
      boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
  return [("/".join(str(getattr(k, "key", k)) for k in path), leaf.value.shape, leaf.names)
          for path, leaf in leaves]


def init_params_abstract(model, seq_len=8):
  """Unboxed parameters, for tracing under jax.eval_shape (no arrays are made)."""
  return nn.meta.unbox(model.init(jax.random.key(0), *_dummy(model, seq_len))["params"])


def init_params(model, rng, mesh, rules, seq_len=8):
  """Parameters initialised directly into their shardings (no host copy of the whole model)."""
  shardings = param_shardings(model, mesh, rules, seq_len)

  def init(key):
    with nn.logical_axis_rules(mesh_lib.rules_list(rules)):
      return nn.meta.unbox(model.init(key, *_dummy(model, seq_len))["params"])

  with mesh:  # not jax.set_mesh: flax's scanned logical params then mis-rank their specs
    return jax.jit(init, out_shardings=shardings)(rng)


def loss_fn(model, params, batch, rules, *, chunk, z_loss=0.0):
  """(loss, aux) for one batch: aux has the NLL sum, loss count and max attention logit, and in
  indexer stages the indexer's sums (`sparse_sums`; its weighted KL is in aux["total"])."""
  sp = model.settings.sparse
  indexed = sp is not None and sp.mode != "dense"
  with nn.logical_axis_rules(mesh_lib.rules_list(rules)):
    result = model.apply({"params": params}, batch["inputs"], batch["positions"],
                         batch["segment_ids"], mutable=["sparse"] if indexed else False)
    (h, head, peak), sown = result if indexed else (result, None)
    loss, sums = loss_lib.chunked_cross_entropy(h, head, batch["targets"], batch["loss_mask"],
                                                chunk=chunk, z_loss=z_loss)
  if indexed:
    extra = sparse_sums(sown["sparse"])
    sums = {**sums, **extra, "total": sums["total"] + sp.kl_weight * extra["indexer_kl_sum"]
            / model.cfg.n_layers}
  return loss, {**sums, "max_logit": peak}


def sparse_sums(sown):
  """The indexer's sums over layers: indexer_{kl,selected,queries[,recall]}_sum."""
  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(sown):
    name = [getattr(k, "key", None) for k in path if isinstance(getattr(k, "key", None), str)][-1]
    out[f"indexer_{name}_sum"] = out.get(f"indexer_{name}_sum", 0.0) + jnp.sum(leaf)
  return out


def count_params(params):
  return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))


def flops_per_token(cfg, seq_len, attended=None):
  """Training FLOPs (forward + backward) per token.

  6 per weight multiply-add of every matmul (the head included, the embedding lookup not),
  plus attention: QK^T and PV each cost 2 * heads * head_dim per visible key, times 3 for the
  backward. `attended` is the mean number of keys a query sees: (L + 1) / 2 for a causal row,
  or `mean_attended(segment_ids)` for a packed batch.
  """
  attended = (seq_len + 1) / 2 if attended is None else attended
  d, hd = cfg.d_model, cfg.head_dim
  per_layer = d * hd * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) + 3 * d * cfg.d_ff
  matmul = cfg.n_layers * per_layer + d * cfg.vocab_size
  attention = cfg.n_layers * 4 * cfg.n_heads * hd * attended
  return 6 * matmul + 3 * attention


def mean_attended(segment_ids):
  """Mean keys seen per non-padding query in a packed batch: sum n(n+1)/2 over segments / n."""
  seg = np.asarray(segment_ids)
  total, tokens = 0, 0
  for row in seg:
    _, counts = np.unique(row[row > 0], return_counts=True)
    total += int((counts * (counts + 1) // 2).sum())
    tokens += int(counts.sum())
  return total / max(tokens, 1)

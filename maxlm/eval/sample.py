"""Batched sampling on device: many prompts x n samples, one prefill, the decode loop in jit.

Rows are prompt-major (row = prompt * n_samples + sample). Prompts of different lengths are
left-padded to one length P, so every row's last prompt token sits at slot P-1 and the KV cache
has one write index for all rows; padding slots have segment id 0, which the decoder's cache
path (`Attention._cached`) never attends, and positions restart at 0 at each prompt's first
token, so a row computes what the one-sequence sampler computes for its prompt alone. Then a
`lax.while_loop` decodes one token per row per step until every row has emitted EOS or
`max_new_tokens` are out, all inside one jitted function: no host round trip per token.

Randomness: row r's key is fold_in(fold_in(key(seed), prompt index), sample index) and step t
uses fold_in(row key, t), so a seed reproduces every sample and a row's sample does not depend
on which other rows share the batch (pass `prompt_indices` to keep a prompt's index when
batching a subset). A token is drawn from softmax(logits / temperature) restricted to the
top-k logits and then to the smallest set of likeliest tokens whose mass reaches top_p
(`choose`); temperature 0 is greedy (argmax).

`logprobs` are log softmax(logits)[token]: the model's unscaled distribution at temperature 1,
with no top-k/top-p restriction, which is what a policy-gradient ratio (train/grpo.py) needs.
Tokens after a row's EOS are PAD (0) with log-prob 0; `lengths` count the tokens up to and
including EOS.

Our own loop rather than a serving library: it runs the Decoder's own decode path (so local
windows and MoE layers come with the model) under the run's mesh and logical rules.
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from maxlm import MaxlmError
from maxlm.eval.generate import SEEDS
from maxlm.model import layers as layers_lib, sharding

PAD = 0
BUCKET = 8  # prompt lengths are padded up to a multiple of this, so fewer shapes compile


def row_keys(seed, prompt_indices, n_samples):
  """[len(prompt_indices) * n_samples, 2] uint32: each row's threefry key data."""
  if not 0 <= seed < SEEDS:
    raise MaxlmError(f"seed must be in [0, 2**64), got {seed}")
  base = jax.random.wrap_key_data(np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32),
                                  impl="threefry2x32")
  prompts = jnp.repeat(jnp.asarray(prompt_indices, jnp.uint32), n_samples)
  samples = jnp.tile(jnp.arange(n_samples, dtype=jnp.uint32), len(prompt_indices))
  fold = jax.vmap(lambda p, s: jax.random.fold_in(jax.random.fold_in(base, p), s))
  return np.asarray(jax.random.key_data(fold(prompts, samples)))


def left_pad(prompts, n_samples, bucket=BUCKET):
  """(tokens [N, P] int32 left-padded with PAD, prompt lengths [N]) with each prompt repeated
  n_samples times; P is the longest prompt rounded up to a multiple of `bucket`."""
  if not prompts or any(len(p) == 0 for p in prompts):
    raise MaxlmError("every prompt needs at least one token (BOS)")
  longest = max(len(p) for p in prompts)
  width = -(-longest // bucket) * bucket
  tokens = np.full((len(prompts) * n_samples, width), PAD, np.int32)
  lengths = np.repeat(np.array([len(p) for p in prompts], np.int32), n_samples)
  for i, p in enumerate(prompts):
    tokens[i * n_samples:(i + 1) * n_samples, width - len(p):] = p
  return tokens, lengths


def nucleus(sorted_NxK, top_p):
  """Logits sorted in descending order, with every token after the smallest prefix whose
  probability mass reaches top_p at -inf (the first token is always kept)."""
  if top_p >= 1.0:
    return sorted_NxK
  probs_NxK = jax.nn.softmax(sorted_NxK, axis=-1)
  before_NxK = jnp.cumsum(probs_NxK, axis=-1) - probs_NxK  # the mass of the likelier tokens
  keep_NxK = (before_NxK < top_p).at[:, 0].set(True)
  return jnp.where(keep_NxK, sorted_NxK, -jnp.inf)


TINY_TEMPERATURE = float(np.finfo(np.float32).tiny)  # the CPU flushes smaller divisors to 0


def choose(logits_NxV, keys_N, temperature, top_k=0, top_p=1.0):
  """[N] int32: one token per row (argmax at temperature 0).

  Sampled by inverse CDF, one uniform per row, over the top-k logits only when top_k > 0: a
  draw costs O(V) and k random numbers' worth of work instead of V Gumbel draws (which made
  sampling 6x slower than the model's step on CPU). top_k keeps exactly k tokens (ties by the
  lower id)."""
  if temperature < TINY_TEMPERATURE:  # 0: greedy; below float32's normals, its limit
    return jnp.argmax(logits_NxV, axis=-1).astype(jnp.int32)
  logits_NxV = logits_NxV.astype(jnp.float32)
  shifted_NxV = logits_NxV - jnp.max(logits_NxV, axis=-1, keepdims=True)  # <= 0: no inf - inf
  scaled_NxV = shifted_NxV / temperature  # a tiny temperature then tends to greedy, not to NaN
  if top_k:
    values_NxK, ids_NxK = jax.lax.top_k(scaled_NxV, top_k)
  elif top_p < 1.0:
    ids_NxK = jnp.argsort(-scaled_NxV, axis=-1)
    values_NxK = jnp.take_along_axis(scaled_NxV, ids_NxK, axis=-1)
  else:
    values_NxK, ids_NxK = scaled_NxV, None
  probs_NxK = jax.nn.softmax(nucleus(values_NxK, top_p), axis=-1)
  cdf_NxK = jnp.cumsum(probs_NxK, axis=-1)
  u_N = jax.vmap(jax.random.uniform)(keys_N) * cdf_NxK[:, -1]
  at_N = jnp.argmax(cdf_NxK > u_N[:, None], axis=-1)  # none (u rounded up to 1): the likeliest
  if ids_NxK is None:
    return at_N.astype(jnp.int32)
  return jnp.take_along_axis(ids_NxK, at_N[:, None], axis=-1)[:, 0].astype(jnp.int32)


def make_generate(model, *, max_new_tokens, temperature, top_k=0, top_p=1.0, eos_id=None):
  """A jitted fn(params, tokens_NxP, prompt_lengths_N, keys_Nx2, collections=None) ->
  (tokens_NxT int32, lengths_N int32, logprobs_NxT float32), T = max_new_tokens; inputs as
  `left_pad` and `row_keys` make them; `collections`: the model's other variable collections
  (e.g. {"moe_bias": state["moe_bias"]}, so MoE routing matches training). Build it once and
  call it for every batch (a new prompt width or row count retraces)."""
  init_cache, forward, layout = (_recomputing(model) if model.cfg.mqa.enabled
                                 else _cached(model))
  eos = -1 if eos_id is None else int(eos_id)

  def generate(params, tokens_NxP, prompt_lengths_N, keys_Nx2, collections=None):
    variables = {name: layout(tree)
                 for name, tree in {**(collections or {}), "params": params}.items()}
    n, p = tokens_NxP.shape
    cache = init_cache(variables, n, p + max_new_tokens)
    pad_N = p - prompt_lengths_N
    slots_NxP = jnp.arange(p, dtype=jnp.int32)[None] - pad_N[:, None]
    logits_NxV, cache = forward(variables, cache, tokens_NxP, jnp.maximum(slots_NxP, 0),
                                (slots_NxP >= 0).astype(jnp.int32))
    keys_N = jax.random.wrap_key_data(keys_Nx2, impl="threefry2x32")

    def body(state):
      t, cache, logits_NxV, done_N, out_NxT, logp_NxT, lengths_N = state
      step_keys_N = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys_N, t)
      token_N = choose(logits_NxV, step_keys_N, temperature, top_k, top_p)
      logp_N = jnp.take_along_axis(jax.nn.log_softmax(logits_NxV, axis=-1), token_N[:, None],
                                   axis=-1)[:, 0]
      live_N = ~done_N
      out_NxT = out_NxT.at[:, t].set(jnp.where(live_N, token_N, PAD))
      logp_NxT = logp_NxT.at[:, t].set(jnp.where(live_N, logp_N, 0.0))
      lengths_N = lengths_N + live_N.astype(jnp.int32)
      done_N = done_N | (token_N == eos)
      logits_NxV, cache = forward(variables, cache, token_N[:, None],
                                  (prompt_lengths_N + t)[:, None], jnp.ones((n, 1), jnp.int32))
      return t + 1, cache, logits_NxV, done_N, out_NxT, logp_NxT, lengths_N

    def cond(state):
      return (state[0] < max_new_tokens) & ~jnp.all(state[3])

    state = (jnp.int32(0), cache, logits_NxV, jnp.zeros((n,), bool),
             jnp.full((n, max_new_tokens), PAD, jnp.int32),
             jnp.zeros((n, max_new_tokens), jnp.float32), jnp.zeros((n,), jnp.int32))
    _, _, _, _, out_NxT, logp_NxT, lengths_N = jax.lax.while_loop(cond, body, state)
    return out_NxT, lengths_N, logp_NxT

  return jax.jit(generate)


def _cached(model):
  """(init_cache, forward, layout) of sampling with the decoder's key-value cache: each step
  runs the new tokens alone against the cached keys and values of every layer."""
  decoder = model.clone(cfg=dataclasses.replace(model.cfg, scan_layers=False), decode=True)

  def init_cache(variables, n, length):
    ones = jnp.ones((n, length), jnp.int32)
    shapes = jax.eval_shape(lambda: decoder.init(jax.random.key(0), ones, ones, ones))
    return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["cache"])

  def forward(variables, cache, tokens_NxL, positions_NxL, segments_NxL):
    (h, head, _), state = decoder.apply({**variables, "cache": cache}, tokens_NxL,
                                        positions_NxL, segments_NxL, mutable=["cache"])
    return h[:, -1].astype(jnp.float32) @ head.astype(jnp.float32), state["cache"]

  return init_cache, forward, lambda tree: unrolled(tree, model.cfg)


def _recomputing(model):
  """(init_cache, forward, layout) of sampling DeepSeek-V4's attention (model.mqa) without a
  key-value cache of its compressed entries: the "cache" is the rows' tokens, positions and
  segment ids so far, and each step runs the training forward over all of them and reads the
  logits of the last one written. Slots not yet written are segment 0, which no query sees
  and no compressed entry takes in, so step t computes exactly what a forward over the first
  t tokens computes; the cost per token grows with the sequence (one whole forward)."""

  def init_cache(variables, n, length):
    del variables
    zeros = jnp.zeros((n, length), jnp.int32)
    return {"tokens": zeros, "positions": zeros, "segments": zeros, "index": jnp.int32(0)}

  def forward(variables, cache, tokens_NxL, positions_NxL, segments_NxL):
    i = cache["index"]
    cache = {**{name: jax.lax.dynamic_update_slice(cache[name], new.astype(jnp.int32), (0, i))
                for name, new in (("tokens", tokens_NxL), ("positions", positions_NxL),
                                  ("segments", segments_NxL))},
             "index": i + tokens_NxL.shape[1]}
    h, head, _ = model.apply(variables, cache["tokens"], cache["positions"], cache["segments"])
    last_NxD = jax.lax.dynamic_index_in_dim(h, cache["index"] - 1, axis=1, keepdims=False)
    return last_NxD.astype(jnp.float32) @ head.astype(jnp.float32), cache

  return init_cache, forward, lambda tree: tree


def unrolled(tree, cfg):
  """A params-shaped tree (the parameters, the MoE bias) with its layers as `layer_{i}`, the
  layout of scan_layers false. The sampler decodes unrolled: scanned, XLA's CPU backend copies
  the stacked KV cache every layer of every step (10x slower at 128 rows, tools/bench_sample.py);
  the slices are taken inside the jitted function."""
  if not cfg.scan_layers:
    return tree
  out = {k: v for k, v in tree.items() if k not in layers_lib.layer_names(cfg)}
  for i, (top, block, index) in enumerate(layers_lib.locations(cfg)):
    sub = tree.get(top, {})
    sub = sub.get(block, {}) if block is not None else sub
    if sub:  # a collection (the MoE bias) holds only some layers
      out[f"layer_{i}"] = jax.tree_util.tree_map(lambda x, i=index: x[i], sub)
  return out


@functools.lru_cache(maxsize=8)
def _compiled(model_ref, max_new_tokens, temperature, top_k, top_p, eos_id):
  return make_generate(model_ref.model, max_new_tokens=max_new_tokens, temperature=temperature,
                       top_k=top_k, top_p=top_p, eos_id=eos_id)


class _ById:
  """A model as a cache key by identity (its Settings hold a dict, so it does not hash)."""

  def __init__(self, model):
    self.model = model

  def __hash__(self):
    return id(self.model)

  def __eq__(self, other):
    return self.model is other.model


def _shard_rows(arrays, mesh, rules):
  """Rows padded to a multiple of the mesh's batch shards and placed split over them."""
  axes = tuple(rules.get("batch", ()))
  shards = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
  n = arrays[0].shape[0]
  extra = -n % shards
  out = []
  for a in arrays:
    a = np.concatenate([a, np.repeat(a[:1], extra, axis=0)]) if extra else a
    spec = P(axes or None, *([None] * (a.ndim - 1)))
    out.append(jax.device_put(a, NamedSharding(mesh, spec)))
  return out


def generate_arrays(model, params, prompts, *, n_samples, max_new_tokens, temperature,
                    top_k=0, top_p=1.0, seed=0, eos_id=None, mesh=None, rules=None,
                    prompt_indices=None, collections=None):
  """(tokens [N, T], lengths [N], logprobs [N, T]) as numpy arrays, N = len(prompts) *
  n_samples prompt-major; see the module docstring for what each holds."""
  check(n_samples, max_new_tokens, temperature, top_k, top_p, model.cfg.vocab_size)
  indices = range(len(prompts)) if prompt_indices is None else prompt_indices
  if len(indices) != len(prompts):
    raise MaxlmError(f"{len(indices)} prompt indices for {len(prompts)} prompts")
  tokens, lengths = left_pad(prompts, n_samples)
  keys = row_keys(seed, indices, n_samples)
  fn = _compiled(_ById(model), max_new_tokens, float(temperature), int(top_k), float(top_p),
                 eos_id)
  n = tokens.shape[0]
  if mesh is None:
    out = fn(params, tokens, lengths, keys, collections)
  else:
    rules = model.settings.rules if rules is None else rules
    with mesh, nn.logical_axis_rules(sharding.rules_list(rules or {})):
      out = fn(params, *_shard_rows([tokens, lengths, keys], mesh, rules or {}), collections)
  return tuple(np.asarray(jax.device_get(a))[:n] for a in out)


def sample_batch(model, params, prompts, *, n_samples, max_new_tokens, temperature, top_k=0,
                 top_p=1.0, seed=0, eos_id=None, mesh=None, rules=None, prompt_indices=None,
                 collections=None):
  """Per prompt, n_samples completions (token lists without the prompt, ending at and
  including EOS when one was sampled)."""
  tokens, lengths, _ = generate_arrays(
      model, params, prompts, n_samples=n_samples, max_new_tokens=max_new_tokens,
      temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, eos_id=eos_id, mesh=mesh,
      rules=rules, prompt_indices=prompt_indices, collections=collections)
  rows = [tokens[r, :lengths[r]].tolist() for r in range(tokens.shape[0])]
  return [rows[i * n_samples:(i + 1) * n_samples] for i in range(len(prompts))]


def check(n_samples, max_new_tokens, temperature, top_k, top_p, vocab=None):
  """One line for a setting the batched sampler cannot honour."""
  if n_samples < 1:
    raise MaxlmError(f"n_samples must be >= 1, got {n_samples}")
  if max_new_tokens < 1:
    raise MaxlmError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  if not (np.isfinite(temperature) and temperature >= 0):
    raise MaxlmError(f"temperature must be a finite number >= 0 (0 is greedy), got "
                     f"{temperature}")
  if top_k < 0 or vocab is not None and top_k > vocab:
    raise MaxlmError(f"top_k must be in [0, {vocab or 'the vocabulary size'}] (0: all), got "
                     f"{top_k}")
  if not 0 < top_p <= 1:
    raise MaxlmError(f"top_p must be in (0, 1], got {top_p}")

"""Sampling with a KV cache: prefill the prompt once, then one token per step.

The decoder runs with `decode=True`, keeping each layer's keys and values in the "cache"
collection, so step t attends to the cached keys instead of recomputing the prefix. Sampling
is temperature plus top-k with a seeded key per step, so a seed reproduces its sample.
"""

import jax
import jax.numpy as jnp
import numpy as np


def _next_token(logits_V, key, temperature, top_k):
  if temperature <= 0:
    return jnp.argmax(logits_V).astype(jnp.int32)
  logits_V = logits_V.astype(jnp.float32) / temperature
  if top_k:
    kth = jax.lax.top_k(logits_V, top_k)[0][-1]
    logits_V = jnp.where(logits_V < kth, -jnp.inf, logits_V)
  return jax.random.categorical(key, logits_V).astype(jnp.int32)


def sample(model, params, prompt_ids, *, max_tokens, temperature=1.0, top_k=0, seed=0,
           eos_id=None):
  """The generated ids (without the prompt), stopping at EOS or after max_tokens."""
  decoder = model.clone(decode=True)
  prompt = np.asarray(prompt_ids, np.int32)[None]
  total = prompt.shape[1] + max_tokens
  ones = jnp.ones((1, total), jnp.int32)
  shapes = jax.eval_shape(lambda: decoder.init(jax.random.key(0), ones, ones, ones))["cache"]
  cache = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

  def run(params, cache, tokens, positions):
    (h, head, _), state = decoder.apply({"params": params, "cache": cache}, tokens, positions,
                                        jnp.ones_like(tokens), mutable=["cache"])
    return (h[0, -1].astype(jnp.float32) @ head.astype(jnp.float32)), state["cache"]

  @jax.jit
  def step(params, cache, token, position, key):
    logits, cache = run(params, cache, token[None, None], position[None, None])
    return _next_token(logits, key, temperature, top_k), cache

  n = prompt.shape[1]
  logits, cache = jax.jit(run)(params, cache, jnp.asarray(prompt),
                               jnp.arange(n, dtype=jnp.int32)[None])
  base = jax.random.key(seed)
  token = _next_token(logits, jax.random.fold_in(base, 0), temperature, top_k)
  out = []
  for t in range(max_tokens):
    out.append(int(token))
    if eos_id is not None and out[-1] == eos_id or t == max_tokens - 1:
      break
    token, cache = step(params, cache, token, jnp.int32(n + t), jax.random.fold_in(base, t + 1))
  return out

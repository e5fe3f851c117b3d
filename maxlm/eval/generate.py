"""The one-sequence sampler, and the checks `maxlm generate` makes before sampling.

`maxlm generate` and GRPO sample with the batched sampler (eval/sample.py: many rows, the whole
decode loop in jit). `sample` here is the plain reference it is tested and benchmarked against
(tests/test_eval_sample.py, tools/bench_sample.py): one sequence, a KV cache (the decoder with
`decode=True` keeps each layer's keys and values in the "cache" collection, so step t attends
to the cached keys instead of recomputing the prefix), a host round trip per token. Sampling
is temperature plus top-k with a seeded key per step, so a seed reproduces its sample; a seed
is any integer in [0, 2**64), all 64 bits in the key (jax.random.key keeps 32 of them without
x64, so seeds 0 and 2**32 would sample alike).

A model holds as many positions as the longest stage it trained (`context`): `length_problem`
says why a prompt plus --max-tokens does not fit, and `check_settings` refuses sampling settings
it cannot honour, each in one line, before any cache is allocated.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from maxlm import MaxlmError

SEEDS = 2**64


def context(config, stage):
  """(positions, stage index): the longest sequence the run trained up to `stage`."""
  i = max(range(stage + 1), key=lambda j: config.stages[j].seq_len)
  return config.stages[i].seq_len, i


def check_settings(temperature, top_k, seed, max_tokens, vocab=None):
  """One line for a setting the sampler cannot honour."""
  if not (math.isfinite(temperature) and temperature >= 0):
    raise MaxlmError(f"--temperature must be a finite number >= 0 (0 is greedy), got "
                     f"{temperature}")
  if not 0 <= seed < SEEDS:
    raise MaxlmError(f"--seed must be in [0, 2**64), got {seed}")
  if max_tokens < 1:
    raise MaxlmError(f"--max-tokens must be >= 1, got {max_tokens}")
  if top_k < 0 or vocab is not None and top_k > vocab:
    raise MaxlmError(f"--top-k must be in [0, {vocab or 'the vocabulary size'}] (0: all "
                     f"tokens), got {top_k}")


def length_problem(prompt_tokens, max_tokens, positions):
  """Why prompt + max_tokens do not fit the model's `positions`, or None."""
  if prompt_tokens + max_tokens <= positions:
    return None
  if prompt_tokens >= positions:
    return (f"the prompt is {prompt_tokens:,} tokens (with BOS), more than the {positions:,} "
            "positions this model holds: shorten it")
  return (f"the prompt is {prompt_tokens:,} tokens (with BOS) and --max-tokens {max_tokens:,}: "
          f"{prompt_tokens + max_tokens:,} positions, more than the {positions:,} this model "
          f"holds: pass --max-tokens {positions - prompt_tokens:,} or less")


def _key(seed):
  """All 64 bits of `seed` in a threefry key (equal to jax.random.key(seed) below 2**32)."""
  if not 0 <= seed < SEEDS:
    raise MaxlmError(f"seed must be in [0, 2**64), got {seed}")
  return jax.random.wrap_key_data(np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32),
                                  impl="threefry2x32")


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
  base = _key(seed)
  token = _next_token(logits, jax.random.fold_in(base, 0), temperature, top_k)
  out = []
  for t in range(max_tokens):
    out.append(int(token))
    if eos_id is not None and out[-1] == eos_id or t == max_tokens - 1:
      break
    token, cache = step(params, cache, token, jnp.int32(n + t), jax.random.fold_in(base, t + 1))
  return out

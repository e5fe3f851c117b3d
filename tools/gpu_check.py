"""GPU check for attention: correctness of `gpu` and `blockwise` against `reference` on the GPU,
then forward+backward time of `gpu` vs `blockwise` at L = 4096, 16384 and 65536 (bf16).

  PYTHONPATH=. python tools/gpu_check.py [--json OUT.json]      (tools/gpu_check.sh runs it)
"""

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from maxlm.model.attention import attention, reference

HEADS, KV_HEADS, DIM = 16, 4, 128


def inputs(length, dtype, docs, batch=1, seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(batch, length, HEADS, DIM)), dtype)
  k = jnp.asarray(rng.normal(size=(batch, length, KV_HEADS, DIM)), dtype)
  v = jnp.asarray(rng.normal(size=(batch, length, KV_HEADS, DIM)), dtype)
  seg = (np.arange(length) * docs // length + 1)[None].repeat(batch, 0).astype(np.int32)
  seg[:, -(length // 7):] = 0  # some padding at the end
  return q, k, v, jnp.asarray(seg)


def grads(impl, q, k, v, seg, **kw):
  fn = (lambda q, k, v: reference.attention(q, k, v, seg, seg)[0]) if impl == "reference" else (
      lambda q, k, v: attention(q, k, v, seg, impl=impl, **kw))
  w = jnp.cos(jnp.arange(q.size, dtype=jnp.float32).reshape(q.shape))
  loss = lambda q, k, v: (fn(q, k, v).astype(jnp.float32) * w).sum()
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def check(length, dtype):
  q, k, v, seg = inputs(length, dtype, docs=5, batch=2)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  _, want = grads("reference", *f32, seg)(*f32)
  out = {}
  for impl, kw in (("gpu", {"block_q": 64}), ("blockwise", {"block_q": 256, "block_k": 256})):
    _, got = grads(impl, q, k, v, seg, **kw)(q, k, v)
    out[impl] = max(float(jnp.abs(g.astype(jnp.float32) - w).max() / jnp.abs(w).max())
                    for g, w in zip(got, want))
  return out


def timed(impl, length, docs, **kw):
  q, k, v, seg = inputs(length, jnp.bfloat16, docs)
  f = grads(impl, q, k, v, seg, **kw)
  jax.block_until_ready(f(q, k, v))
  best = float("inf")
  for _ in range(3):
    t = time.perf_counter()
    jax.block_until_ready(f(q, k, v))
    best = min(best, time.perf_counter() - t)
  return best


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--json")
  args = ap.parse_args(argv)
  result = {"device": str(jax.devices()[0]), "jax": jax.__version__,
            "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": DIM}
  for length in (1024, 1000):
    for dtype in (jnp.float32, jnp.bfloat16):
      result[f"max_rel_grad_err_{length}_{jnp.dtype(dtype).name}"] = check(length, dtype)
      print(json.dumps(result), flush=True)
  for length in (4096, 16384, 65536):
    for docs in (1, 32):
      g = timed("gpu", length, docs, block_q=128)
      b = timed("blockwise", length, docs, block_q=512, block_k=512)
      result[f"fwd_bwd_s_{length}_{docs}docs"] = {"gpu": round(g, 5), "blockwise": round(b, 5),
                                                  "blockwise_over_gpu": round(b / g, 2)}
      print(json.dumps(result), flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())

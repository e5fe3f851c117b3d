import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm import MaxlmError
from maxlm.config import MeshConfig
from maxlm.model.attention import attention, reference
from maxlm.parallel import mesh as mesh_lib

from attncases import close, make_case


def run(fn, q, k, v, seg, w):
  def loss(q, k, v):
    out = fn(q, k, v, seg)
    return (out.astype(jnp.float32) * w).sum(), out
  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  return out, grads


def ref_fn(q, k, v, seg):
  return reference.attention(q.astype(jnp.float32), k.astype(jnp.float32),
                             v.astype(jnp.float32), seg, seg)[0]


CASES = [("blockwise", {"block_q": 32, "block_k": 16}), ("blockwise", {"block_q": 64,
                                                                     "block_k": 64}),
         ("splash", {"block_q": 128}), ("gpu", {"block_q": 64}), ("reference", {}),
         ("splash_causal", {"block_q": 128}), ("gpu_mha", {"block_q": 64})]


@functools.lru_cache(maxsize=None)
def reference_case(dtype, length=200, max_doc=70, rows=3):
  """The case (its first rows) and the reference's outputs and gradients on it (computed once
  for every impl or mesh compared with it)."""
  q, k, v, seg, w = (x[:rows] for x in make_case(length=length, dtype=dtype, max_doc=max_doc))
  want = jax.jit(lambda q, k, v: run(ref_fn, q, k, v, seg, w))(
      q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))
  return (q, k, v, seg, w), want


@pytest.mark.parametrize("impl, kw", CASES)
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)])
def test_every_impl_matches_reference(impl, kw, dtype, tol):
  (q, k, v, seg, w), (want, want_grads) = reference_case(dtype)
  got, grads = run(lambda *a: attention(*a, impl=impl, **kw), q, k, v, seg, w)
  assert got.shape == q.shape and got.dtype == q.dtype
  close(got, want, tol)
  for g, wg in zip(grads, want_grads):
    close(g, wg, tol * 4)
  assert not np.asarray(got[1], np.float32).any(), "a padding row's output is 0"


def test_visibility_rule():
  seg = jnp.array([[1, 1, 2, 2, 2, 0]])
  vis = np.asarray(reference.visible(seg, seg))[0]
  want = np.array([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0],
                   [0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0]], bool)
  assert (vis == want).all()


def test_max_logit_is_the_largest_visible_logit():
  q, k, v, seg, _ = make_case(length=64)
  _, peak = attention(q, k, v, seg, impl="blockwise", block_q=16, block_k=16, max_logit=True)
  logits = np.einsum("bqkgd,bskd->bkgqs", np.asarray(q).reshape(3, 64, 2, 2, 32),
                     np.asarray(k)) / np.sqrt(32)
  mask = np.broadcast_to(np.asarray(reference.visible(seg, seg))[:, None, None], logits.shape)
  assert np.isclose(float(peak), logits[mask].max(), rtol=1e-5)


def test_bad_heads_and_impls_are_clear_errors():
  q, k, v, seg, _ = make_case(length=16, heads=3, kv_heads=2)
  with pytest.raises(MaxlmError, match="do not divide"):
    attention(q, k, v, seg)
  with pytest.raises(MaxlmError, match="expected one of"):
    attention(q, k[:, :, :1], v[:, :, :1], seg, impl="flash")


@pytest.mark.parametrize("shape", [(1, 2, 1, 4), (1, 1, 2, 4), (2, 1, 1, 4)])
def test_context_parallel_matches_reference(shape):
  n = int(np.prod(shape))
  mesh = mesh_lib.make_mesh(MeshConfig(*shape), jax.devices()[:n])
  # 122 tokens: not a multiple of the 4 shards or of 4 blocks; documents of up to 45 tokens
  # cross the ~31-token shard boundaries
  (q, k, v, seg, w), (want, want_grads) = reference_case(jnp.float32, length=122, max_doc=45,
                                                         rows=2)
  fn = lambda *a: attention(*a, impl="blockwise", block_q=16, block_k=16, mesh=mesh,
                            batch_axes=("data", "fsdp"), head_axes="tensor")
  got, grads = jax.jit(lambda q, k, v: run(fn, q, k, v, seg, w))(q, k, v)
  close(got, want, 2e-5)
  for g, wg in zip(grads, want_grads):
    close(g, wg, 1e-4)

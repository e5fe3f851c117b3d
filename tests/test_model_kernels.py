"""The segment-skipping kernels in Pallas interpret mode: equal to `reference` (outputs and
gradients, f32), and the tiles they compute counted inside the kernels (a counting causal rule
passed as the kernels' mask function) equal to the brute-force count of tiles holding a
visible pair."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm.model.attention import attention, reference, splash_segments, triton_segments


def packings(length, rng):
  """Four rows: one document then padding, many tiny documents, documents of random lengths
  crossing tile boundaries (padding last), all padding."""
  seg = np.zeros((4, length), np.int32)
  seg[0, :length - 37] = 1
  seg[1] = np.arange(length) // 7 + 1
  pos, s = 0, 1
  while pos < length - 20:
    n = int(rng.integers(1, 160))
    seg[2, pos:pos + n] = s
    pos, s = pos + n, s + 1
  return seg


def inputs(length, heads, kv_heads, dim, seed=0):
  rng = np.random.default_rng(seed)
  seg = packings(length, rng)
  shape = lambda h: (seg.shape[0], length, h, dim)
  q, k, v = (jnp.asarray(rng.normal(size=shape(h)), jnp.float32)
             for h in (heads, kv_heads, kv_heads))
  w = jnp.asarray(rng.normal(size=shape(heads)), jnp.float32)
  return q, k, v, jnp.asarray(seg), w


def brute_force_tiles(seg, bq, bk):
  """Tiles (query block, key block) with at least one visible pair, summed over rows."""
  pad = -seg.shape[1] % max(bq, bk)
  seg = jnp.pad(seg, [(0, 0), (0, pad)])
  vis = np.asarray(reference.visible(seg, seg))
  b, length = seg.shape
  return int(vis.reshape(b, length // bq, bq, length // bk, bk).any(axis=(2, 4)).sum())


class Counter:
  """A causal mask function that counts, from inside the kernel, each tile it masks."""

  def __init__(self):
    self.n = 0

  def _add(self):
    self.n += 1

  def __call__(self, q_pos, k_pos):
    jax.debug.callback(self._add)
    return q_pos >= k_pos


def check(fn, q, k, v, seg, w, tol=2e-5):
  ref = lambda q, k, v: reference.attention(q, k, v, seg, seg)[0]
  loss = lambda f: lambda q, k, v: (f(q, k, v) * w).sum()
  want, got = jax.jit(ref)(q, k, v), jax.jit(fn)(q, k, v)
  scale = lambda x: max(1.0, float(jnp.abs(x).max()))
  assert float(jnp.abs(got - want).max()) <= tol * scale(want)
  assert not np.asarray(got[3]).any(), "an all-padding row's output is 0"
  want_g = jax.jit(jax.grad(loss(ref), (0, 1, 2)))(q, k, v)
  got_g = jax.jit(jax.grad(loss(fn), (0, 1, 2)))(q, k, v)
  for g, wg in zip(got_g, want_g):
    assert float(jnp.abs(g - wg).max()) <= 4 * tol * scale(wg)


# check() runs each kernel's forward twice (alone, and under grad) and each backward kernel
# once. No kernel can compute fewer tiles than hold a visible pair (its outputs would differ
# from the reference), so a total equal to the brute-force total means each count is exact.


def test_splash_skips_exactly_the_invisible_tiles():
  q, k, v, seg, w = inputs(384, heads=2, kv_heads=1, dim=32)
  counter = Counter()
  fn = lambda q, k, v: splash_segments.splash(q, k, v, seg, block=128, interpret=True,
                                              mask_function=counter)
  tiles = brute_force_tiles(seg, 128, 128)
  assert tiles < 4 * 6, "the packings leave tiles to skip (24 causal tiles)"
  assert splash_segments.block_count(seg, 128, 128) == tiles
  check(fn, q, k, v, seg, w)
  assert counter.n == 2 * (2 * tiles + 2 * tiles)  # 2 heads: forward x2, dQ, dK/dV


@pytest.mark.parametrize("length, dim, block, block_bwd", [(256, 32, 32, 32), (250, 24, 64, 32)])
def test_triton_visits_only_each_blocks_key_range(length, dim, block, block_bwd):
  q, k, v, seg, w = inputs(length, heads=2, kv_heads=1, dim=dim, seed=length)
  counter = Counter()
  fn = lambda q, k, v: triton_segments.gpu(q, k, v, seg, block=block, block_bwd=block_bwd,
                                           interpret=True, mask_function=counter)[0]
  padded = jnp.pad(seg, [(0, 0), (0, -length % block)])
  tiles, tiles_bwd = brute_force_tiles(seg, block, block), brute_force_tiles(seg, block_bwd,
                                                                             block_bwd)
  assert triton_segments.block_count(padded, block, block) == tiles
  check(fn, q, k, v, seg, w)
  assert counter.n == 2 * (2 * tiles + 2 * tiles_bwd)  # 2 heads: forward x2, dQ, dK/dV


def test_triton_reports_the_max_logit_from_inside_the_kernel():
  q, k, v, seg, _ = inputs(128, heads=2, kv_heads=1, dim=16)
  _, peak = attention(q, k, v, seg, impl="gpu", block_q=32, max_logit=True)
  _, want = reference.attention(q, k, v, seg, seg)
  assert np.isclose(float(peak), float(want), rtol=1e-5)


@pytest.mark.parametrize("window", [0, 48])
def test_one_cached_splash_kernel_serves_two_jitted_functions(window):
  """A train step and an eval step at the same length share the cached kernel: the second
  trace must not meet values left by the first (it raised UnexpectedTracerError)."""
  q, k, v, seg, _ = inputs(128, heads=2, kv_heads=1, dim=16, seed=window)
  call = lambda q: attention(q, k, v, seg, impl="splash_causal", block_q=128, block_k=128,
                             window=window)
  out = jax.jit(call)(q)
  total, grad = jax.jit(jax.value_and_grad(lambda q: call(q).sum()))(q)
  want, _ = reference.attention(q, k, v, seg, seg, window=window)
  np.testing.assert_allclose(out, want, atol=2e-5)
  np.testing.assert_allclose(total, want.sum(), rtol=1e-5)
  assert grad.shape == q.shape and bool(jnp.isfinite(grad).all())


def test_ranges_stay_correct_on_unsorted_segments():
  """Segments that restart and padding in the middle: the ranges are a superset, still exact."""
  rng = np.random.default_rng(3)
  seg = jnp.asarray(rng.integers(0, 4, size=(2, 128)), jnp.int32)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 128, 2, 16)), jnp.float32) for _ in range(3))
  want = jax.jit(lambda q, k, v: reference.attention(q, k, v, seg, seg)[0])(q, k, v)
  got = jax.jit(lambda q, k, v: triton_segments.gpu(q, k, v, seg, block=32, interpret=True)[0])(
      q, k, v)
  assert float(jnp.abs(got - want).max()) < 1e-5
  assert triton_segments.block_count(seg, 32, 32) >= brute_force_tiles(seg, 32, 32)
  assert splash_segments.block_count(seg, 32, 32) >= brute_force_tiles(seg, 32, 32)


def test_the_gpu_check_script_parses_and_runs_its_cpu_path(tmp_path, capsys):
  """tools/gpu_kernels_check.{sh,py}: the shell script is valid bash, and the Python script's
  --dry-run path runs at tiny shapes here (tile counts only; the timed dry run is manual)."""
  import json
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  assert subprocess.run(["bash", "-n", os.path.join(root, "tools", "gpu_kernels_check.sh")]
                        ).returncode == 0
  sys.path.insert(0, os.path.join(root, "tools"))
  try:
    import gpu_kernels_check
  finally:
    sys.path.pop(0)
  out = tmp_path / "out.json"
  assert gpu_kernels_check.main(["--dry-run", "--parts", "2", "--tiles-only", "--json",
                                 str(out)]) == 0
  result = json.loads(out.read_text())
  assert result["versions"]["jax"] == jax.__version__
  for name, row in result["fwd_bwd_s"].items():
    assert row["tiles_gpu"] <= row["tiles_gpu_mha"], name
  assert result["fwd_bwd_s"]["512_32docs"]["tiles_gpu"] * 4 < result["fwd_bwd_s"][
      "512_32docs"]["tiles_gpu_mha"]


@pytest.mark.parametrize("platform, target", [("cuda", "__gpu$xla.gpu.triton"),
                                              ("tpu", "tpu_custom_call")])
def test_the_kernels_lower_for_their_accelerator(platform, target):
  """Without the device: the forward, dQ and dK/dV kernels lower to Triton (GPU) and Mosaic
  (TPU) custom calls, compiled for the real thing (interpret=False), bf16, GQA, padding."""
  from jax import export
  fn = triton_segments.gpu if platform == "cuda" else splash_segments.splash
  block = 128 if platform == "cuda" else 256
  shape = lambda h: jax.ShapeDtypeStruct((2, 1000, h, 128), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((2, 1000), jnp.int32)

  def grads(q, k, v, seg):
    def loss(q, k, v):
      out = fn(q, k, v, seg, block=block)
      return (out[0] if platform == "cuda" else out).astype(jnp.float32).sum()
    return jax.grad(loss, (0, 1, 2))(q, k, v)

  exported = export.export(jax.jit(grads), platforms=(platform,), disabled_checks=[
      export.DisabledSafetyCheck.custom_call(target)])(shape(4), shape(2), shape(2), seg)
  assert exported.mlir_module().count(target) == 3

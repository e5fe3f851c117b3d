"""attention/decode.py (the sampler's cache layout) equals the reference on the same inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm.model.attention import decode, reference


@pytest.mark.parametrize("lq,offset,window", [(1, 9, 0), (1, 9, 3), (4, 6, 0), (6, 0, 2)])
def test_decode_layout_equals_the_reference(lq, offset, window):
  """Left padding (segment 0), unwritten slots (segment 0) and a padding query included."""
  b, s, h, kh, d = 3, 12, 4, 2, 8
  rng = np.random.default_rng(lq + offset + window)
  q = jnp.asarray(rng.standard_normal((b, lq, h, d)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((b, s, kh, d)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((b, s, kh, d)), jnp.float32)
  seg_k = np.ones((b, s), np.int32)
  seg_k[1, :3] = 0  # a shorter prompt's left padding
  seg_k[:, offset + lq:] = 0  # not yet written
  seg_q = np.ones((b, lq), np.int32)
  seg_q[2, 0] = 0  # a padding query: output 0
  want, want_peak = reference.attention(q, k, v, seg_q, seg_k, q_offset=offset, window=window)
  got, peak = decode.attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), seg_q,
                               seg_k, q_offset=offset, window=window)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
  assert float(peak) == pytest.approx(float(want_peak), rel=1e-6)
  assert not np.asarray(got)[2, 0].any()
  assert jax.numpy.isfinite(got).all()

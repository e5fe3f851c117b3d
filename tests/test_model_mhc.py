"""Hyper-connections (maxlm/model/mhc.py) against transformers' DeepSeek-V4 modules, and the
properties the design rests on: a doubly stochastic residual map, and no reach across tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st
from randparams import random_params

from maxlm import config
from maxlm.interop import families, hf_config
from maxlm.model import build, mhc
from maxlm.parallel import mesh as mesh_lib

N, D, EPS, NORM_EPS = 4, 8, 1e-6, 1e-6


def _streams(seed, b=2, length=5):
  return jax.random.normal(jax.random.PRNGKey(seed), (b, length, N, D), jnp.float32)


def _connection(iters=20):
  return mhc.HyperConnection(N, iters, EPS, NORM_EPS, 0.3)


def _hf_config():
  transformers = pytest.importorskip("transformers")
  return transformers.DeepseekV4Config(
      hidden_size=D, hc_mult=N, hc_sinkhorn_iters=20, hc_eps=EPS, rms_norm_eps=NORM_EPS,
      num_hidden_layers=1, num_attention_heads=2, head_dim=8, vocab_size=16)


def test_hyper_connection_equals_transformers():
  torch = pytest.importorskip("torch")
  from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf
  x = _streams(0)
  module = _connection()
  params = random_params(module, (x,), scale=0.5)
  inp, post, res = module.apply({"params": params}, x)
  ref = hf.DeepseekV4HyperConnection(_hf_config())
  with torch.no_grad():
    for name in ("fn", "base", "scale"):
      getattr(ref, name).copy_(torch.from_numpy(np.asarray(params[name])))
    ref_post, ref_res, ref_inp = ref(torch.from_numpy(np.asarray(x)))
  np.testing.assert_allclose(inp, ref_inp.numpy(), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(post, ref_post.numpy(), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(res, ref_res.numpy(), rtol=1e-5, atol=1e-6)
  out = jax.random.normal(jax.random.PRNGKey(3), x.shape[:2] + (D,))
  # the decoder layer's own mixing line, with the residual map applied transposed
  ref_next = (ref_post.unsqueeze(-1) * torch.from_numpy(np.asarray(out)).unsqueeze(-2)
              + torch.matmul(ref_res.transpose(-1, -2), torch.from_numpy(np.asarray(x))))
  np.testing.assert_allclose(mhc.expand(x, out, post, res), ref_next.numpy(), rtol=1e-5,
                             atol=1e-5)


def test_hyper_head_equals_transformers():
  torch = pytest.importorskip("torch")
  from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf
  x = _streams(4)
  module = mhc.HyperHead(N, EPS, NORM_EPS, 0.3)
  params = random_params(module, (x,), seed=5, scale=0.5)
  ref = hf.DeepseekV4HyperHead(_hf_config())
  with torch.no_grad():
    for ours, theirs in (("fn", "hc_fn"), ("base", "hc_base"), ("scale", "hc_scale")):
      getattr(ref, theirs).copy_(torch.from_numpy(np.asarray(params[ours])))
    expected = ref(torch.from_numpy(np.asarray(x))).numpy()
  np.testing.assert_allclose(module.apply({"params": params}, x), expected, rtol=1e-5,
                             atol=1e-6)


@given(st.integers(0, 2**16), st.floats(0.1, 1.0))
def test_the_residual_map_is_doubly_stochastic(seed, spread):
  """Columns sum to 1 (Sinkhorn ends on them); rows, which keep the streams' total on the
  residual path, to within 1e-5 after 20 iterations at logits of this spread (at a spread of 2
  some rows are still 2% off: Sinkhorn converges slowly on sharp maps)."""
  logits = jax.random.normal(jax.random.PRNGKey(seed), (3, N, N)) * spread
  res = mhc.sinkhorn(logits, 20, EPS)
  assert bool(jnp.all(res > 0))
  np.testing.assert_allclose(res.sum(axis=-2), 1.0, atol=1e-5)
  np.testing.assert_allclose(res.sum(axis=-1), 1.0, atol=1e-5)


def test_no_token_reads_another():
  module = _connection()
  x = _streams(6)
  params = random_params(module, (x,), scale=0.5)
  changed = x.at[:, 2].set(x[:, 2] * 3.0 + 1.0)
  before = module.apply({"params": params}, x)
  after = module.apply({"params": params}, changed)
  for a, b in zip(before, after):
    keep = np.r_[0:2, 3:x.shape[1]]
    np.testing.assert_array_equal(np.asarray(a)[:, keep], np.asarray(b)[:, keep])
    assert not np.allclose(np.asarray(a)[:, 2], np.asarray(b)[:, 2])


def _decoder_case(streams, seed=0):
  cfg = config.from_dict({
      "model": {"size": "tiny", "vocab_size": 64, "dtype": "float32", "d_model": 32,
                "n_heads": 2, "n_kv_heads": 1, "head_dim": 16, "d_ff": 64,
                "mhc": {"streams": streams}},
      "stages": [{"seq_len": 24, "batch": 1, "steps": 1, "attention": "blockwise",
                  "block_q": 8, "block_k": 8}]})
  mesh = mesh_lib.make_mesh(config.MeshConfig(1, 1, 1, 1), jax.devices()[:1])
  model = build.model_for(cfg, 0, mesh)
  params = build.init_params(model, jax.random.key(seed), mesh, cfg.rules, 24)
  return cfg, model, params


def _packed(tokens):
  seg = np.repeat([1, 2, 3], [7, 9, 8])[None].astype(np.int32)
  pos = np.concatenate([np.arange(7), np.arange(9), np.arange(8)])[None].astype(np.int32)
  mask = (seg != 2).astype(np.int32)  # documents 1 and 3 only, each but its last position,
  mask[0, [6, 23]] = 0  # whose target would be the next document's first token
  return {"inputs": tokens[None].astype(np.int32), "targets": np.roll(tokens, -1)[None].astype(
      np.int32), "segment_ids": seg, "positions": pos, "loss_mask": mask}


def test_a_packed_document_changes_no_other_documents_loss_or_gradient():
  """With 4 streams, rewriting document 2 of a packed row leaves the loss of documents 1 and 3
  and its gradient unchanged to 1e-6 (nothing in the streams reaches across a boundary)."""
  cfg, model, params = _decoder_case(4)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 64, 24)
  other = tokens.copy()
  other[7:16] = rng.integers(0, 64, 9)
  fn = jax.jit(jax.value_and_grad(lambda p, b: build.loss_fn(model, p, b, cfg.rules,
                                                             chunk=24)[0]))
  (loss_a, grad_a), (loss_b, grad_b) = fn(params, _packed(tokens)), fn(params, _packed(other))
  assert abs(float(loss_a) - float(loss_b)) <= 1e-6 * abs(float(loss_a))
  for a, b in zip(jax.tree.leaves(grad_a), jax.tree.leaves(grad_b)):
    assert np.abs(np.asarray(a) - np.asarray(b)).max() <= 1e-6 * max(np.abs(np.asarray(a)).max(),
                                                                     1e-12)


def test_the_streams_are_parameters_of_every_layer_and_the_head():
  _, _, params = _decoder_case(4)
  names = {"/".join(str(getattr(k, "key", k)) for k in path)
           for path, _ in jax.tree_util.tree_leaves_with_path(params)}
  for part in ("attention_hc/fn", "mlp_hc/base", "mhc_head/scale"):
    assert any(part in n for n in names), (part, sorted(names))
  _, _, plain = _decoder_case(0)
  assert not any("hc" in "/".join(map(str, p)) for p, _ in
                 jax.tree_util.tree_leaves_with_path(plain))


def test_export_refuses_streams_in_one_line():
  cfg, _, _ = _decoder_case(4)
  with pytest.raises(hf_config.CannotExpress, match="model.mhc.streams=4"):
    families.family(cfg.model)

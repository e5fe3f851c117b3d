"""DeepSeek-V4's attention layer (maxlm/model/mqa.py): equal to transformers'
DeepseekV4Attention on one document for each layer kind, and on a packed row equal to each
document run alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from randparams import random_params

from maxlm.model import mqa

D, H, K, R, Q, G, O, WINDOW = 32, 4, 16, 8, 12, 2, 6, 5
KINDS = {"sliding_attention": dict(rate=0),
         "heavily_compressed_attention": dict(rate=8),
         "compressed_sparse_attention": dict(rate=4, overlap=True, index_heads=8, index_dim=8,
                                             index_top_k=3)}


def _spec(kind):
  return mqa.MqaSpec(heads=H, head_dim=K, rope_dim=R, q_lora=Q, out_groups=G, out_lora=O,
                     window=WINDOW, **KINDS[kind])


def _row(lengths, length):
  seg, pos, at = np.zeros(length, np.int32), np.zeros(length, np.int32), 0
  for i, n in enumerate(lengths):
    seg[at:at + n], pos[at:at + n] = i + 1, np.arange(n)
    at += n
  return jnp.asarray(pos[None]), jnp.asarray(seg[None])


def _load_into(ref, params, kind, torch):
  """Our parameters into transformers' module (their Linear weights are [out, in])."""
  t = lambda a: torch.from_numpy(np.asarray(a, np.float32))  # noqa: E731
  ref.q_a_proj.weight.copy_(t(params["q_a"]["kernel"]).T)
  ref.q_a_norm.weight.copy_(t(params["q_a_norm"]))
  ref.q_b_proj.weight.copy_(t(params["q_b"]["kernel"]).reshape(Q, H * K).T)
  ref.kv_proj.weight.copy_(t(params["kv"]["kernel"]).T)
  ref.kv_norm.weight.copy_(t(params["kv_norm"]))
  ref.o_a_proj.weight.copy_(t(params["o_a"]).transpose(1, 2).reshape(G * O, -1))
  ref.o_b_proj.weight.copy_(t(params["o_b"]["kernel"]).T)
  ref.sinks.copy_(t(params["sink"]))
  if kind == "sliding_attention":
    return
  pairs = [(ref.compressor, params["compressor"])]
  if kind == "compressed_sparse_attention":
    indexer = ref.compressor.indexer
    pairs.append((indexer, params["index_compressor"]))
    indexer.q_b_proj.weight.copy_(t(params["index_q"]["kernel"]).reshape(Q, -1).T)
    indexer.scorer.weights_proj.weight.copy_(t(params["index_weights"]["kernel"]).T)
  for module, ours in pairs:
    module.kv_proj.weight.copy_(t(ours["kv"]["kernel"]).T)
    module.gate_proj.weight.copy_(t(ours["gate"]["kernel"]).T)
    module.position_bias.copy_(t(ours["slot_bias"]))
    module.kv_norm.weight.copy_(t(ours["norm"]))


@pytest.mark.parametrize("kind", list(KINDS))
def test_one_document_equals_transformers(kind):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf
  cfg = transformers.DeepseekV4Config(
      hidden_size=D, num_attention_heads=H, head_dim=K, partial_rotary_factor=R / K,
      q_lora_rank=Q, o_groups=G, o_lora_rank=O, sliding_window=WINDOW, num_hidden_layers=1,
      layer_types=[kind], vocab_size=16, index_n_heads=8, index_head_dim=8, index_topk=3,
      compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8})
  cfg._attn_implementation = "eager"
  length = 29
  x = jax.random.normal(jax.random.PRNGKey(2), (1, length, D))
  pos, seg = _row([length], length)
  module = mqa.Mqa(_spec(kind))
  params = random_params(module, (x, pos, seg))
  if "index_weights" in params:
    # ReLU scores tie at 0 where every head's dot product is negative, and the two top-k
    # break ties differently: positive head weights and 8 heads make a tie unlikely
    params["index_weights"]["kernel"] = jnp.abs(params["index_weights"]["kernel"])
  ours = np.asarray(module.apply({"params": params}, x, pos, seg))
  ref = hf.DeepseekV4Attention(cfg, 0).eval()
  rotary = hf.DeepseekV4RotaryEmbedding(cfg)
  hidden = torch.from_numpy(np.asarray(x))
  ids = torch.arange(length)[None]
  i, j = np.arange(length)[:, None], np.arange(length)[None]
  mask = torch.from_numpy(np.where((j <= i) & (j > i - WINDOW), 0.0, -np.inf)
                          .astype(np.float32))[None, None]
  with torch.no_grad():
    _load_into(ref, params, kind, torch)
    embeddings = {t: rotary(hidden, ids, layer_type=t) for t in ("main", "compress")}
    expected = ref(hidden, embeddings, ids, mask)[0].numpy()
  np.testing.assert_allclose(ours, expected, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_packed_row_equals_each_document_alone(kind):
  lengths, length = [11, 17, 2, 9], 42
  x = jax.random.normal(jax.random.PRNGKey(3), (1, length, D))
  pos, seg = _row(lengths, length)
  module = mqa.Mqa(_spec(kind))
  params = random_params(module, (x, pos, seg))
  packed = np.asarray(module.apply({"params": params}, x, pos, seg))
  at = 0
  for n in lengths:
    p1, s1 = _row([n], n)
    alone = np.asarray(module.apply({"params": params}, x[:, at:at + n], p1, s1))
    np.testing.assert_allclose(packed[0, at:at + n], alone[0], rtol=1e-5, atol=1e-6)
    at += n
  assert np.all(packed[0, at:] == 0)  # padding attends to the sink alone


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_a_v4_decoder_changes_no_other_documents_loss_or_gradient(mode):
  """configs/v4_tiny.yaml's model (V4 attention with CSA and HCA layers, 4 streams, hash and
  learned routing), shrunk: rewriting the middle document of a packed row leaves the other
  documents' loss and its gradient unchanged to 1e-6, with CSA over every entry (dense) or
  over its indexer's top 3 (sparse)."""
  from maxlm import config
  from maxlm.model import build
  from maxlm.parallel import mesh as mesh_lib
  cfg = config.load("configs/v4_tiny.yaml", [
      "model.vocab_size=64", "model.n_layers=2", "model.mqa.compress=[4, 8]",
      "model.mqa.hca_rate=8", "model.mqa.window=6", "model.moe.experts=4",
      "model.mqa.index_top_k=3", f"stages.0.sparse.mode={mode}", "stages.0.seq_len=40",
      "stages.0.batch=1"])
  mesh = mesh_lib.make_mesh(config.MeshConfig(1, 1, 1, 1), jax.devices()[:1])
  model = build.model_for(cfg, 0, mesh)
  params = build.init_params(model, jax.random.key(0), mesh, cfg.rules, 40)
  lengths = [13, 15, 12]
  seg = np.repeat([1, 2, 3], lengths)[None].astype(np.int32)
  pos = np.concatenate([np.arange(n) for n in lengths])[None].astype(np.int32)
  mask = (seg != 2).astype(np.int32)
  mask[0, [12, 39]] = 0  # the last positions, whose targets are the next document's
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 64, 40)
  other = tokens.copy()
  other[13:28] = rng.integers(0, 64, 15)

  def batch(t):
    return {"inputs": t[None].astype(np.int32), "targets": np.roll(t, -1)[None].astype(np.int32),
            "segment_ids": seg, "positions": pos, "loss_mask": mask}

  fn = jax.jit(jax.value_and_grad(lambda p, b: build.loss_fn(model, p, b, cfg.rules,
                                                             chunk=40)[0]))
  (loss_a, grad_a), (loss_b, grad_b) = fn(params, batch(tokens)), fn(params, batch(other))
  assert abs(float(loss_a) - float(loss_b)) <= 1e-6 * abs(float(loss_a))
  for a, b in zip(jax.tree.leaves(grad_a), jax.tree.leaves(grad_b)):
    a, b = np.asarray(a), np.asarray(b)
    assert np.abs(a - b).max() <= 1e-6 * max(np.abs(a).max(), 1e-12)

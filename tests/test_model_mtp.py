"""Multi-token prediction (maxlm/model/mtp.py): its loss equals a direct computation of the same
block on each document alone, it is masked at document boundaries, and rewriting one document
of a packed row changes no other document's MTP loss or gradient."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from maxlm import config
from maxlm.model import build, mtp
from maxlm.parallel import mesh as mesh_lib

LENGTHS, L, V = [13, 15, 9], 40, 64


@given(st.lists(st.integers(1, 9), min_size=1, max_size=5), st.integers(0, 2**16))
@settings(max_examples=40, deadline=None)
def test_mtp_targets_are_the_token_after_next_within_one_document(lengths, seed):
  rng = np.random.default_rng(seed)
  length = sum(lengths) + 2
  seg = np.zeros(length, np.int32)
  seg[:sum(lengths)] = np.repeat(np.arange(1, len(lengths) + 1), lengths)
  docs = [rng.integers(1, 50, n + 1) for n in lengths]  # each document's tokens, one past
  tokens = np.zeros(length, np.int32)
  targets = np.zeros(length, np.int32)
  mask = np.zeros(length, np.int32)
  at = 0
  for doc, n in zip(docs, lengths):
    tokens[at:at + n], targets[at:at + n] = doc[:n], doc[1:]
    mask[at:at + n] = rng.integers(0, 2, n)
    at += n
  got_t, got_m = mtp.targets_and_mask(jnp.asarray(targets[None]), jnp.asarray(mask[None]),
                                      jnp.asarray(seg[None]))
  got_t, got_m = np.asarray(got_t[0]), np.asarray(got_m[0])
  at = 0
  for doc, n in zip(docs, lengths):
    for t in range(n):  # position t of this document predicts doc[t + 2] when it exists
      counted = t + 1 < n and mask[at + t] and mask[at + t + 1]
      assert got_m[at + t] == counted
      if counted:
        assert got_t[at + t] == doc[t + 2]
    at += n
  assert not got_m[at:].any()


def _v4_config(**extra):
  return config.load("configs/v4_tiny.yaml", [
      f"model.vocab_size={V}", "model.n_layers=2", "model.mqa.compress=[4, 8]",
      "model.mqa.hca_rate=8", "model.mqa.window=6", "model.moe.experts=4",
      f"stages.0.seq_len={L}", "stages.0.batch=1", "model.mtp.depth=1", "model.mtp.weight=0.5",
      *[f"{k}={v}" for k, v in extra.items()]])


def _setup(cfg):
  mesh = mesh_lib.make_mesh(config.MeshConfig(1, 1, 1, 1), jax.devices()[:1])
  model = build.model_for(cfg, 0, mesh)
  params = build.init_params(model, jax.random.key(0), mesh, cfg.rules, L)
  return model, jax.tree_util.tree_map(
      lambda x: x + 0.05 * jax.random.normal(jax.random.key(x.size), x.shape), params)


def _batch(tokens, lengths=LENGTHS):
  seg = np.zeros(L, np.int32)
  seg[:sum(lengths)] = np.repeat(np.arange(1, len(lengths) + 1), lengths)
  pos = np.zeros(L, np.int32)
  pos[:sum(lengths)] = np.concatenate([np.arange(n) for n in lengths])
  mask = (seg > 0).astype(np.int32)
  mask[np.cumsum(lengths) - 1] = 0  # a document's last position: its target is not its own
  return {"inputs": jnp.asarray(tokens[None], jnp.int32),
          "targets": jnp.asarray(np.roll(tokens, -1)[None], jnp.int32),
          "segment_ids": jnp.asarray(seg[None]), "positions": jnp.asarray(pos[None]),
          "loss_mask": jnp.asarray(mask[None])}


@pytest.mark.parametrize("model_keys", [{}, {"model.mqa.q_lora": 0, "model.mhc.streams": 0,
                                            "model.moe.experts": 0, "model.n_kv_heads": 2,
                                            "train.optimizer": "adamw"}])
def test_mtp_loss_equals_the_block_run_on_each_document_alone(model_keys):
  """The V4 model and a dense Llama-shaped one: the packed loss's MTP part equals, for each
  document run alone, the NLL of the head over the MTP block's states at its token after
  next, weighted and divided by the main loss's count."""
  cfg = _v4_config(**model_keys)
  model, params = _setup(cfg)
  tokens = np.random.default_rng(0).integers(1, V, L)
  batch = _batch(tokens)
  _, packed = jax.jit(lambda p, b: build.loss_fn(model, p, b, cfg.rules, chunk=L))(params,
                                                                                  batch)
  plain = dataclasses.replace(cfg.model, mtp=dataclasses.replace(cfg.model.mtp, depth=0))
  without = build.model_for(dataclasses.replace(cfg, model=plain), 0)
  _, main = jax.jit(lambda p, b: build.loss_fn(without, p, b, cfg.rules, chunk=L))(params, batch)
  direct, count, at = 0.0, 0, 0
  for n in LENGTHS:
    doc = tokens[at:at + n]
    h, head = _mtp_states(model, params, doc)
    logp = jax.nn.log_softmax(h[0] @ head, axis=-1)
    direct -= float(sum(logp[t, doc[t + 2]] for t in range(n - 2)))
    count += n - 2
    at += n
  np.testing.assert_allclose(float(packed["mtp_nll"]), direct, rtol=1e-5)
  assert int(packed["mtp_count"]) == count
  np.testing.assert_allclose(float(packed["total"]),
                             float(main["total"]) + 0.5 * float(packed["mtp_nll"]), rtol=1e-5)


def _mtp_states(model, params, doc):
  """The MTP block's normalised states and the head, for one document alone."""
  n = len(doc)
  (_, head, _), sown = jax.jit(lambda p, t: model.apply(
      {"params": p}, t, jnp.arange(n)[None], jnp.ones((1, n), jnp.int32), mutable=["mtp"]))(
          params, jnp.asarray(doc[None], jnp.int32))
  return np.asarray(sown["mtp"]["hidden"][0], np.float64), np.asarray(head, np.float64)


def test_rewriting_one_document_changes_no_other_documents_mtp_loss_or_gradient():
  cfg = _v4_config()
  model, params = _setup(cfg)
  rng = np.random.default_rng(1)
  tokens = rng.integers(1, V, L)
  other = tokens.copy()
  other[13:28] = rng.integers(1, V, 15)  # the second document
  batch_a, batch_b = _batch(tokens), _batch(other)
  for b in (batch_a, batch_b):
    b["loss_mask"] = b["loss_mask"] * (b["segment_ids"] != 2)

  def mtp_total(p, b):
    return build.loss_fn(model, p, b, cfg.rules, chunk=L)[1]["total"]
  fn = jax.jit(jax.value_and_grad(mtp_total))
  (loss_a, grad_a), (loss_b, grad_b) = fn(params, batch_a), fn(params, batch_b)
  assert abs(float(loss_a) - float(loss_b)) <= 1e-6 * abs(float(loss_a))
  for a, b in zip(jax.tree.leaves(grad_a), jax.tree.leaves(grad_b)):
    a, b = np.asarray(a), np.asarray(b)
    assert np.abs(a - b).max() <= 1e-6 * max(np.abs(a).max(), 1e-12)

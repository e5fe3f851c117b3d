"""Multi-token prediction (DeepSeek-V3's report, section 2.2; V4 keeps depth 1) on packed rows.

One more block predicts, at each position t, the token after next (x_{t+2}):
  h'_t = W_join [RMSNorm(h_t) ; RMSNorm(emb(x_{t+1}))]   W_join: 2D -> D
  g_t  = Block(h'_t)    one decoder layer: the model's attention kind, a dense MLP, a plain residual
  logits_t = RMSNorm(g_t) @ head    the model's own embedding table and head
h is the decoder's last hidden state before its final norm (the streams collapsed, with mHC).
The block runs over the same row, positions and segment ids as the decoder, so its attention
stays within each document. The decoder sows g's normalised states into the "mtp" collection;
`build.loss_fn` asks for them only while training, so sampling and evaluation never compute them.

Packed rows (`targets_and_mask`): position t's MTP target is the row's target at t + 1, counted
only where t and t + 1 are loss positions of the same document. x_{t+1} is read from the row's
next input, which at a document's last position is the next document's first token: that
position's MTP loss is masked, and no other position of its document comes after it, so nothing
of the next document reaches a loss.

Written here because no JAX library has an MTP block over our decoder's layers.
"""

import dataclasses
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from maxlm.config_model import MhcConfig
from maxlm.model import layers as layers_lib
from maxlm.model.dense import dense, rms


class Mtp(nn.Module):
  cfg: Any  # the decoder's ModelConfig
  settings: Any  # the stage's transformer.Settings
  block_class: Any  # transformer.Block, remat-wrapped as the decoder's layers are

  @nn.compact
  def __call__(self, h_BxLxD, table_VxD, tokens_BxL, positions_BxL, segment_ids_BxL):
    c = self.cfg
    dt = jnp.dtype(c.dtype)
    positions_BxL, segment_ids_BxL = jnp.asarray(positions_BxL), jnp.asarray(segment_ids_BxL)
    next_BxL = jnp.pad(tokens_BxL[:, 1:], ((0, 0), (0, 1)))  # the last column is never counted
    e_BxLxD = jnp.take(table_VxD.astype(dt), next_BxL, axis=0)
    joined = jnp.concatenate([rms(h_BxLxD, c.norm_eps, self._scale("hidden_norm")),
                              rms(e_BxLxD, c.norm_eps, self._scale("embed_norm"))], axis=-1)
    x_BxLxD = dense(c.d_model, -1, (None, "embed"), c.init_std, dt, "join")(joined.astype(dt))
    plain = dataclasses.replace(c, mhc=MhcConfig())  # one residual stream
    dense_stage = dataclasses.replace(self.settings, sparse=None)  # no indexer of its own
    x_BxLxD, _ = self.block_class(plain, dense_stage, layers_lib.LayerSpec(), name="block")(
        x_BxLxD, positions_BxL, segment_ids_BxL, next_BxL)
    return rms(x_BxLxD, c.norm_eps, self._scale("norm")).astype(dt)

  def _scale(self, name):
    return self.param(name, nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                      (self.cfg.d_model,), jnp.float32)


def targets_and_mask(targets_BxL, mask_BxL, segment_ids_BxL):
  """(MTP targets, MTP loss mask): position t predicts targets[t + 1], where t and t + 1 are
  loss positions of one document."""
  shifted_BxL = jnp.pad(targets_BxL[:, 1:], ((0, 0), (0, 1)))
  same_BxL = jnp.pad(segment_ids_BxL[:, 1:] == segment_ids_BxL[:, :-1], ((0, 0), (0, 1)))
  next_mask_BxL = jnp.pad(mask_BxL[:, 1:], ((0, 0), (0, 1)))
  return shifted_BxL, mask_BxL * next_mask_BxL * same_BxL.astype(mask_BxL.dtype)

"""Cross-entropy over `loss_mask`, computed in sequence chunks so [B, L, vocab] never exists.

Each chunk's logits are rematerialised in the backward pass (`jax.checkpoint`), so the peak is
[B, chunk, vocab]. The loss is normalised by the number of loss positions; the optional z-loss
adds z * logsumexp^2 per counted position.
"""

import jax
import jax.numpy as jnp


def chunked_cross_entropy(h_BxLxD, head_DxV, targets_BxL, mask_BxL, *, chunk, z_loss=0.0):
  """Returns (loss, sums): sums has 'nll' and 'total' (with z-loss) summed over loss
  positions, their 'count', and 'nll_BxL' per position (0 where the mask is 0)."""
  b, length, d = h_BxLxD.shape
  chunk = min(chunk, length)
  extra = -length % chunk
  if extra:
    h_BxLxD = jnp.pad(h_BxLxD, [(0, 0), (0, extra), (0, 0)])
    targets_BxL = jnp.pad(targets_BxL, [(0, 0), (0, extra)])
    mask_BxL = jnp.pad(mask_BxL, [(0, 0), (0, extra)])
  n = h_BxLxD.shape[1] // chunk
  split = lambda x: jnp.moveaxis(x.reshape(b, n, chunk, *x.shape[2:]), 1, 0)

  @jax.checkpoint
  def one(args):
    h_BxCxD, t_BxC, m_BxC = args
    logits_BxCxV = jnp.einsum("bcd,dv->bcv", h_BxCxD, head_DxV.astype(h_BxCxD.dtype),
                              preferred_element_type=jnp.float32)
    lse_BxC = jax.nn.logsumexp(logits_BxCxV, axis=-1)
    target_BxC = jnp.take_along_axis(logits_BxCxV, t_BxC[..., None], axis=-1)[..., 0]
    m = m_BxC.astype(jnp.float32)
    nll_BxC = (lse_BxC - target_BxC) * m
    return nll_BxC, (nll_BxC + z_loss * lse_BxC ** 2 * m).sum()

  nll, total = jax.lax.map(one, (split(h_BxLxD), split(targets_BxL), split(mask_BxL)))
  nll_BxL = jnp.moveaxis(nll, 0, 1).reshape(b, -1)[:, :length]
  count = mask_BxL.astype(jnp.float32).sum()
  loss = total.sum() / jnp.maximum(count, 1.0)
  return loss, {"nll": nll_BxL.sum(), "total": total.sum(), "count": count, "nll_BxL": nll_BxL}

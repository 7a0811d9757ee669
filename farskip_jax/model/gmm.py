"""Grouped matrix multiply for routed experts: rows sorted by expert times that expert's weight.

    gmm(lhs [M, K], rhs [G, K, N], group_sizes [G], backend) -> [M, N]

Rows of `lhs` are sorted by group: the first group_sizes[0] rows use rhs[0], and so on; rows past
sum(group_sizes) give zeros. Backends:
- `ragged_dot`: jax.lax.ragged_dot (grouped GEMM on GPU/TPU; on CPU XLA expands it to a dense dot
  over every group, G x the useful work).
- `tiled` (CPU default): a loop over the non-empty groups; each group's weight slice is taken once
  and its rows are cut into tiles of `tile` rows plus a binary tail (tile/2, tile/4, ... down to 8
  rows, then one masked 8-row tile), each tile one plain matmul written in place. No padding copy,
  no [tiles, K, N] weight gather, at most 7 wasted rows per group. Custom VJP: d lhs is the same
  loop with the weights transposed, d rhs accumulates x_t^T dy_t per group (no scatter).
- `einsum`: pad each group to a tile multiple, gather a weight copy per tile, one batched einsum;
  plain autodiff (kept as the reference the `tiled` loop was measured against).
`auto` picks `ragged_dot` on GPU/TPU and `tiled` on CPU.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

BACKENDS = ("auto", "ragged_dot", "tiled", "einsum")
MIN_TILE = 8  # smallest tile of the binary tail; a group wastes at most MIN_TILE - 1 rows


def resolve_backend(backend: str, platform: str | None = None) -> str:
    """`auto` -> `tiled` on CPU, `ragged_dot` elsewhere; other names are returned checked."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown gmm backend {backend!r}; choose one of {BACKENDS}")
    if backend != "auto":
        return backend
    platform = platform or jax.default_backend()
    return "tiled" if platform == "cpu" else "ragged_dot"


# ----------------------------------------------------------------------------------------------
# tiled: per-group loop, binary tail, custom VJP


def _tile_classes(m: int, tile: int) -> tuple[int, ...]:
    """Tile row counts: (P, P/2, ..., >= MIN_TILE) with P = min(tile, m)."""
    p = max(1, min(tile, m))
    classes = [p]
    while classes[-1] // 2 >= MIN_TILE:
        classes.append(classes[-1] // 2)
    return tuple(classes)


def _group_walk(group_sizes: jax.Array, m: int, tile: int, carry, group_init, tile_fn, group_done):
    """Run `tile_fn` over the row tiles of every non-empty group, in group order.

    group_init(g, carry) -> gstate (e.g. the weight slice);
    tile_fn(gstate, carry, start, p, mask | None) -> carry: rows [start, start + p) (mask [p] bool
      marks the group's rows when the tile is the masked tail, else every row belongs to the group);
    group_done(g, gstate, carry) -> carry.
    """
    classes = _tile_classes(m, tile)
    big, pmin = classes[0], classes[-1]
    gs = group_sizes.astype(jnp.int32)
    ends = jnp.minimum(jnp.cumsum(gs), m)
    starts = ends - jnp.minimum(gs, ends)
    sizes = ends - starts
    ng = gs.shape[0]
    live = jnp.nonzero(sizes > 0, size=ng, fill_value=0)[0].astype(jnp.int32)
    n_live = jnp.sum(sizes > 0).astype(jnp.int32)

    def one_group(i, carry):
        g = live[i]
        start, size = starts[g], sizes[g]
        gstate = group_init(g, carry)
        nbig = size // big

        def big_tile(t, c):
            return tile_fn(gstate, c, start + t * big, big, None)

        carry = jax.lax.fori_loop(0, nbig, big_tile, carry)
        pos = start + nbig * big
        rem = size - nbig * big
        for p in classes[1:]:  # binary tail: at most one tile of each smaller size
            take = (rem >= p).astype(jnp.int32)
            carry = jax.lax.fori_loop(0, take, lambda _, c, p=p, pos=pos: tile_fn(gstate, c, pos, p, None), carry)
            pos = pos + take * p
            rem = rem - take * p

        def tail(_, c):  # rem < pmin rows: one masked pmin tile, shifted back if it would pass m
            s0 = jnp.minimum(pos, m - pmin)
            rows = s0 + jnp.arange(pmin, dtype=jnp.int32)
            return tile_fn(gstate, c, s0, pmin, (rows >= pos) & (rows < pos + rem))

        carry = jax.lax.fori_loop(0, (rem > 0).astype(jnp.int32), tail, carry)
        return group_done(g, gstate, carry)

    return jax.lax.fori_loop(0, n_live, one_group, carry)


def _dot(a, b, contract_b: int):
    """a [p, K] . b (contracting b's axis `contract_b`), float32 accumulation."""
    return jax.lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())), preferred_element_type=jnp.float32)


def _gmm_loop(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, tile: int, transpose_rhs: bool) -> jax.Array:
    """out[rows of g] = lhs[rows of g] @ rhs[g] (or rhs[g]^T when transpose_rhs)."""
    m = lhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    out = jnp.zeros((m, n), lhs.dtype)

    def tile_fn(w, out, start, p, mask):
        x = jax.lax.dynamic_slice_in_dim(lhs, start, p, 0)
        y = _dot(x, w, 1 if transpose_rhs else 0).astype(out.dtype)
        if mask is not None:
            y = jnp.where(mask[:, None], y, jax.lax.dynamic_slice_in_dim(out, start, p, 0))
        return jax.lax.dynamic_update_slice_in_dim(out, y, start, 0)

    return _group_walk(group_sizes, m, tile, out,
                       lambda g, _: jax.lax.dynamic_index_in_dim(rhs, g, 0, keepdims=False),
                       tile_fn, lambda g, w, out: out)


def _tgmm_loop(lhs: jax.Array, dy: jax.Array, group_sizes: jax.Array, tile: int, out_dtype) -> jax.Array:
    """drhs[g] = lhs[rows of g]^T @ dy[rows of g]: [G, K, N], zeros for empty groups."""
    m, k = lhs.shape
    n = dy.shape[1]
    out = jnp.zeros((group_sizes.shape[0], k, n), out_dtype)

    def init(g, carry):
        return g

    def tile_acc(g, carry, start, p, mask):
        out, acc = carry
        x = jax.lax.dynamic_slice_in_dim(lhs, start, p, 0)
        if mask is not None:
            x = jnp.where(mask[:, None], x, 0)
        d = jax.lax.dynamic_slice_in_dim(dy, start, p, 0)
        acc = acc + jax.lax.dot_general(x, d, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return out, acc

    def done(g, _, carry):
        out, acc = carry
        out = jax.lax.dynamic_update_index_in_dim(out, acc.astype(out.dtype), g, 0)
        return out, jnp.zeros_like(acc)

    carry = (out, jnp.zeros((k, n), jnp.float32))
    return _group_walk(group_sizes, m, tile, carry, init, tile_acc, done)[0]


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tiled(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, tile: int) -> jax.Array:
    return _gmm_loop(lhs, rhs, group_sizes, tile, transpose_rhs=False)


def _tiled_fwd(lhs, rhs, group_sizes, tile):
    return _gmm_loop(lhs, rhs, group_sizes, tile, transpose_rhs=False), (lhs, rhs, group_sizes)


def _tiled_bwd(tile, res, dy):
    lhs, rhs, group_sizes = res
    dy = dy.astype(lhs.dtype)
    dlhs = _gmm_loop(dy, rhs, group_sizes, tile, transpose_rhs=True)
    drhs = _tgmm_loop(lhs, dy, group_sizes, tile, rhs.dtype)
    return dlhs, drhs, None


_tiled.defvjp(_tiled_fwd, _tiled_bwd)


# ----------------------------------------------------------------------------------------------
# einsum: padded tiles, weight copy per tile, plain autodiff (reference)


def _einsum(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, tile: int) -> jax.Array:
    m, k = lhs.shape
    g, _, n = rhs.shape
    tile = max(1, min(tile, m))
    num_tiles = -(-m // tile) + g  # static upper bound on sum(ceil(size / tile))
    gs = group_sizes.astype(jnp.int32)
    offsets = jnp.cumsum(gs) - gs
    padded = (gs + tile - 1) // tile * tile
    padded_end = jnp.cumsum(padded)
    padded_off = padded_end - padded
    p = jnp.arange(num_tiles * tile, dtype=jnp.int32)  # padded slot -> source row (or invalid)
    slot_group = jnp.minimum(jnp.searchsorted(padded_end, p, side="right"), g - 1)
    rank = p - padded_off[slot_group]
    valid = (rank < gs[slot_group]) & (offsets[slot_group] + rank < m)
    src = jnp.where(valid, offsets[slot_group] + rank, 0)
    x_pad = jnp.where(valid[:, None], lhs[src], 0).reshape(num_tiles, tile, k)
    tile_group = slot_group[::tile]
    y_pad = jnp.einsum("tmk,tkn->tmn", x_pad, rhs[tile_group],
                       preferred_element_type=jnp.float32).reshape(num_tiles * tile, n)
    r = jnp.arange(m, dtype=jnp.int32)  # source row -> padded slot
    ends = jnp.cumsum(gs)
    row_group = jnp.minimum(jnp.searchsorted(ends, r, side="right"), g - 1)
    row_valid = r < ends[-1]
    dest = padded_off[row_group] + (r - offsets[row_group])
    return jnp.where(row_valid[:, None], y_pad[jnp.where(row_valid, dest, 0)], 0).astype(lhs.dtype)


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, backend: str = "auto", tile: int = 128) -> jax.Array:
    """Grouped matmul; see the module docstring. Accumulates in float32, returns lhs.dtype.

    lhs: [M, K] rows sorted by group; rhs: [G, K, N]; group_sizes: [G] int, sum <= M.
    """
    backend = resolve_backend(backend)
    if lhs.shape[0] == 0:
        return jnp.zeros((0, rhs.shape[2]), lhs.dtype)
    with jax.named_scope(f"gmm_{backend}"):
        if backend == "ragged_dot":
            return jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32),
                                      preferred_element_type=jnp.float32).astype(lhs.dtype)
        if backend == "tiled":
            return _tiled(lhs, rhs, group_sizes, tile)
        return _einsum(lhs, rhs, group_sizes, tile)

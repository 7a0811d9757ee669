"""Grouped matrix multiply for routed experts: rows sorted by expert times that expert's weight.

    gmm(lhs [M, K], rhs [G, K, N], group_sizes [G], backend) -> [M, N]

Rows of `lhs` are sorted by group: the first group_sizes[0] rows use rhs[0], and so on; rows past
sum(group_sizes) give zeros. Backends (plain JAX):
- `ragged_dot`: jax.lax.ragged_dot (grouped GEMM on GPU/TPU; on CPU XLA expands it to a dense dot
  over every group, G x the useful work).
- `tiled` (the CPU default without the CPU kernels): a flat walk over the groups. Each group's rows
  are one masked window of a bucketed row count (8, 16, 32, 64, 96, ... in steps of 32 up to `tile` = 256), plus full tiles of
  `tile` rows for groups larger than that; one loop per bucket and one over the full tiles, so the
  loop count does not grow with the number of groups. One matmul per group and weight, its weight
  slice taken once. Custom VJP: d lhs is the same walk with the weights transposed; d rhs is
  x^T dy per window, written on a group's first visit (no zero-filled read-modify-write).
- `einsum`: pad each group to a tile multiple, gather a weight copy per tile, one batched einsum;
  plain autodiff (a reference for the `tiled` walk).
- a name registered in the op registry (kernels/ops.py): `blas`, the C++ CPU kernel of
  kernels/cpu/ when the config enables it (`auto` picks it on CPU then).
`auto` picks `ragged_dot` on GPU/TPU, on CPU a registered CPU backend or else `tiled`.

`grouped_swiglu(xs, wg, wu, wd, group_sizes, tile)` runs a whole SwiGLU expert (gate, up, down) in
one walk with a one-walk custom VJP; it is what the tiled backend runs (model/experts.expert_swiglu).
The walk keeps one group's rows and weights in cache (XLA:CPU is memory-bound on these shapes).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from farskip_jax.kernels import ops

BUILTINS = ("ragged_dot", "tiled", "einsum")
BACKENDS = ("auto", "blas", *BUILTINS)  # the values of runtime.gmm (`blas`: a registered CPU kernel)
MIN_TILE = 8  # smallest tail window


def resolve_backend(backend: str, platform: str | None = None, devices: int = 1) -> str:
    """`auto` -> a registered backend of the platform (ops.resolve), else `tiled` on CPU and
    `ragged_dot` elsewhere; other names are returned checked (a registered one on its platform only)."""
    if backend not in BACKENDS and ops.registered(ops.GROUPED_MATMUL, backend) is None:
        raise ValueError(f"unknown gmm backend {backend!r}; choose one of {BACKENDS}")
    return ops.resolve(ops.GROUPED_MATMUL, backend, key="runtime.gmm", builtins=BUILTINS, platform=platform,
                       devices=devices, default=lambda p: "tiled" if p == "cpu" else "ragged_dot")


def takes_stored_weights(backend: str) -> bool:
    """Whether the grouped-matmul backend `backend` (resolved) wants the expert weights as stored
    (a kernel that rounds them to the compute dtype itself) rather than cast beforehand."""
    b = ops.registered(ops.GROUPED_MATMUL, backend)
    return b is not None and b.stored_weights


# ----------------------------------------------------------------------------------------------
# tiled: flat walk (one masked tail window per group + full tiles), custom VJP


def _buckets(m: int, tile: int) -> tuple[int, ...]:
    """Row counts of the one masked tail window per group, up to P = min(tile, m): 8, 16, then
    linear steps of max(32, P / 8) rows (at most ~10 loop bodies to compile; a group's window
    wastes fewer than one step of rows)."""
    p = max(1, min(tile, m))
    step = max(4 * MIN_TILE, -(-(p // 8) // MIN_TILE) * MIN_TILE)
    out = [b for b in (MIN_TILE, 2 * MIN_TILE) if b < min(step, p)]
    b = step
    while b < p:
        out.append(b)
        b += step
    out.append(p)
    return tuple(out)


def _group_walk(group_sizes: jax.Array, m: int, tile: int, carry, group_init, tile_fn):
    """Run `tile_fn` over one tail window and any full tiles of every non-empty group.

    A group of s rows is cut into n = (s - 1) // P full tiles of P = min(tile, m) rows and one
    tail window holding the other r = s - n * P rows (0 < r <= P), whose row count is the smallest
    bucket (_buckets) >= r; the window's rows beyond r belong to other groups and are masked. The
    schedule is flat: one loop per bucket over the groups whose tail falls in it, then one loop
    over every group's full tiles -- 1 + len(buckets) loops whatever the number of groups (a loop
    per group made thousands of tiny thunks on XLA:CPU). Tails come first, so a group's first
    visit is its tail (`first=True`: gradient buffers are written, not read and added to). With the
    default P (>= most groups' size) every group is one matmul per weight, its slice read once.

    group_init(g, carry) -> gstate (e.g. the weight slice);
    tile_fn(g, gstate, carry, start, p, mask | None, first) -> carry: rows [start, start + p);
      mask [p] bool marks the group's rows (None: every row belongs to the group); first (static):
      the group's first visit (its tail window), false for full tiles.
    """
    buckets = _buckets(m, tile)
    big = buckets[-1]
    gs = group_sizes.astype(jnp.int32)
    ends = jnp.minimum(jnp.cumsum(gs), m)  # rows past m are not computed
    starts = ends - jnp.minimum(gs, ends)
    sizes = ends - starts
    ng = gs.shape[0]
    nfull = jnp.maximum(sizes - 1, 0) // big
    pos = starts + nfull * big  # tail window start
    rem = sizes - nfull * big  # tail rows, in (0, big] for a non-empty group
    lo = 0
    for b in buckets:
        sel = (rem > lo) & (rem <= b)
        groups_b = jnp.nonzero(sel, size=ng, fill_value=0)[0].astype(jnp.int32)

        def tail(i, c, b=b, groups_b=groups_b):
            g = groups_b[i]
            s0 = jnp.minimum(pos[g], m - b)  # shifted back when the window would pass row m
            rows = s0 + jnp.arange(b, dtype=jnp.int32)
            mask = (rows >= pos[g]) & (rows < pos[g] + rem[g])
            return tile_fn(g, group_init(g, c), c, s0, b, mask, True)

        carry = jax.lax.fori_loop(0, jnp.sum(sel).astype(jnp.int32), tail, carry)
        lo = b
    # full tiles, in group order: tile t belongs to group tile_group[t]
    max_full = max(0, (m - 1) // big)
    if max_full:
        cum = jnp.cumsum(nfull)
        t = jnp.arange(max_full, dtype=jnp.int32)
        tile_group = jnp.minimum(jnp.searchsorted(cum, t, side="right"), ng - 1).astype(jnp.int32)
        tile_start = starts[tile_group] + (t - (cum[tile_group] - nfull[tile_group])) * big

        def full_tile(i, c):
            g = tile_group[i]
            return tile_fn(g, group_init(g, c), c, tile_start[i], big, None, False)

        carry = jax.lax.fori_loop(0, cum[-1], full_tile, carry)
    return carry


def _acc_group(buf: jax.Array, g, val: jax.Array, first: bool) -> jax.Array:
    """buf[g] = val on a group's first visit, else buf[g] += val (buf: [G, K, N], val: [K, N])."""
    val = val.astype(buf.dtype)
    if not first:
        val = jax.lax.dynamic_index_in_dim(buf, g, 0, keepdims=False) + val
    return jax.lax.dynamic_update_index_in_dim(buf, val, g, 0)


def _dot(a, b, contract_b: int):
    """a [p, K] . b (contracting b's axis `contract_b`), float32 accumulation."""
    return jax.lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())), preferred_element_type=jnp.float32)


def _gmm_loop(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, tile: int, transpose_rhs: bool) -> jax.Array:
    """out[rows of g] = lhs[rows of g] @ rhs[g] (or rhs[g]^T when transpose_rhs)."""
    m = lhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    out = jnp.zeros((m, n), lhs.dtype)

    def tile_fn(g, w, out, start, p, mask, first):
        x = jax.lax.dynamic_slice_in_dim(lhs, start, p, 0)
        y = _dot(x, w, 1 if transpose_rhs else 0).astype(out.dtype)
        if mask is not None:
            y = jnp.where(mask[:, None], y, jax.lax.dynamic_slice_in_dim(out, start, p, 0))
        return jax.lax.dynamic_update_slice_in_dim(out, y, start, 0)

    return _group_walk(group_sizes, m, tile, out,
                       lambda g, _: jax.lax.dynamic_index_in_dim(rhs, g, 0, keepdims=False),
                       tile_fn)


def _tgmm_loop(lhs: jax.Array, dy: jax.Array, group_sizes: jax.Array, tile: int, out_dtype) -> jax.Array:
    """drhs[g] = lhs[rows of g]^T @ dy[rows of g]: [G, K, N], zeros for empty groups."""
    m, k = lhs.shape
    n = dy.shape[1]
    out = jnp.zeros((group_sizes.shape[0], k, n), out_dtype)

    def tile_fn(g, _, out, start, p, mask, first):
        x = jax.lax.dynamic_slice_in_dim(lhs, start, p, 0)
        if mask is not None:
            x = jnp.where(mask[:, None], x, 0)
        d = jax.lax.dynamic_slice_in_dim(dy, start, p, 0)
        xd = jax.lax.dot_general(x, d, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return _acc_group(out, g, xd, first)

    return _group_walk(group_sizes, m, tile, out, lambda g, _: None, tile_fn)


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
# fused SwiGLU experts on the tiled walk: y = (silu(x Wg) * (x Wu)) Wd per group, one walk forward
# (gate/up pre-activations kept as residuals) and one walk backward


def _neg_zeros(shape, dtype) -> jax.Array:
    """-0.0 everywhere: equal to zeros, but a different constant, so XLA does not merge it with a
    zeros buffer of the same shape and then copy one of the two loop carries."""
    return jnp.full(shape, -0.0, dtype)


def _silu_parts(g):
    sig = jax.nn.sigmoid(g)
    return g * sig, sig * (1 + g * (1 - sig))  # silu(g), silu'(g)


def _masked_write(buf, val, start, p, mask):
    if mask is not None:
        val = jnp.where(mask[:, None], val, jax.lax.dynamic_slice_in_dim(buf, start, p, 0))
    return jax.lax.dynamic_update_slice_in_dim(buf, val, start, 0)


def _weight_slices(wg, wu, wd):
    def init(g, _):
        return tuple(jax.lax.dynamic_index_in_dim(w, g, 0, keepdims=False) for w in (wg, wu, wd))
    return init


def _swiglu_fwd_walk(xs, wg, wu, wd, group_sizes, tile):
    """y [M, d] and the gate/up pre-activations [M, h] each (the backward's residuals)."""
    m = xs.shape[0]
    h, d_out = wd.shape[1], wd.shape[2]
    init = (jnp.zeros((m, d_out), xs.dtype), jnp.zeros((m, h), xs.dtype), _neg_zeros((m, h), xs.dtype))

    def tile_fn(g, w, carry, start, p, mask, first):
        y, gbuf, ubuf = carry
        x = jax.lax.dynamic_slice_in_dim(xs, start, p, 0)
        ga, ua = _dot(x, w[0], 0), _dot(x, w[1], 0)
        yt = _dot((jax.nn.silu(ga) * ua).astype(xs.dtype), w[2], 0)
        return (_masked_write(y, yt.astype(xs.dtype), start, p, mask),
                _masked_write(gbuf, ga.astype(xs.dtype), start, p, mask),
                _masked_write(ubuf, ua.astype(xs.dtype), start, p, mask))

    return _group_walk(group_sizes, m, tile, init, _weight_slices(wg, wu, wd), tile_fn)


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def grouped_swiglu(xs, wg, wu, wd, group_sizes, tile: int = 256):
    """Routed SwiGLU experts on rows sorted by expert, one walk forward and one backward (CPU).

    xs: [M, d]; wg, wu: [G, d, h]; wd: [G, h, d]; group_sizes: [G]; -> [M, d] with
    y[rows of g] = (silu(xs Wg[g]) * (xs Wu[g])) Wd[g], zeros past sum(group_sizes).
    """
    return _swiglu_fwd_walk(xs, wg, wu, wd, group_sizes, tile)[0]


def _grouped_swiglu_fwd(xs, wg, wu, wd, group_sizes, tile):
    y, ga, ua = _swiglu_fwd_walk(xs, wg, wu, wd, group_sizes, tile)
    return y, (xs, wg, wu, wd, group_sizes, ga, ua)


def _grouped_swiglu_bwd(tile, res, dy):
    xs, wg, wu, wd, group_sizes, ga_all, ua_all = res
    dy = dy.astype(xs.dtype)
    init = (jnp.zeros_like(xs), jnp.zeros_like(wg), _neg_zeros(wu.shape, wu.dtype), jnp.zeros_like(wd))
    tn = (((0,), (0,)), ((), ()))  # a^T b over rows

    def tile_fn(g, w, carry, start, p, mask, first):
        dx, dwg, dwu, dwd = carry
        sl = lambda a: jax.lax.dynamic_slice_in_dim(a, start, p, 0)  # noqa: E731
        x, ga, ua, dyt = sl(xs), sl(ga_all).astype(jnp.float32), sl(ua_all).astype(jnp.float32), sl(dy)
        if mask is not None:  # rows of other groups contribute nothing
            dyt = jnp.where(mask[:, None], dyt, 0)
        s_g, ds_g = _silu_parts(ga)
        hid = (s_g * ua).astype(xs.dtype)
        dh = _dot(dyt, w[2], 1)  # dy Wd^T: [p, h]
        du = (dh * s_g).astype(xs.dtype)
        dg = (dh * ua * ds_g).astype(xs.dtype)
        dxt = _dot(dg, w[0], 1) + _dot(du, w[1], 1)
        dwd = _acc_group(dwd, g, jax.lax.dot_general(hid, dyt, tn, preferred_element_type=jnp.float32), first)
        dwg = _acc_group(dwg, g, jax.lax.dot_general(x, dg, tn, preferred_element_type=jnp.float32), first)
        dwu = _acc_group(dwu, g, jax.lax.dot_general(x, du, tn, preferred_element_type=jnp.float32), first)
        return _masked_write(dx, dxt.astype(dx.dtype), start, p, mask), dwg, dwu, dwd

    dx, dwg, dwu, dwd = _group_walk(group_sizes, xs.shape[0], tile, init, _weight_slices(wg, wu, wd), tile_fn)
    return dx, dwg, dwu, dwd, None


grouped_swiglu.defvjp(_grouped_swiglu_fwd, _grouped_swiglu_bwd)


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

    lhs: [M, K] rows sorted by group; rhs: [G, K, N] (any float dtype: used rounded to lhs.dtype);
    group_sizes: [G] int, sum <= M.
    """
    backend = resolve_backend(backend)
    if lhs.shape[0] == 0:
        return jnp.zeros((0, rhs.shape[2]), lhs.dtype)
    with jax.named_scope(f"gmm_{backend}"):
        registered = ops.registered(ops.GROUPED_MATMUL, backend)
        if registered is not None:  # casts rhs itself where it takes stored weights
            return registered.fn(lhs, rhs, group_sizes)
        rhs = rhs.astype(lhs.dtype)
        if backend == "ragged_dot":
            return jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32),
                                      preferred_element_type=jnp.float32).astype(lhs.dtype)
        if backend == "tiled":
            return _tiled(lhs, rhs, group_sizes, tile)
        return _einsum(lhs, rhs, group_sizes, tile)

"""Routed SwiGLU experts and the single-device (`local`) dispatch/compute/combine.

Expert weights: w_gate, w_up [E, d_model, hidden], w_down [E, hidden, d_model], logical axes
("expert", "embed", "mlp"). The token exchange is a pluggable `RoutedComputeFn`:

    routed_compute(x [b, s, d], route: RouteResult, experts: ExpertWeights, cfg: RuntimeConfig)
        -> RoutedOutput(y [b, s, d], dropped [] int32)

`local_routed_compute` (here) sorts the b*s*k assignments by expert, runs the grouped matmul
(kernels/gmm.py) on exactly those rows (dropless unless `capacity_factor` is set), and un-sorts. The
expert-parallel versions live in parallel/ (every collective does) and have the same signature.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx, struct

from farskip_jax.config import RuntimeConfig
from farskip_jax.kernels.gmm import gmm, grouped_swiglu, resolve_backend, takes_stored_weights
from farskip_jax.model.layers import normal_init
from farskip_jax.model.router import RouteResult


@struct.dataclass
class ExpertWeights:
    w_gate: jax.Array  # [E, d, h]
    w_up: jax.Array  # [E, d, h]
    w_down: jax.Array  # [E, h, d]


@struct.dataclass
class RoutedOutput:
    y: jax.Array  # [b, s, d]
    dropped: jax.Array  # [] number of dropped (token, expert) assignments


class RoutedExperts(nnx.Module):
    """The E routed experts' weights (stored in param_dtype, used in the compute dtype: the MoE casts
    the routed rows to `compute_dtype`; `weights(gmm)` says where the weights are rounded)."""

    def __init__(self, d_model: int, hidden: int, num_experts: int, *, rngs: nnx.Rngs, std: float = 0.02,
                 param_dtype=jnp.float32, compute_dtype=jnp.float32):
        ax = ("expert", "embed", "mlp")
        self.w_gate = nnx.Param(normal_init(rngs, (num_experts, d_model, hidden), std, param_dtype), axes=ax)
        self.w_up = nnx.Param(normal_init(rngs, (num_experts, d_model, hidden), std, param_dtype), axes=ax)
        self.w_down = nnx.Param(normal_init(rngs, (num_experts, hidden, d_model), std, param_dtype),
                                axes=("expert", "mlp", "embed"))
        self.compute_dtype = compute_dtype

    def weights(self, gmm: str = "auto") -> ExpertWeights:
        """The weights for the grouped-matmul backend `gmm` (cfg.runtime.gmm): cast to the compute dtype
        here, outside any expert-parallel shard_map (so GPU programs reduce the weight gradients in
        the compute dtype), unless the backend takes them as stored (gmm.takes_stored_weights: a
        kernel that rounds float32 weights as it packs them, with float32 gradients and no cast pass)."""
        if takes_stored_weights(resolve_backend(gmm)):
            return ExpertWeights(self.w_gate[...], self.w_up[...], self.w_down[...])
        c = self.compute_dtype
        return ExpertWeights(self.w_gate[...].astype(c), self.w_up[...].astype(c), self.w_down[...].astype(c))


def expert_swiglu(xs: jax.Array, group_sizes: jax.Array, ew: ExpertWeights, cfg: RuntimeConfig) -> jax.Array:
    """Rows xs [M, d] sorted by expert (group_sizes [E]) -> expert outputs [M, d].

    `tiled` runs the fused per-group SwiGLU walk (gmm.grouped_swiglu); other backends three gmms."""
    if resolve_backend(cfg.gmm) == "tiled":
        return grouped_swiglu(xs, ew.w_gate, ew.w_up, ew.w_down, group_sizes, cfg.gmm_tile)
    g = gmm(xs, ew.w_gate, group_sizes, cfg.gmm, cfg.gmm_tile)
    u = gmm(xs, ew.w_up, group_sizes, cfg.gmm, cfg.gmm_tile)
    return gmm(jax.nn.silu(g) * u, ew.w_down, group_sizes, cfg.gmm, cfg.gmm_tile)


def capacity(num_assignments: int, num_experts: int, capacity_factor: float | None) -> int:
    """Per-expert slot count: ceil(cf * assignments / E), or all assignments when dropless."""
    if capacity_factor is None:
        return num_assignments
    return max(1, math.ceil(capacity_factor * num_assignments / num_experts))


def sort_by_expert(expert_of: jax.Array, num_experts: int):
    """expert_of [N] -> (order [N] sorting assignments by expert, group_sizes [E], rank [N] within expert)."""
    order = jnp.argsort(expert_of, stable=True)
    group_sizes = jnp.bincount(expert_of, length=num_experts).astype(jnp.int32)
    starts = jnp.cumsum(group_sizes) - group_sizes
    sorted_e = expert_of[order]
    rank_sorted = jnp.arange(expert_of.shape[0], dtype=jnp.int32) - starts[sorted_e]
    rank = jnp.zeros_like(rank_sorted).at[order].set(rank_sorted)
    return order, group_sizes, rank


def inverse_permutation(perm: jax.Array) -> jax.Array:
    """perm [N] (a permutation of 0..N-1) -> inv [N] with inv[perm[i]] = i."""
    n = perm.shape[0]
    return jnp.zeros((n,), jnp.int32).at[perm].set(jnp.arange(n, dtype=jnp.int32), unique_indices=True)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def expand_rows(x: jax.Array, order: jax.Array, inv: jax.Array, k: int) -> jax.Array:
    """x [T, d] -> x[order // k] [T*k, d]: the T*k (token, choice) assignments in `order`.

    order [T*k] is a permutation of the assignments (assignment a = token * k + choice), inv its
    inverse. VJP: dx[t] = sum_j g[inv[t*k + j]], a gather and a sum (no scatter-add)."""
    return x[order // k]


def _expand_rows_fwd(x, order, inv, k):
    return x[order // k], (order, inv)


def _expand_rows_bwd(k, res, g):
    order, inv = res
    return g[inv].reshape(-1, k, g.shape[-1]).sum(1), None, None


expand_rows.defvjp(_expand_rows_fwd, _expand_rows_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def weighted_combine(ys: jax.Array, inv: jax.Array, order: jax.Array, w: jax.Array, k: int) -> jax.Array:
    """Expert outputs back to tokens: ys [N = T*k, d] in sorted order, inv [N] the sorted position of
    assignment a = t*k + j (order its inverse), w [T, k] the routing weights ->
    y [T, d] = sum_j w[t, j] * ys[inv[t*k + j]].

    One gather-multiply-reduce pass (no [N, d] un-sorted copy); the VJP is gathers too:
    d ys[i] = w.flat[order[i]] * g[order[i] // k], d w[t, j] = <g[t], ys[inv[t*k + j]]>."""
    return _combine(ys, inv, w, k)


def _combine(ys, inv, w, k):
    return (ys[inv].reshape(-1, k, ys.shape[-1]) * w[..., None]).sum(1)


def _weighted_combine_fwd(ys, inv, order, w, k):
    return _combine(ys, inv, w, k), (ys, inv, order, w)


def _weighted_combine_bwd(k, res, g):
    ys, inv, order, w = res
    d_ys = g[order // k] * w.reshape(-1)[order][:, None]
    f32 = jnp.float32  # the dot over d accumulates in float32 whatever the compute dtype
    d_w = (ys[inv].reshape(-1, k, ys.shape[-1]).astype(f32) * g[:, None, :].astype(f32)).sum(-1)
    return d_ys, None, None, d_w.astype(w.dtype)


weighted_combine.defvjp(_weighted_combine_fwd, _weighted_combine_bwd)


def local_routed_compute(x: jax.Array, route: RouteResult, experts: ExpertWeights, cfg: RuntimeConfig) -> RoutedOutput:
    """Single-device routed experts: sort assignments by expert, grouped matmul, weighted un-sort.

    x: [b, s, d]; route.indices / route.weights: [b, s, k]. Assignment a = token * k + choice.
    Dropless (cfg.capacity_factor None): every assignment is computed. With a capacity factor, an
    expert keeps its first `capacity` assignments in token order; the rest are moved past the
    groups (the grouped matmul gives them zeros) and counted in `dropped`.
    """
    b, s, d = x.shape
    k = route.indices.shape[-1]
    e = experts.w_gate.shape[0]
    xt = x.reshape(b * s, d)
    flat_e = route.indices.reshape(-1).astype(jnp.int32)  # [N = b*s*k]
    n = flat_e.shape[0]
    with jax.named_scope("dispatch"):
        order, group_sizes, rank = sort_by_expert(flat_e, e)
        if cfg.capacity_factor is None:
            kept = jnp.ones((n,), bool)
            kept_sizes = group_sizes
        else:
            cap = capacity(n, e, cfg.capacity_factor)
            kept = rank < cap  # [N] in assignment order
            kept_sizes = jnp.minimum(group_sizes, cap)
            # keep dropped rows out of the groups: move them to the end of the sort
            order = jnp.argsort(jnp.where(kept, flat_e, e), stable=True).astype(jnp.int32)
        inv = inverse_permutation(order)
        xs = expand_rows(xt, order, inv, k)  # [N, d] sorted by expert
    with jax.named_scope("expert_compute"):
        ys = expert_swiglu(xs, kept_sizes, experts, cfg)  # dropped rows (past the groups) are 0
    with jax.named_scope("combine"):
        w = route.weights.reshape(b * s, k).astype(ys.dtype)
        y = weighted_combine(ys, inv, order, w, k).reshape(b, s, d)
    dropped = jnp.sum(~kept).astype(jnp.int32)
    return RoutedOutput(y=y, dropped=dropped)


RoutedComputeFn = Callable[[jax.Array, RouteResult, ExpertWeights, RuntimeConfig], RoutedOutput]

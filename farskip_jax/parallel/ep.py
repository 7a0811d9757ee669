"""Expert-parallel token exchange: `RoutedComputeFn` backends written in `jax.shard_map`.

Every backend has the signature of `local_routed_compute` (model/experts.py):

    backend(x [b, s, d], route: RouteResult, experts: ExpertWeights, cfg: MoEConfig) -> RoutedOutput

The b*s tokens are split over data x fsdp x expert (every token-parallel shard takes part); the E
experts over `expert` (ep = mesh.shape["expert"], E_l = E / ep per device; global expert e lives
on expert-rank e // E_l). Per device, in three named steps; dispatch and combine are separate
collectives, so XLA can schedule the combine of layer k-1 under the attention of layer k (FarSkip,
DESIGN.md §1-2):

  dispatch        sort the T_l*k local assignments by expert, pack them, exchange over `expert`
  expert_compute  grouped SwiGLU (model/experts.expert_swiglu) on the rows that arrived, packed
                  expert-major so the grouped matmul skips empty capacity slots
  combine         exchange the outputs back, un-pack, weight by the router and sum over top-k

Backends:
- `LocalCompute`: no exchange (experts replicated); shard_map only to keep the sort per device.
- `AllToAllCompute`: `jax.lax.all_to_all` of fixed buffers [ep, E_l, C, d]: C slots per (source,
  expert). C = capacity(T_l*k, E, capacity_factor) (model/experts.capacity), at most T_l; dropless
  (capacity_factor None) uses the worst case C = T_l (top-k experts are distinct, so one source
  sends an expert at most one row per token). Assignments past C are dropped: their output is 0
  (the token passes through the residual) and they are counted in `dropped` (summed over shards).
  Buffers move E/k times the useful bytes when dropless; ~capacity_factor times with capacity.
- `RaggedCompute`: `jax.lax.ragged_all_to_all` (GPU/TPU), dropless, moving only the real rows:
  offsets and sizes come from the all-gathered traffic matrix [ep, E] (MaxText's scheme).
  XLA:CPU cannot compile it, so on CPU it fails early with a BackendError naming `all_to_all`.

Each backend is a frozen dataclass (hashable: NNX keeps it as static module metadata).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from farskip_jax.config import MoEConfig
from farskip_jax.errors import BackendError, ConfigError
from farskip_jax.model.experts import (ExpertWeights, RoutedOutput, capacity, expert_swiglu,
                                       local_routed_compute, sort_by_expert)
from farskip_jax.model.router import RouteResult
from farskip_jax.parallel.mesh import BATCH_AXES, batch_shards, mesh_platform

EXPERT_AXIS = "expert"
_W_SPEC = P(EXPERT_AXIS, None, None)  # expert weights [E, d, h] / [E, h, d]


def _tok_spec(ndim: int) -> P:
    return P(BATCH_AXES, *([None] * (ndim - 1)))


def _check_tokens(n_tokens: int, mesh: Mesh) -> None:
    n = batch_shards(mesh)
    if n_tokens % n:
        raise ConfigError(
            f"expert parallelism splits the {n_tokens} tokens of the batch (batch x seq) over "
            f"data x fsdp x expert = {n} shards; make batch x seq a multiple of {n}"
        )


def _exchange(body: Callable, mesh: Mesh, x, route: RouteResult, experts: ExpertWeights, w_spec: P) -> RoutedOutput:
    """Flatten tokens, run `body(x [T_l,d], idx [T_l,k], w [T_l,k], wg, wu, wd) -> (y, dropped)` per
    device under shard_map, restore [b, s, d]."""
    b, s, d = x.shape
    k = route.indices.shape[-1]
    _check_tokens(b * s, mesh)
    fn = jax.shard_map(
        body, mesh=mesh,
        in_specs=(_tok_spec(2), _tok_spec(2), _tok_spec(2), w_spec, w_spec, w_spec),
        out_specs=(_tok_spec(2), P()),
        # The body runs model code (gmm's fori_loops) that does not track manual axes (VMA), so
        # check_vma is off. Gradients stay right: shard_map's transpose then psums the cotangents of
        # inputs over the axes their specs leave out (weights over data/fsdp); tests compare every
        # gradient with the single-device path.
        check_vma=False,
    )
    y, dropped = fn(x.reshape(b * s, d), route.indices.reshape(b * s, k), route.weights.reshape(b * s, k),
                    experts.w_gate, experts.w_up, experts.w_down)
    return RoutedOutput(y=y.reshape(b, s, d), dropped=dropped)


# --------------------------------------------------------------------------------------------------
# local: experts replicated, each device sorts its own tokens
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LocalCompute:
    """`local_routed_compute` per device (experts replicated on every device). Capacity, when set,
    applies per device (ranks are counted within a device's tokens)."""

    mesh: Mesh

    def __call__(self, x, route: RouteResult, experts: ExpertWeights, cfg: MoEConfig) -> RoutedOutput:
        def body(xt, idx, w, wg, wu, wd):
            r = RouteResult(indices=idx[None], weights=w[None], aux_loss=None, z_loss=None, load=None)
            out = local_routed_compute(xt[None], r, ExpertWeights(wg, wu, wd), cfg)
            return out.y[0], jax.lax.psum(out.dropped, BATCH_AXES)

        return _exchange(body, self.mesh, x, route, experts, P(None, None, None))


# --------------------------------------------------------------------------------------------------
# all_to_all: fixed per-(source, expert) capacity buffers
# --------------------------------------------------------------------------------------------------


def a2a_capacity(tokens_local: int, k: int, num_experts: int, capacity_factor: Optional[float]) -> int:
    """Slots per (source device, expert): capacity(T_l*k, E, cf) capped at the worst case T_l."""
    if capacity_factor is None:
        return tokens_local
    return min(tokens_local, capacity(tokens_local * k, num_experts, capacity_factor))


@dataclasses.dataclass(frozen=True)
class AllToAllCompute:
    """EP with `jax.lax.all_to_all` over `expert` of [ep, E_l * C, d] buffers (see module doc).

    chunks: split each device's tokens into this many chunks, each with its own dispatch, expert
    compute and combine (capacity per chunk), so the scheduler can run the all-to-all of chunk i+1
    under the experts of chunk i (MaxText's num_moe_token_chunks). 1 = one exchange per layer.
    dispatch_dtype: send the dispatch payload in this dtype (e.g. "float8_e4m3fn", DeepSeek-V3's fp8
    dispatch; rounded there, restored to the compute dtype on arrival); None = the compute dtype."""

    mesh: Mesh
    chunks: int = 1
    dispatch_dtype: Optional[str] = None

    def __call__(self, x, route: RouteResult, experts: ExpertWeights, cfg: MoEConfig) -> RoutedOutput:
        ep = self.mesh.shape[EXPERT_AXIS]
        num_e = experts.w_gate.shape[0]
        if num_e % ep:
            raise ConfigError(f"moe.num_experts={num_e} is not divisible by mesh.expert={ep}")
        n_chunks = self.chunks

        def body(xt, idx, w, wg, wu, wd):
            t = xt.shape[0]
            if t % n_chunks:
                raise ConfigError(f"{t} tokens per device do not split into chunks={n_chunks}; pick a divisor")
            tc = t // n_chunks
            outs = [one(xt[i * tc:(i + 1) * tc], idx[i * tc:(i + 1) * tc], w[i * tc:(i + 1) * tc], wg, wu, wd)
                    for i in range(n_chunks)]
            y = outs[0][0] if n_chunks == 1 else jnp.concatenate([o[0] for o in outs], axis=0)
            dropped = jax.lax.psum(sum(o[1] for o in outs), BATCH_AXES)
            return y, dropped

        def one(xt, idx, w, wg, wu, wd):
            t, d = xt.shape
            k = idx.shape[-1]
            e_l = wg.shape[0]
            cap = a2a_capacity(t, k, num_e, cfg.capacity_factor)
            flat_e = idx.reshape(-1)  # [N = t*k] assignment -> global expert
            with jax.named_scope("dispatch"):
                _, group_sizes, rank = sort_by_expert(flat_e, num_e)
                kept = rank < cap
                slot = jnp.where(kept, flat_e * cap + rank, num_e * cap)  # [N] row in the [E*C] buffer
                token = jnp.arange(flat_e.shape[0], dtype=jnp.int32) // k
                # slot -> source token (t = empty slot); a gather keeps the backward a scatter-add
                src = jnp.full((num_e * cap,), t, jnp.int32).at[slot].set(token, mode="drop", unique_indices=True)
                send = jnp.take(xt, src, axis=0, mode="fill", fill_value=0).reshape(ep, e_l * cap, d)
                if self.dispatch_dtype is not None:
                    send = send.astype(self.dispatch_dtype)
                recv = jax.lax.all_to_all(send, EXPERT_AXIS, 0, 0, tiled=True).astype(xt.dtype)  # [ep, E_l*C, d]
                # filled slots per (source, local expert): lets the expert compute skip empty slots
                sent = jnp.minimum(group_sizes, cap).reshape(ep, e_l)
                counts = jax.lax.all_to_all(sent, EXPERT_AXIS, 0, 0, tiled=True)  # [ep sources, E_l]
            with jax.named_scope("expert_compute"):
                # pack the filled slots expert-major: slot (s, e, c) -> row start[e] + before[s, e] + c
                sizes = counts.sum(0)  # [E_l]
                start = jnp.cumsum(sizes) - sizes
                before = jnp.cumsum(counts, axis=0) - counts  # [ep, E_l]
                c_idx = jnp.arange(cap, dtype=jnp.int32)
                row = start[None, :, None] + before[:, :, None] + c_idx
                rows = ep * e_l * cap
                row = jnp.where(c_idx < counts[:, :, None], row, rows).reshape(-1)  # [ep*E_l*C]; empty -> out
                slot_of_row = jnp.full((rows,), rows, jnp.int32).at[row].set(
                    jnp.arange(rows, dtype=jnp.int32), mode="drop", unique_indices=True)
                xs = jnp.take(recv.reshape(rows, d), slot_of_row, axis=0, mode="fill", fill_value=0)
                ys = expert_swiglu(xs, sizes, ExpertWeights(wg, wu, wd), cfg)  # rows past sum(sizes): 0
                ys = jnp.take(ys, row, axis=0, mode="fill", fill_value=0).reshape(ep, e_l * cap, d)
            with jax.named_scope("combine"):
                back = jax.lax.all_to_all(ys, EXPERT_AXIS, 0, 0, tiled=True).reshape(num_e * cap, d)
                y = jnp.take(back, slot, axis=0, mode="fill", fill_value=0)  # [N, d]; dropped -> 0
                y = (y * w.reshape(-1, 1).astype(y.dtype)).reshape(t, k, d).sum(1)
            return y, jnp.sum(~kept).astype(jnp.int32)

        return _exchange(body, self.mesh, x, route, experts, _W_SPEC)


# --------------------------------------------------------------------------------------------------
# ragged: exact-size exchange with ragged_all_to_all (GPU/TPU)
# --------------------------------------------------------------------------------------------------

RAGGED_ON_CPU = (
    "moe.dispatch=ragged uses jax.lax.ragged_all_to_all, which XLA:CPU cannot compile; on CPU use "
    "moe.dispatch=all_to_all (fixed-capacity buffers, same results when nothing drops)"
)


def _exclusive_cumsum(x, axis=-1):
    return jnp.cumsum(x, axis=axis) - x


@dataclasses.dataclass
class RaggedPlan:
    """Sizes/offsets of both exchanges, from the all-gathered traffic matrix [ep, E] (rows source i
    sends expert e). Per peer j:
      send_sizes[j]     rows I send j in the dispatch  = sum(traffic[me, experts of j])
      input_offsets[j]  where they start in my expert-sorted rows (exclusive cumsum)
      output_offsets[j] where they land in j's receive buffer = sum(traffic[< me, experts of j])
      recv_sizes[j]     rows j sends me = sum(traffic[j, my experts])
      recv_offsets[j]   where they start in my receive buffer (exclusive cumsum)
      peer_input_offsets[j]  where j's rows for me started in j's sorted rows (the combine's target)
      recv_counts [ep, E_l]  rows per (source, local expert): the receive buffer's segments."""

    send_sizes: jax.Array
    input_offsets: jax.Array
    output_offsets: jax.Array
    recv_sizes: jax.Array
    recv_offsets: jax.Array
    peer_input_offsets: jax.Array
    recv_counts: jax.Array


def ragged_plan(group_sizes, ep: int, e_l: int, me) -> RaggedPlan:
    traffic = jax.lax.all_gather(group_sizes, EXPERT_AXIS)  # [ep, E]
    per_rank = traffic.reshape(ep, ep, e_l)  # [source, dest rank, local expert]
    to_rank = per_rank.sum(-1)  # [source, dest]
    return RaggedPlan(
        send_sizes=to_rank[me],
        input_offsets=_exclusive_cumsum(to_rank[me]),
        output_offsets=_exclusive_cumsum(to_rank, axis=0)[me],
        recv_sizes=to_rank[:, me],
        recv_offsets=_exclusive_cumsum(to_rank[:, me]),
        peer_input_offsets=_exclusive_cumsum(to_rank, axis=1)[:, me],
        recv_counts=per_rank[:, me, :],
    )


@dataclasses.dataclass(frozen=True)
class RaggedCompute:
    """Dropless EP with `jax.lax.ragged_all_to_all`: only the real rows move (see module doc).

    The receive buffer holds the worst case ep * T_l * min(k, E_l) rows. `exchange` replaces
    ragged_all_to_all (same signature); tests pass an all_gather-based emulation to check the
    offset arithmetic on CPU."""

    mesh: Mesh
    exchange: Optional[Callable] = None

    def __post_init__(self):
        if self.exchange is None and mesh_platform(self.mesh) == "cpu":
            raise BackendError(RAGGED_ON_CPU)

    def __call__(self, x, route: RouteResult, experts: ExpertWeights, cfg: MoEConfig) -> RoutedOutput:
        if cfg.capacity_factor is not None:
            raise ConfigError("moe.dispatch=ragged is dropless; set moe.capacity_factor=null or use all_to_all")
        ep = self.mesh.shape[EXPERT_AXIS]
        num_e = experts.w_gate.shape[0]
        a2a = self.exchange or jax.lax.ragged_all_to_all

        def body(xt, idx, w, wg, wu, wd):
            t, d = xt.shape
            k = idx.shape[-1]
            e_l = wg.shape[0]
            rows = ep * t * min(k, e_l)  # receive buffer: worst case
            flat_e = idx.reshape(-1)
            with jax.named_scope("dispatch"):
                order, group_sizes, _ = sort_by_expert(flat_e, num_e)
                xs = xt[order // k]  # [N, d] rows sorted by global expert = by destination rank
                plan = ragged_plan(group_sizes, ep, e_l, jax.lax.axis_index(EXPERT_AXIS))
                recv = a2a(xs, jnp.zeros((rows, d), xs.dtype), plan.input_offsets, plan.send_sizes,
                           plan.output_offsets, plan.recv_sizes, axis_name=EXPERT_AXIS)
                # the receive buffer is (source, local expert)-major; regroup its rows by local expert
                seg = jnp.searchsorted(jnp.cumsum(plan.recv_counts.reshape(-1)), jnp.arange(rows), side="right")
                local_e = jnp.where(seg < ep * e_l, seg % e_l, e_l)
                regroup = jnp.argsort(local_e, stable=True)
                xs_l = recv[regroup]
            with jax.named_scope("expert_compute"):
                ys_l = expert_swiglu(xs_l, plan.recv_counts.sum(0), ExpertWeights(wg, wu, wd), cfg)
            with jax.named_scope("combine"):
                ys = ys_l[jnp.argsort(regroup)]  # back to receive order
                back = a2a(ys, jnp.zeros((t * k, d), ys.dtype), plan.recv_offsets, plan.recv_sizes,
                           plan.peer_input_offsets, plan.send_sizes, axis_name=EXPERT_AXIS)
                y = back[jnp.argsort(order)]  # expert-sorted -> assignment order
                y = (y * w.reshape(-1, 1).astype(y.dtype)).reshape(t, k, d).sum(1)
            return y, jnp.zeros((), jnp.int32)

        return _exchange(body, self.mesh, x, route, experts, _W_SPEC)


# --------------------------------------------------------------------------------------------------
# selection
# --------------------------------------------------------------------------------------------------


def routed_compute_for(dispatch: str, mesh: Optional[Mesh]):
    """The RoutedComputeFn for `moe.dispatch` on `mesh` (None or 1 device: the plain local path)."""
    if dispatch == "local":
        return local_routed_compute if mesh is None or mesh.size == 1 else LocalCompute(mesh)
    if mesh is None:
        raise ConfigError(f"moe.dispatch={dispatch} needs a device mesh (parallel.make_mesh)")
    if dispatch == "all_to_all":
        return AllToAllCompute(mesh)
    if dispatch == "ragged":
        return RaggedCompute(mesh)
    raise ConfigError(f"moe.dispatch={dispatch!r} is unknown; choose local, all_to_all or ragged")

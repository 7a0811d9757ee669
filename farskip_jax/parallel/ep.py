"""Expert-parallel token exchange: `RoutedComputeFn` backends written in `jax.shard_map`.

Every backend has the signature of `local_routed_compute` (model/experts.py):

    backend(x [b, s, d], route: RouteResult, experts: ExpertWeights, cfg: RuntimeConfig) -> RoutedOutput

The b*s tokens are split over data x fsdp x expert (every token-parallel shard takes part); the E
experts over `expert` (ep = mesh.shape["expert"], E_l = E / ep per device; global expert e lives
on expert-rank e // E_l). Per device, in three named steps; dispatch and combine are separate
collectives, so XLA can schedule the combine of layer k-1 under the attention of layer k (FarSkip,
docs/design.md sections 1-2):

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
- `HierarchicalCompute` (`runtime.dispatch=hierarchical`): the all_to_all backend's buffers and drops,
  node-deduplicated as DeepEP does: the expert axis is viewed as nodes x GPUs per node, a token
  crosses to each destination node once (an all-to-all among the same-local-rank GPUs of the
  nodes, `axis_index_groups`), and an intra-node all-to-all forwards it to its experts' GPUs; the
  combine sums a node's weighted outputs before the one cross-node return.
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
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from farskip_jax.config import RuntimeConfig
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

    def __call__(self, x, route: RouteResult, experts: ExpertWeights, cfg: RuntimeConfig) -> RoutedOutput:
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


def packed_expert_compute(recv, counts, experts: ExpertWeights, cfg: RuntimeConfig, cap: int):
    """Expert outputs of the fixed-capacity receive buffer, in its layout.

    recv: [n_src, E_l * cap, d], slot (s, e, c) = row c of local expert e from source s (filled
    slots first); counts: [n_src, E_l] filled slots. The filled slots are packed expert-major
    (slot (s, e, c) -> row start[e] + before[s, e] + c) so the grouped matmul skips empty slots;
    returns ys [n_src, E_l * cap, d] (empty slots 0)."""
    n_src, _, d = recv.shape
    e_l = counts.shape[1]
    sizes = counts.sum(0)  # [E_l]
    start = jnp.cumsum(sizes) - sizes
    before = jnp.cumsum(counts, axis=0) - counts  # [n_src, E_l]
    c_idx = jnp.arange(cap, dtype=jnp.int32)
    row = start[None, :, None] + before[:, :, None] + c_idx
    rows = n_src * e_l * cap
    row = jnp.where(c_idx < counts[:, :, None], row, rows).reshape(-1)  # [n_src*E_l*C]; empty -> out
    slot_of_row = jnp.full((rows,), rows, jnp.int32).at[row].set(
        jnp.arange(rows, dtype=jnp.int32), mode="drop", unique_indices=True)
    xs = jnp.take(recv.reshape(rows, d), slot_of_row, axis=0, mode="fill", fill_value=0)
    ys = expert_swiglu(xs, sizes, experts, cfg)  # rows past sum(sizes): 0
    return jnp.take(ys, row, axis=0, mode="fill", fill_value=0).reshape(n_src, e_l * cap, d)


def run_chunks(one: Callable, n_chunks: int, xt, idx, w, wg, wu, wd):
    """`one(x, idx, w, wg, wu, wd) -> (y, dropped)` on `n_chunks` equal token chunks of a device;
    (y concatenated, dropped summed over chunks and token shards)."""
    t = xt.shape[0]
    if t % n_chunks:
        raise ConfigError(f"{t} tokens per device do not split into chunks={n_chunks}; pick a divisor")
    tc = t // n_chunks
    outs = [one(xt[i * tc:(i + 1) * tc], idx[i * tc:(i + 1) * tc], w[i * tc:(i + 1) * tc], wg, wu, wd)
            for i in range(n_chunks)]
    y = outs[0][0] if n_chunks == 1 else jnp.concatenate([o[0] for o in outs], axis=0)
    return y, jax.lax.psum(sum(o[1] for o in outs), BATCH_AXES)


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

    def __call__(self, x, route: RouteResult, experts: ExpertWeights, cfg: RuntimeConfig) -> RoutedOutput:
        ep = self.mesh.shape[EXPERT_AXIS]
        num_e = experts.w_gate.shape[0]
        if num_e % ep:
            raise ConfigError(f"moe.num_experts={num_e} is not divisible by mesh.expert={ep}")
        n_chunks = self.chunks

        def body(xt, idx, w, wg, wu, wd):
            return run_chunks(one, n_chunks, xt, idx, w, wg, wu, wd)

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
                ys = packed_expert_compute(recv, counts, ExpertWeights(wg, wu, wd), cfg, cap)
            with jax.named_scope("combine"):
                back = jax.lax.all_to_all(ys, EXPERT_AXIS, 0, 0, tiled=True).reshape(num_e * cap, d)
                y = jnp.take(back, slot, axis=0, mode="fill", fill_value=0)  # [N, d]; dropped -> 0
                y = (y * w.reshape(-1, 1).astype(y.dtype)).reshape(t, k, d).sum(1)
            return y, jnp.sum(~kept).astype(jnp.int32)

        return _exchange(body, self.mesh, x, route, experts, _W_SPEC)


# --------------------------------------------------------------------------------------------------
# hierarchical: node-deduplicated dispatch (DeepEP-style), expert axis = nodes x GPUs per node
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NodeLayout:
    """The expert axis viewed as `nodes` x `per_node` (expert rank r = node * per_node + local rank).

    cross: axis_index_groups of the same local rank on every node (one GPU per node);
    intra: axis_index_groups of the GPUs of one node."""

    nodes: int
    per_node: int

    @property
    def cross(self) -> list[list[int]]:
        return [[n * self.per_node + g for n in range(self.nodes)] for g in range(self.per_node)]

    @property
    def intra(self) -> list[list[int]]:
        return [[n * self.per_node + g for g in range(self.per_node)] for n in range(self.nodes)]


def expert_node_layout(mesh: Mesh, gpus_per_node: Optional[int] = None) -> NodeLayout:
    """How the `expert` axis of `mesh` spans nodes. A device's node is `device.id // gpus_per_node`
    when gpus_per_node is given (runtime.gpus_per_node), else its `process_index` (one process per host).
    Every expert group (the expert axis at fixed data/fsdp/tensor indices) must be `nodes` blocks of
    `per_node` consecutive ranks, one block per node, the same for every group."""
    if gpus_per_node is not None and gpus_per_node < 1:
        raise ConfigError(f"runtime.gpus_per_node={gpus_per_node} must be >= 1")
    axis = mesh.axis_names.index(EXPERT_AXIS)
    devs = np.moveaxis(np.arange(mesh.devices.size).reshape(mesh.devices.shape), axis, -1)
    flat = list(mesh.devices.flat)
    node = (lambda d: d.id // gpus_per_node) if gpus_per_node else (lambda d: d.process_index)
    ep = mesh.shape[EXPERT_AXIS]
    layouts = set()
    for row in devs.reshape(-1, ep).tolist():
        nodes = [node(flat[i]) for i in row]
        blocks = [nodes[0]]
        for a, b in zip(nodes, nodes[1:]):
            if b != a:
                blocks.append(b)
        per = ep // len(blocks)
        if len(set(blocks)) != len(blocks) or ep % len(blocks) or nodes != [b for b in blocks for _ in range(per)]:
            raise ConfigError(
                f"runtime.dispatch=hierarchical needs every expert group to be equal blocks of consecutive "
                f"ranks on distinct nodes; the expert axis ({ep}) lies on nodes {nodes} "
                f"(runtime.gpus_per_node={gpus_per_node}); make mesh.expert a multiple of the GPUs per node "
                f"(or a divisor of them) with `expert` the innermost axis above `tensor`")
        layouts.add((len(blocks), per))
    if len(layouts) != 1:
        raise ConfigError(f"runtime.dispatch=hierarchical: the expert groups of the mesh span nodes differently {layouts}")
    return NodeLayout(*layouts.pop())


@dataclasses.dataclass(frozen=True)
class HierarchicalCompute:
    """Node-deduplicated EP (DeepEP's normal kernels, in two `jax.lax.all_to_all`s per direction).

    The expert axis is `nodes` x `per_node` (expert_node_layout); node m holds the E_n = E / nodes
    experts of its per_node GPUs. Per device (source s = (node n, local rank g)), T_l tokens:

      dispatch  1. cross-node: each token goes ONCE to every node holding any of its (kept) experts,
                   to the GPU of the same local rank g there: an all-to-all over the `nodes` GPUs of
                   rank g (one per node) of [nodes, C1, d] + its routing for that node ([nodes, C1, k]
                   local expert ids, E_n = none, and router weights, 0 = none). C1 = min(T_l, E_n C).
                2. intra-node: the forwarding GPU sorts the nodes*C1*k received assignments by expert
                   and sends each row to the GPU of its expert: an all-to-all over the node's
                   per_node GPUs of [per_node, E_l * C2, d], C2 = nodes * C slots per (forwarder,
                   expert) (each source sent an expert at most C rows).
      experts   the grouped SwiGLU of the all_to_all backend on the rows that arrived
      combine   2'. intra-node all-to-all back; the forwarder weights each output by its router
                   weight and sums a token's outputs of that node: one row per (token, node);
                3'. cross-node all-to-all back; the source sums its token's rows over the nodes.

    Capacity (cfg.capacity_factor) is that of the all_to_all backend, per (source device, expert):
    C = a2a_capacity(T_l, k, E, cf), the first C assignments of the source's tokens (token order)
    to an expert are kept, the rest dropped (output 0, counted) before anything is sent; C1 and C2
    are sized so that nothing else drops. The result is the all_to_all backend's (dropless when
    cf is None). Bytes through the NICs per device: nodes * C1 rows instead of E * C (top-8 over 4
    nodes with cf 1: 4 T_l rows, 3/4 of them remote, instead of 8 T_l rows, 3/4 remote).

    One node (EP inside a node) is the all_to_all backend itself (the same program).
    chunks / dispatch_dtype: as AllToAllCompute (the payload stays in dispatch_dtype through both
    hops; the routing weights travel in their own dtype)."""

    mesh: Mesh
    gpus_per_node: Optional[int] = None
    chunks: int = 1
    dispatch_dtype: Optional[str] = None

    def layout(self) -> NodeLayout:
        return expert_node_layout(self.mesh, self.gpus_per_node)

    def __call__(self, x, route: RouteResult, experts: ExpertWeights, cfg: RuntimeConfig) -> RoutedOutput:
        ep = self.mesh.shape[EXPERT_AXIS]
        num_e = experts.w_gate.shape[0]
        if num_e % ep:
            raise ConfigError(f"moe.num_experts={num_e} is not divisible by mesh.expert={ep}")
        lay = self.layout()
        if lay.nodes == 1:  # EP inside one node: nothing to deduplicate
            return AllToAllCompute(self.mesh, self.chunks, self.dispatch_dtype)(x, route, experts, cfg)
        n_nodes, per = lay.nodes, lay.per_node
        e_n = num_e // n_nodes  # experts per node
        cross, intra = lay.cross, lay.intra

        def a2a(v, groups):
            if len(groups[0]) == 1:
                return v
            return jax.lax.all_to_all(v, EXPERT_AXIS, 0, 0, tiled=True, axis_index_groups=groups)

        def body(xt, idx, w, wg, wu, wd):
            return run_chunks(one, self.chunks, xt, idx, w, wg, wu, wd)

        def one(xt, idx, w, wg, wu, wd):
            t, d = xt.shape
            k = idx.shape[-1]
            e_l = wg.shape[0]
            cap = a2a_capacity(t, k, num_e, cfg.capacity_factor)
            c1 = min(t, e_n * cap)  # rows per (source, destination node)
            c2 = n_nodes * cap  # rows per (forwarder, expert)
            flat_e = idx.reshape(-1)  # [N = t*k]
            with jax.named_scope("dispatch"):
                _, _, rank = sort_by_expert(flat_e, num_e)
                kept = (rank < cap).reshape(t, k)  # the all_to_all backend's drops
                dest = idx // e_n  # [t, k] destination node
                to_node = kept[:, None, :] & (dest[:, None, :] == jnp.arange(n_nodes)[None, :, None])  # [t, nodes, k]
                present = to_node.any(-1)  # [t, nodes]
                pos = jnp.cumsum(present, axis=0, dtype=jnp.int32) - 1
                slot1 = jnp.where(present, jnp.arange(n_nodes)[None, :] * c1 + pos, n_nodes * c1)  # [t, nodes]
                tok = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[:, None], (t, n_nodes))
                src1 = jnp.full((n_nodes * c1,), t, jnp.int32).at[slot1.reshape(-1)].set(
                    tok.reshape(-1), mode="drop", unique_indices=True)  # slot -> token (t = empty)
                send = jnp.take(xt, src1, axis=0, mode="fill", fill_value=0).reshape(n_nodes, c1, d)
                if self.dispatch_dtype is not None:
                    send = send.astype(self.dispatch_dtype)
                # routing of each slot: the token's local expert ids on that node (e_n = none), weights
                lid = jnp.where(to_node, (idx % e_n)[:, None, :], e_n)  # [t, nodes, k]
                lw = jnp.where(to_node, w[:, None, :], 0).astype(w.dtype)
                slot_node = jnp.arange(n_nodes * c1, dtype=jnp.int32) // c1
                flat_tn = jnp.where(src1 < t, src1 * n_nodes + slot_node, t * n_nodes)  # row of [t*nodes]
                ids = jnp.take(lid.reshape(t * n_nodes, k), flat_tn, axis=0, mode="fill", fill_value=e_n)
                wts = jnp.take(lw.reshape(t * n_nodes, k), flat_tn, axis=0, mode="fill", fill_value=0)
                with jax.named_scope("cross_node"):
                    # [nodes (sources), C1, d] on the same-rank GPU of each node (in the compute dtype
                    # there, so the backward sums a row's k cotangents in it; the forward is unchanged)
                    recv1 = a2a(send, cross).astype(xt.dtype)
                    ids1 = a2a(ids.reshape(n_nodes, c1, k), cross).reshape(-1)  # [M*k], M = nodes*C1
                    wts1 = a2a(wts.reshape(n_nodes, c1, k), cross).reshape(-1, k)  # [M, k]
                m_rows = n_nodes * c1
                with jax.named_scope("intra_node"):
                    _, gsz, rank2 = sort_by_expert(ids1, e_n + 1)  # e_n = no expert (last group)
                    valid = ids1 < e_n  # rank2 < c2 holds for every valid assignment (see class doc)
                    slot2 = jnp.where(valid, ids1 * c2 + rank2, e_n * c2)
                    row1 = jnp.arange(ids1.shape[0], dtype=jnp.int32) // k
                    src2 = jnp.full((e_n * c2,), m_rows, jnp.int32).at[slot2].set(row1, mode="drop", unique_indices=True)
                    send2 = jnp.take(recv1.reshape(m_rows, d), src2, axis=0, mode="fill",
                                     fill_value=0).reshape(per, e_l * c2, d)
                    if self.dispatch_dtype is not None:
                        send2 = send2.astype(self.dispatch_dtype)
                    recv2 = a2a(send2, intra).astype(xt.dtype)  # [per (forwarders), E_l*C2, d]
                    counts = a2a(jnp.minimum(gsz[:e_n], c2).reshape(per, e_l), intra)  # [per, E_l]
            with jax.named_scope("expert_compute"):
                ys = packed_expert_compute(recv2, counts, ExpertWeights(wg, wu, wd), cfg, c2)
            with jax.named_scope("combine"):
                with jax.named_scope("intra_node"):
                    back2 = a2a(ys, intra).reshape(e_n * c2, d)
                    y2 = jnp.take(back2, slot2, axis=0, mode="fill", fill_value=0)  # [M*k, d]
                    y1 = (y2.reshape(m_rows, k, d) * wts1[:, :, None].astype(y2.dtype)).sum(1)  # [M, d]
                with jax.named_scope("cross_node"):
                    back1 = a2a(y1.reshape(n_nodes, c1, d), cross).reshape(n_nodes * c1, d)
                y = jnp.take(back1, slot1.reshape(-1), axis=0, mode="fill", fill_value=0)
                y = y.reshape(t, n_nodes, d).sum(1)
            return y, jnp.sum(~kept).astype(jnp.int32)

        return _exchange(body, self.mesh, x, route, experts, _W_SPEC)


# --------------------------------------------------------------------------------------------------
# ragged: exact-size exchange with ragged_all_to_all (GPU/TPU)
# --------------------------------------------------------------------------------------------------

RAGGED_ON_CPU = (
    "runtime.dispatch=ragged uses jax.lax.ragged_all_to_all, which XLA:CPU cannot compile; on CPU use "
    "runtime.dispatch=all_to_all (fixed-capacity buffers, same results when nothing drops)"
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

    def __call__(self, x, route: RouteResult, experts: ExpertWeights, cfg: RuntimeConfig) -> RoutedOutput:
        if cfg.capacity_factor is not None:
            raise ConfigError("runtime.dispatch=ragged is dropless; set runtime.capacity_factor=null or use all_to_all")
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


def routed_compute_for(dispatch: str, mesh: Optional[Mesh], gpus_per_node: Optional[int] = None):
    """The RoutedComputeFn for `runtime.dispatch` on `mesh` (None or 1 device: the plain local path).
    gpus_per_node: runtime.gpus_per_node, how `hierarchical` finds the nodes (None: process_index)."""
    if dispatch == "local":
        return local_routed_compute if mesh is None or mesh.size == 1 else LocalCompute(mesh)
    if mesh is None:
        raise ConfigError(f"runtime.dispatch={dispatch} needs a device mesh (parallel.make_mesh)")
    if dispatch == "all_to_all":
        return AllToAllCompute(mesh)
    if dispatch == "ragged":
        return RaggedCompute(mesh)
    if dispatch == "hierarchical":
        rc = HierarchicalCompute(mesh, gpus_per_node)
        rc.layout()  # fail early on a mesh whose expert axis does not split into nodes
        return rc
    raise ConfigError(f"runtime.dispatch={dispatch!r} is unknown; choose local, all_to_all, hierarchical or ragged")

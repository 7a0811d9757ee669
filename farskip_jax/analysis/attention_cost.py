"""Attention priced as it runs on a GPU: one fused (flash) kernel per layer and pass, from the
compiled attention core's FLOPs and bytes, whatever XLA's fusion made of it.

    kernels = attention_kernels(schedule)           # [AttentionKernel]
    (cost_model.flash_attention_times prices each kernel and spreads its time over its ops)

Why: a compiled naive attention core is a chain of kernels that write and read the [b, h, t, s]
scores in HBM, and how many depends on XLA's fusion decisions, which differ between two programs
with the same attention (the same attention FLOPs in a different number of ops, which a per-op
roofline prices differently; docs/comparison.md). A GPU runs the core as one flash kernel per pass; pricing that kernel makes the
two programs' attention cost equal whenever their attention is.

Kernels. The compute ops of the `attention_core` scope (analysis/scopes.py) of one layer, linked by
data edges (through bitcasts and the elements of multi-output fusions), form components; each
direction of a component is one kernel: `fwd` the forward pass, `bwd` the backward with its
forward recomputation under remat (its op_names run through `transpose(...)`). Per kernel:

    flops  the dot FLOPs of its ops, as compiled (the naive core computes the full [t, s] scores)
    bytes  operands of its dots produced outside the component (q, k, v; dO) + outputs of its ops
           downstream of one of its dots that are read outside the component (O; dQ, dK, dV).
           Not counted: what the two directions of one component exchange (the probabilities a
           naive core saves for its backward) and what its elementwise ops read besides (a
           materialised mask or -inf broadcast): a flash kernel keeps the former on chip and
           regenerates the latter
    time   cost_model.fused_attention_us: launch + max(flops * causal fraction [x backward
           recompute] / (peak * attn_eff), bytes / (hbm_bw * mem_eff))

spread over the kernel's ops in proportion to their compiled (roofline) times: the ops keep their
places in the schedule XLA chose and their shares of the core's time, so the compute that LHS put
inside a collective's window stays there, scaled to the kernel's price (a flash kernel itself is
one launch; where the compiled core straddles a collective's start or done, so does its price). A
component without dots (a mask or -inf broadcast XLA hoisted out of the layer loop) costs
nothing: the flash kernel generates it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from farskip_jax.analysis.hlo import Schedule
from farskip_jax.analysis.scopes import direction_of, layer_of, scope_of

CORE = "attention_core"
_THROUGH = ("bitcast", "get-tuple-element")  # views of one tensor: a producer's output seen through them


@dataclass(frozen=True)
class AttentionKernel:
    layer: Optional[int]
    direction: str  # fwd | bwd
    ops: tuple[int, ...]  # op ids, schedule order
    flops: float
    bytes: float


def _tensor(schedule: Schedule, x: int) -> int:
    """The op whose output operand `x` is, through bitcasts (the same bytes under another shape)."""
    while x in schedule.by_id and schedule.by_id[x].opcode == "bitcast" and schedule.by_id[x].operands:
        x = schedule.by_id[x].operands[0]
    return x


def _producer(schedule: Schedule, x: int) -> int:
    """The op whose output operand `x` is: through bitcasts and tuple elements of a compute op (a
    multi-output fusion); a tuple element of a loop carry or parameter stays itself."""
    while x in schedule.by_id:
        o = schedule.by_id[x]
        if o.opcode not in _THROUGH or not o.operands:
            return x
        src = schedule.by_id.get(o.operands[0])
        if o.opcode == "get-tuple-element" and (src is None or src.kind != "compute"):
            return x
        x = o.operands[0]
    return x


def _readers(schedule: Schedule) -> dict[int, list[tuple[int, int]]]:
    """{producer id: [(reader id, id of the tensor it reads: the producer or a view of it)]}: every
    non-view op reading a producer's output, directly or through views."""
    out: dict[int, list[tuple[int, int]]] = {}
    for o in schedule.ops:
        if o.opcode in _THROUGH:
            continue
        for x in o.operands:
            out.setdefault(_producer(schedule, x), []).append((o.id, x))
    return out


def attention_kernels(schedule: Schedule) -> list[AttentionKernel]:
    """The attention_core compute ops of `schedule` grouped into kernels (module doc)."""
    core = [o for o in schedule.ops if o.kind == "compute" and scope_of(o.op_name) == CORE]
    if not core:
        return []
    ids = {o.id for o in core}
    parent = {i: i for i in ids}

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for o in core:
        for x in o.operands:
            p = _producer(schedule, x)
            if p in ids and layer_of(schedule.by_id[p].op_name) == layer_of(o.op_name):
                parent[find(p)] = find(o.id)
    readers = _readers(schedule)
    comp = {i: find(i) for i in ids}
    groups: dict[tuple, list] = {}
    for o in core:
        groups.setdefault((comp[o.id], direction_of(o.op_name)), []).append(o)
    kernels = []
    for (root, direction), ops in groups.items():
        # ops downstream of one of the kernel's dots (inside the kernel): whose outputs are results
        after = {o.id for o in ops if o.flops > 0}
        for o in ops:  # schedule order: producers first
            if o.id not in after and any(_producer(schedule, x) in after for x in o.operands):
                after.add(o.id)
        inputs: dict[int, float] = {}
        for o in ops:
            if o.flops <= 0:
                continue
            for x in o.operands:
                if comp.get(_producer(schedule, x)) != root and x in schedule.by_id:
                    inputs[_tensor(schedule, x)] = schedule.by_id[x].out_bytes
        outputs: dict[int, float] = {}
        for o in ops:
            if o.id not in after:
                continue
            for reader, tensor in readers.get(o.id, []):
                if comp.get(reader) != root and tensor in schedule.by_id:
                    outputs[_tensor(schedule, tensor)] = schedule.by_id[tensor].out_bytes
        kernels.append(AttentionKernel(layer=layer_of(ops[0].op_name), direction=direction,
                                       ops=tuple(o.id for o in ops), flops=float(sum(o.flops for o in ops)),
                                       bytes=float(sum(inputs.values()) + sum(outputs.values()))))
    return kernels

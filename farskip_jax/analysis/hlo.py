"""The scheduled HLO of a compiled program as a small graph with XLA's cost-model timestamps.

XLA's latency-hiding scheduler (LHS), with `--xla_dump_latency_hiding_schedule=true`, writes
`<module>.schedule.txt`: the HloModuleProto it scheduled plus, per computation, the instruction order
with modelled start/end times (microseconds for the GPU estimators; the proto calls them cycles).
`load_schedule(text)` turns the entry computation into

    Schedule.ops: [HloOp] in schedule order, each with
        id, name, opcode, op_name (metadata, inherited from the fused body when empty),
        operands (ids), kind: compute | start | done | free, collective ("all-to-all", ...),
        out_bytes, in_bytes, flops (dots/convolutions inside), start, end (us)

which is all the overlap report, the structural bound and the cost model need.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from farskip_jax.analysis.textproto import first, parse_textproto

ELEMENT_BYTES = {
    "PRED": 1, "S4": 0.5, "U4": 0.5, "S8": 1, "U8": 1, "F8E4M3FN": 1, "F8E5M2": 1, "F8E4M3FNUZ": 1,
    "F8E5M2FNUZ": 1, "S16": 2, "U16": 2, "F16": 2, "BF16": 2, "S32": 4, "U32": 4, "F32": 4,
    "S64": 8, "U64": 8, "F64": 8, "C64": 8, "C128": 16, "TOKEN": 0, "TUPLE": 0, "OPAQUE_TYPE": 0,
}
COLLECTIVES = ("ragged-all-to-all", "all-to-all", "all-reduce", "all-gather", "reduce-scatter",
               "collective-permute", "collective-broadcast", "send", "recv")
FREE_OPCODES = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
                "partition-id", "replica-id", "add-dependency", "opt-barrier", "domain"}


def shape_bytes(shape: Optional[dict]) -> int:
    """Bytes of an HLO shape message (sum over tuple leaves)."""
    if not shape:
        return 0
    tuples = shape.get("tuple_shapes")
    if tuples:
        return sum(shape_bytes(t) for t in tuples)
    n = math.prod(int(d) for d in shape.get("dimensions", []))
    return int(n * ELEMENT_BYTES.get(first(shape, "element_type", "F32"), 4))


def shape_dims(shape: Optional[dict]) -> list[int]:
    return [int(d) for d in (shape or {}).get("dimensions", [])]


@dataclass
class HloOp:
    id: int
    name: str
    opcode: str
    op_name: str
    operands: tuple[int, ...]
    kind: str  # compute | start | done | free
    collective: Optional[str] = None
    out_bytes: int = 0
    in_bytes: int = 0
    flops: float = 0.0
    start: float = 0.0
    end: float = 0.0
    index: int = 0  # position in the schedule
    called: tuple[int, ...] = ()  # called computation ids
    stretch: float = 0.0  # us of [start, end] lost to contention (cost_model.simulate: a collective in flight)

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def work(self) -> float:
        """us the op takes alone: its duration less what contention added."""
        return self.end - self.start - self.stretch


@dataclass
class CollectivePair:
    """One async collective: its start and done ops and the payload (bytes of the operands)."""

    start: HloOp
    done: HloOp
    collective: str
    bytes: int
    operand_shapes: tuple = ()  # ((element_type, dims), ...) per operand
    dims: tuple = ()  # the collective's split/concat dimensions attribute
    group_size: int = 0  # devices per replica group (0 = unknown)
    groups: Optional[tuple[tuple[int, ...], ...]] = None  # replica groups (logical device ids); None = unknown


@dataclass
class Schedule:
    ops: list[HloOp]
    by_id: dict[int, HloOp] = field(default_factory=dict)
    pairs: list[CollectivePair] = field(default_factory=list)
    module_name: str = ""
    peak_memory: int = 0  # bytes, the scheduler's own estimate (0 when the dump has none)

    @property
    def makespan(self) -> float:
        return max((o.end for o in self.ops), default=0.0)

    def compute_ops(self) -> list[HloOp]:
        return [o for o in self.ops if o.kind == "compute"]


def _dot_flops(ins: dict, shapes: dict[int, dict]) -> float:
    """2 * prod(output dims) * prod(contracting dims of lhs) for a dot instruction."""
    dn = first(ins, "dot_dimension_numbers", {}) or {}
    ops = ins.get("operand_ids", [])
    if not ops or ops[0] not in shapes:
        return 0.0
    lhs = shape_dims(shapes[ops[0]])
    k = math.prod(lhs[int(i)] for i in dn.get("lhs_contracting_dimensions", []))
    return 2.0 * math.prod(shape_dims(first(ins, "shape"))) * k


def _gemm_custom_call_flops(ins: dict, shapes: dict[int, dict]) -> float:
    """FLOPs of a cuBLAS/hipBLASLt gemm custom-call from its backend_config dimension numbers."""
    try:
        cfg = json.loads(first(ins, "backend_config", "") or "{}")
    except json.JSONDecodeError:
        return 0.0
    gemm = cfg.get("gemm_backend_config")
    ops = ins.get("operand_ids", [])
    if not gemm or not ops or ops[0] not in shapes:
        return 0.0
    dn = gemm.get("dot_dimension_numbers", {})
    lhs = shape_dims(shapes[ops[0]])
    k = math.prod(lhs[int(i)] for i in dn.get("lhs_contracting_dimensions", []))
    out = first(ins, "shape")
    if out and out.get("tuple_shapes"):
        out = out["tuple_shapes"][0]
    return 2.0 * math.prod(shape_dims(out)) * k


def _computation_flops(cid: int, comps: dict[int, dict], cache: dict[int, float]) -> float:
    if cid in cache:
        return cache[cid]
    cache[cid] = 0.0
    comp = comps.get(cid)
    if comp is None:
        return 0.0
    shapes = {first(i, "id"): first(i, "shape") for i in comp.get("instructions", [])}
    total = 0.0
    for ins in comp.get("instructions", []):
        op = first(ins, "opcode")
        if op in ("dot", "convolution"):
            total += _dot_flops(ins, shapes)
        elif op == "custom-call":
            total += _gemm_custom_call_flops(ins, shapes)
        for sub in ins.get("called_computation_ids", []):
            total += _computation_flops(sub, comps, cache)
    cache[cid] = total
    return total


def _inner_op_name(cid: int, comps: dict[int, dict]) -> str:
    """op_name of a fused body: the root's, else the first inner instruction that has one."""
    comp = comps.get(cid)
    if comp is None:
        return ""
    root = first(comp, "root_id")
    names = []
    for ins in comp.get("instructions", []):
        nm = first(first(ins, "metadata", {}) or {}, "op_name", "")
        if nm:
            if first(ins, "id") == root:
                return nm
            names.append(nm)
    return names[0] if names else ""


def _wrapped_collective(ins: dict, comps: dict[int, dict]) -> Optional[str]:
    """Collective kind of an async-start (from the wrapped computation) or a native *-start op."""
    op = first(ins, "opcode")
    if op == "async-start":
        for cid in ins.get("called_computation_ids", []):
            for sub in comps.get(cid, {}).get("instructions", []):
                if first(sub, "opcode") in COLLECTIVES:
                    return first(sub, "opcode")
        return None
    base = op[: -len("-start")] if op.endswith("-start") else None
    return base if base in COLLECTIVES else None


def replica_groups_of(ins: dict) -> Optional[tuple[tuple[int, ...], ...]]:
    """Replica groups of a collective instruction as logical device ids: explicit lists, iota lists
    (`iota_replica_group_list`) or mesh-axes lists (`mesh_axes_replica_group_list`, whole axes
    only); None when absent or in a form not read here."""
    groups = ins.get("replica_groups")
    if groups:
        return tuple(tuple(int(x) for x in g.get("replica_ids", [])) for g in groups)
    cdl = first(ins, "collective_device_list") or {}
    if cdl.get("replica_groups"):
        return tuple(tuple(int(x) for x in g.get("replica_ids", [])) for g in cdl["replica_groups"])
    # iota groups: inside collective_device_list, or (XLA's combined collectives) on the instruction
    iota = first(cdl, "iota_replica_group_list") or first(ins, "iota_collective_device_list") or {}
    if iota:
        g, n = int(first(iota, "num_replica_groups", 0)), int(first(iota, "num_devices_per_group", 0))
        dims = [int(d) for d in iota.get("iota_reshape_dims", [])] or [g * n]
        ids = np.arange(math.prod(dims)).reshape(dims)
        perm = [int(d) for d in iota.get("iota_transpose_perm", [])]
        if perm:
            ids = ids.transpose(perm)
        return tuple(tuple(int(x) for x in row) for row in ids.reshape(g, n))
    mal = first(ins, "mesh_axes_replica_group_list") or {}
    if mal:
        mesh = first(mal, "mesh") or {}
        sizes = [int(first(a, "size", 1)) for a in mesh.get("axes", [])]
        refs = mal.get("axes", [])
        if not sizes or any(first(r, "sub_axis_info") for r in refs):
            return None
        dev = [int(d) for d in mesh.get("device_ids", [])]
        ids = (np.asarray(dev) if dev else np.arange(math.prod(sizes))).reshape(sizes)
        along = [int(first(r, "mesh_axis_index", 0)) for r in refs]
        keep = [i for i in range(len(sizes)) if i not in along]
        t = ids.transpose(keep + along).reshape(-1, math.prod(sizes[i] for i in along))
        return tuple(tuple(int(x) for x in row) for row in t)
    return None


def _group_size(ins: dict) -> int:
    """Devices per replica group of a collective instruction (explicit or iota group lists)."""
    groups = ins.get("replica_groups")
    if groups:
        return len(groups[0].get("replica_ids", []))
    cdl = first(ins, "collective_device_list") or {}
    iota = first(cdl, "iota_replica_group_list") or first(ins, "iota_collective_device_list") or {}
    if iota:
        return int(first(iota, "num_devices_per_group", 0))
    groups = cdl.get("replica_groups")
    return len(groups[0].get("replica_ids", [])) if groups else 0


def load_schedule(text: str) -> Schedule:
    """Parse an LHS schedule dump (`*.schedule.txt`) into a Schedule of the entry computation."""
    tree = parse_textproto(text)
    module = first(tree, "hlo_module")
    if module is None:
        raise ValueError("not a latency-hiding-scheduler dump: no hlo_module")
    comps = {first(c, "id"): c for c in module.get("computations", [])}
    entry_id = first(module, "entry_computation_id")
    times = {}
    peak = 0
    for cs in tree.get("computation_schedules", []):
        if first(cs, "computation_id") != entry_id:
            continue
        for pos, ins in enumerate(cs.get("instructions", [])):
            peak = max(peak, int(first(ins, "peak_memory_after", 0)))
            times[first(ins, "id")] = (pos, float(first(ins, "start_timestamp_cycles", 0.0)),
                                       float(first(ins, "end_timestamp_cycles", 0.0)))
    entry = comps[entry_id]
    shapes = {first(i, "id"): first(i, "shape") for i in entry.get("instructions", [])}
    flop_cache: dict[int, float] = {}
    ops: list[HloOp] = []
    own_groups: dict[int, Optional[tuple]] = {}  # native *-start ops carry their replica groups themselves
    for ins in entry.get("instructions", []):
        iid = first(ins, "id")
        own_groups[iid] = replica_groups_of(ins)
        opcode = first(ins, "opcode")
        operands = tuple(ins.get("operand_ids", []))
        op_name = first(first(ins, "metadata", {}) or {}, "op_name", "")
        called = ins.get("called_computation_ids", [])
        if not op_name and opcode == "fusion" and called:
            op_name = _inner_op_name(called[0], comps)
        collective = None
        if opcode == "async-start" or opcode.endswith("-start"):
            collective = _wrapped_collective(ins, comps)
            kind = "start" if collective else "compute"
        elif opcode == "async-done" or opcode.endswith("-done"):
            kind = "done"
        elif opcode in FREE_OPCODES:
            kind = "free"
        else:
            kind = "compute"
        flops = 0.0
        if kind == "compute":
            if opcode in ("dot", "convolution"):
                flops = _dot_flops(ins, shapes)
            elif opcode == "custom-call":
                flops = _gemm_custom_call_flops(ins, shapes)
            for cid in called:
                flops += _computation_flops(cid, comps, flop_cache)
        pos, t0, t1 = times.get(iid, (len(times) + len(ops), 0.0, 0.0))
        ops.append(HloOp(id=iid, name=first(ins, "name"), opcode=opcode, op_name=op_name, operands=operands,
                         kind=kind, collective=collective, out_bytes=shape_bytes(first(ins, "shape")),
                         in_bytes=sum(shape_bytes(shapes.get(o)) for o in operands), flops=flops,
                         start=t0, end=t1, index=pos, called=tuple(called)))
    ops.sort(key=lambda o: o.index)
    for i, o in enumerate(ops):
        o.index = i
    by_id = {o.id: o for o in ops}
    # async done ops: their operand is the start; they inherit its collective kind
    pairs = []
    for o in ops:
        if o.kind != "done":
            continue
        s = by_id.get(o.operands[0]) if o.operands else None
        if s is None or s.kind != "start":
            o.kind = "free"
            continue
        o.collective = s.collective
        opnd_shapes = tuple((first(shapes.get(x) or {}, "element_type", "F32"), tuple(shape_dims(shapes.get(x))))
                            for x in s.operands)
        dims, group, groups = (), 0, own_groups.get(s.id)
        for cid in s.called:
            for sub in comps.get(cid, {}).get("instructions", []):
                if first(sub, "opcode") == s.collective:
                    dims = tuple(int(d) for d in sub.get("dimensions", []))
                    group = _group_size(sub)
                    groups = replica_groups_of(sub)
        if groups and not group:
            group = len(groups[0])
        pairs.append(CollectivePair(start=s, done=o, collective=s.collective, bytes=s.in_bytes,
                                    operand_shapes=opnd_shapes, dims=dims, group_size=group, groups=groups))
    return Schedule(ops=ops, by_id=by_id, pairs=pairs, module_name=first(module, "name", ""), peak_memory=peak)

"""Scanned programs for the two-stream model: an LHS schedule with its while loops unrolled.

`hlo.load_schedule` reads the entry computation of a latency-hiding-scheduler dump. A scanned program
(runtime.scan_layers) keeps its layers in while bodies, so there the layers' collectives and compute
are invisible and the `while` op itself counts as one compute op moving its whole carry.

    schedule = load_unrolled_schedule(text)        # text: the dump's `*.schedule.txt`

returns the entry's Schedule with every while op of a known trip count (XLA's `known_trip_count`)
replaced by its body's schedule, in the order XLA chose inside the body, repeated trip-count times
(nested loops too). This is what the program executes: cost_model.simulate walks the ops in order,
and no collective crosses an iteration boundary (a body's async starts and dones pair inside it).
Each copy gets fresh op ids; its collective pairs are its own. The scanned decode of
the decode scans (serving/generate.py) name their blocks `layer_q{q}` inside `scan_L{first}_P{period}`; copy k of that
loop names them `layer_{first + k * period + q}` (`layer_names`), so analysis/scopes.layer_of reads
the layer of every op as in an unrolled program.

Rows read through a dynamic-slice. A body reads its layer's row of a stacked weight or KV cache
through a dynamic-slice (fused or alone), where hlo.py counts the whole stacked operand as read;
here such an operand counts as the row it yields. An op whose only work is that row copy (XLA:GPU
copies the row into its own buffer ahead of a cuBLAS GEMM that cannot read at an offset: its
`dynamic_slice_fusion`, a memcpy) gets `ROW_COPY` appended to its op_name, so a report can price it
as compiled or as free (`row_copy_ops`): with XLA's dynamic-slice fusion of the GEMM operand (flag
xla_gpu_enable_dynamic_slice_fusion) the GEMM reads the row in place and the copy disappears.

Backward loops run their layers in reverse. The transpose of a scan (reverse mode: op_names under
`transpose(...)`) is a scan with reverse=True: iteration k of a loop whose body is mostly backward
work handles row n-1-k, so its blocks are named `layer_{first + (n-1-k) * period + q}`.

As executed (`as_executed=True`, what the training overlap report reads, analysis/overlap.py):
- data dependencies cross the iterations: copy k's body parameter (the carry) reads copy k-1's root
  (copy 0's the while's init operand), and what read the while reads the last copy's root, so the
  structural bound (analysis/bound.py) sees that layer k+1 waits for what layer k carried;
- XLA's own timestamps are spliced: copy k of a body starts where copy k-1 ended (body timestamps
  are local to the body, from 0), and the entry's ops after the loop move by the loops' length
  (XLA's entry schedule prices a while op at ~0), so XLA's deviceless model has one timeline.
The default (False) keeps the serving report's reading (analysis/inference_report.py): copies
without links, body-local timestamps (it re-times everything with the two-stream model).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Optional

from farskip_jax.analysis.hlo import FREE_OPCODES, Schedule, load_schedule, shape_bytes
from farskip_jax.analysis.textproto import first, parse_textproto
from farskip_jax.model.stacking import SCAN_SCOPE

ROW_COPY = "row_copy"  # op_name suffix of the ops that only copy one row out of a stacked buffer
_PASS = {"bitcast", "copy", "reshape"}  # between a fused parameter and its dynamic-slice / the root


def layer_names(op_name: str, iteration: int, trips: Optional[int] = None, reverse: bool = False) -> str:
    """op_name of iteration `iteration` of a scanned loop (model/stacking.scan_scope, the training
    scan of model/transformer.py): `layer_q{q}` under `scan_L{first}_P{period}` becomes
    `layer_{first + r * period + q}`, r = iteration, or trips - 1 - iteration when `reverse` (a
    backward loop: the transpose of a scan runs its rows last to first)."""
    m = SCAN_SCOPE.search(op_name or "")
    if not m:
        return op_name
    first_layer, period = int(m.group(1)), int(m.group(2))
    r = trips - 1 - iteration if reverse and trips is not None else iteration
    head, tail = op_name[:m.end()], op_name[m.end():]
    return head + _LAYER_Q.sub(lambda q: f"layer_{first_layer + r * period + int(q.group(1))}", tail)


def _runs_backward(names) -> bool:
    """Whether a loop body is the transpose of a scan: most op_names of its compute ops are under
    `transpose(...)` (a remat's forward recomputation inside it is not). It runs its rows in reverse."""
    names = list(names)
    return bool(names) and 2 * sum("transpose(" in n for n in names) > len(names)


@dataclasses.dataclass(frozen=True)
class LayerLoop:
    """A while loop over layers of a scanned program: `trips` iterations of `period` layers from
    layer `first`, forward or backward (the transpose of a scan: rows last to first)."""

    body: str  # the body computation's name
    trips: int
    first: int
    period: int
    direction: str  # fwd | bwd

    @property
    def layers(self) -> range:
        return range(self.first, self.first + self.trips * self.period)


def layer_loops(text: str) -> list[LayerLoop]:
    """The while loops over layers of an LHS dump (bodies whose op_names carry a scan_L{first}_P{period}
    scope, model/stacking.scan_scope: the decode and the training scans), in computation order;
    [] for a program whose layers are unrolled."""
    module = first(parse_textproto(text), "hlo_module") or {}
    comps = {first(c, "id"): c for c in module.get("computations", [])}
    out = []
    for body, n in _while_loops(comps).values():
        comp = comps.get(body, {})
        names = [first(first(i, "metadata", {}) or {}, "op_name", "") for i in comp.get("instructions", [])
                 if first(i, "opcode") not in FREE_OPCODES]
        m = next((SCAN_SCOPE.search(x) for x in names if SCAN_SCOPE.search(x)), None)
        if m is None:
            continue
        out.append(LayerLoop(body=first(comp, "name", ""), trips=n, first=int(m.group(1)), period=int(m.group(2)),
                             direction="bwd" if _runs_backward(x for x in names if x) else "fwd"))
    return out


_LAYER_Q = re.compile(r"layer_q(\d+)")


def row_copy_ops(schedule: Schedule) -> frozenset:
    """Ids of the ops tagged ROW_COPY (the layer-row copies of a scanned program)."""
    return frozenset(o.id for o in schedule.ops if (o.op_name or "").endswith("/" + ROW_COPY))


def _while_loops(comps: dict) -> dict:
    """{while op id: (body id, trip count)} of every while with a known trip count."""
    out = {}
    for comp in comps.values():
        for ins in comp.get("instructions", []):
            if first(ins, "opcode") != "while":
                continue
            try:
                n = int(json.loads(first(ins, "backend_config", "") or "{}")["known_trip_count"]["n"])
            except (KeyError, ValueError, TypeError):
                continue
            called = ins.get("called_computation_ids", [])
            body = [c for c in called if not _is_condition(comps.get(c))]
            if len(body) == 1:
                out[first(ins, "id")] = (body[0], n)
    return out


def _is_condition(comp: Optional[dict]) -> bool:
    if comp is None:
        return True
    root = first(comp, "root_id")
    for ins in comp.get("instructions", []):
        if first(ins, "id") == root:
            return first(first(ins, "shape", {}) or {}, "element_type", "") == "PRED"
    return False


def _row_reads(comp: dict) -> tuple[dict, bool]:
    """({parameter number: bytes read through dynamic-slices}, whether the computation only copies a
    row: root = dynamic-slice(parameter) up to bitcasts / copies) of a fused computation."""
    ins = {first(i, "id"): i for i in comp.get("instructions", [])}

    def source(iid):  # the parameter number an instruction reads through pass-through ops, else None
        while iid in ins:
            i = ins[iid]
            op = first(i, "opcode")
            if op == "parameter":
                return int(first(i, "parameter_number", 0))
            if op not in _PASS:
                return None
            iid = (i.get("operand_ids") or [None])[0]
        return None

    reads: dict = {}
    for i in ins.values():
        if first(i, "opcode") == "dynamic-slice" and i.get("operand_ids"):
            p = source(i["operand_ids"][0])
            if p is not None:
                reads[p] = reads.get(p, 0) + shape_bytes(first(i, "shape"))

    def row_copy(iid) -> bool:  # dynamic-slice(parameter) up to pass-through ops
        while iid in ins:
            op = first(ins[iid], "opcode")
            if op == "dynamic-slice":
                return source((ins[iid].get("operand_ids") or [None])[0]) is not None
            if op not in _PASS:
                return False
            iid = (ins[iid].get("operand_ids") or [None])[0]
        return False

    root = first(comp, "root_id")
    if root in ins and first(ins[root], "opcode") == "tuple":  # a multi-output fusion: every output a row
        return reads, bool(ins[root].get("operand_ids")) and all(row_copy(x) for x in ins[root]["operand_ids"])
    return reads, row_copy(root)


def _fix_row_reads(schedule: Schedule, comp: dict, comps: dict) -> None:
    """In place: operands read through dynamic-slices count as their rows; row-copy ops tagged."""
    shapes = {first(i, "id"): first(i, "shape") for i in comp.get("instructions", [])}
    by_id = {first(i, "id"): i for i in comp.get("instructions", [])}
    for o in schedule.ops:
        if o.kind != "compute":
            continue
        if o.opcode == "dynamic-slice":
            reads, copy_only = {0: o.out_bytes}, True
        elif o.opcode == "fusion" and o.called:
            reads, copy_only = {}, False
            for cid in o.called:
                more, only = _row_reads(comps.get(cid, {}))
                reads.update(more)
                copy_only = copy_only or only
        else:
            continue
        operands = by_id.get(o.id, {}).get("operand_ids", list(o.operands))
        for p, row in reads.items():
            if p < len(operands):
                full = shape_bytes(shapes.get(operands[p]))
                o.in_bytes -= max(full - min(row, full), 0)
        if copy_only and reads:
            o.op_name = f"{o.op_name}/{ROW_COPY}"


def load_unrolled_schedule(text: str, as_executed: bool = False) -> Schedule:
    """The entry schedule of an LHS dump with every while loop of known trip count unrolled (module
    doc); `as_executed`: iterations linked by their carry and XLA's timestamps on one timeline."""
    tree = parse_textproto(text)
    module = first(tree, "hlo_module")
    if module is None:
        raise ValueError("not a latency-hiding-scheduler dump: no hlo_module")
    comps = {first(c, "id"): c for c in module.get("computations", [])}
    loops = _while_loops(comps)
    entry_id = first(module, "entry_computation_id")
    memo: dict = {}
    counter = [max((first(i, "id") for c in comps.values() for i in c.get("instructions", [])), default=0) + 1]

    def schedule_of(cid) -> Schedule:
        if cid not in memo:
            own = text if cid == entry_id else re.sub(r"entry_computation_id: \d+", f"entry_computation_id: {cid}",
                                                      text, count=1)
            s = load_schedule(own)
            _fix_row_reads(s, comps[cid], comps)
            memo[cid] = s
        return memo[cid]

    tuple_index = {first(i, "id"): int(first(i, "tuple_index", 0)) for c in comps.values()
                   for i in c.get("instructions", []) if first(i, "opcode") == "get-tuple-element"}

    def expand(cid, depth=0) -> tuple[list, list]:
        """(ops, pairs) of computation cid with its loops unrolled (ops shared with the memo: copied
        by the caller; with as_executed, copies in the computation's own time, from its first op)."""
        s = schedule_of(cid)
        pair_of_start = {p.start.id: p for p in s.pairs}
        ops, pairs = [], []
        out_of: dict = {}  # as_executed: while op id -> (its result's elements, the result) = the last root's
        shift = 0.0  # as_executed: how far the ops after the loops so far move

        def carried(x):  # ids of the elements of tuple-valued op x (None when not a tuple op), and x
            if x in out_of:
                return out_of[x]
            op = s.by_id.get(x)
            return (tuple(op.operands) if op is not None and op.opcode == "tuple" else None), x

        def read(op, elems, whole, source):  # op with its reads of `source` (a tuple) made element-wise
            if op.opcode == "get-tuple-element" and op.operands == (source,) and elems is not None \
                    and tuple_index.get(op.id, -1) < len(elems):
                return (elems[tuple_index[op.id]],)
            return tuple(whole if x == source else x for x in op.operands)

        for o in s.ops:
            if o.id in loops and depth < 8:
                body, n = loops[o.id]
                b_ops, b_pairs = expand(body, depth + 1)
                reverse = _runs_backward(b.op_name or "" for b in b_ops if b.kind == "compute")
                root = first(comps[body], "root_id")
                param = next((b.id for b in b_ops if b.opcode == "parameter"), None)
                b0 = min((b.start for b in b_ops), default=0.0)
                span = max((b.end for b in b_ops), default=0.0) - b0
                elems, whole = carried(o.operands[0]) if o.operands else (None, None)
                for k in range(n):
                    c_ops, c_pairs = _copy(b_ops, b_pairs, counter)
                    for c, b in zip(c_ops, b_ops):
                        c.op_name = layer_names(c.op_name, k, n, reverse)
                        if as_executed:
                            dt = o.start + shift + k * span - b0
                            c.start, c.end = c.start + dt, c.end + dt
                            if b.id == param and whole is not None:
                                c.operands = (whole,)
                            elif param in b.operands and whole is not None:
                                c.operands = read(b, elems, whole, param)
                    if as_executed:
                        new_root = next((c for c, b in zip(c_ops, b_ops) if b.id == root), None)
                        if new_root is not None:
                            whole = new_root.id
                            elems = tuple(new_root.operands) if new_root.opcode == "tuple" else None
                    ops.extend(c_ops)
                    pairs.extend(c_pairs)
                if as_executed:
                    if whole is not None:
                        out_of[o.id] = (elems, whole)
                    shift += n * span - (o.end - o.start)
                continue
            if as_executed and (shift or any(x in out_of for x in o.operands)):
                operands = o.operands
                for x in set(operands) & set(out_of):
                    operands = read(dataclasses.replace(o, operands=operands), *out_of[x], x)
                o = dataclasses.replace(o, start=o.start + shift, end=o.end + shift, operands=tuple(operands))
            ops.append(o)
            if o.id in pair_of_start:
                pairs.append(pair_of_start[o.id])
        return ops, pairs

    ops, pairs = expand(entry_id)
    ops, pairs = _copy(ops, pairs, counter)
    for i, o in enumerate(ops):
        o.index = i
        o.op_name = layer_names(o.op_name, 0)  # a loop of one iteration that XLA inlined
    entry = schedule_of(entry_id)
    return Schedule(ops=ops, by_id={o.id: o for o in ops}, pairs=pairs, module_name=entry.module_name,
                    peak_memory=entry.peak_memory)

def _copy(ops: list, pairs: list, counter: list) -> tuple[list, list]:
    """Fresh copies of ops (new ids, operands remapped inside the copy) and of their pairs."""
    new_id = {}
    for o in ops:
        new_id[o.id] = counter[0]
        counter[0] += 1
    out = [dataclasses.replace(o, id=new_id[o.id], operands=tuple(new_id.get(x, x) for x in o.operands)) for o in ops]
    by_old = {o.id: c for o, c in zip(ops, out)}
    new_pairs = [dataclasses.replace(p, start=by_old[p.start.id], done=by_old[p.done.id])
                 for p in pairs if p.start.id in by_old and p.done.id in by_old]
    return out, new_pairs

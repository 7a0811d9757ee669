"""Replica groups and bytes of the collectives in compiled HLO text (any backend), and the Federation of
Experts (FoE) check built on them: are all-to-alls confined to one group's devices, which all-reduces
cross the groups, how many bytes each moves.

    colls = hlo_collectives(compiled.as_text())          # [HloCollective(op, bytes, groups, op_name)]
    summ = foe_summary(compiled.as_text(), mesh)         # FoESummary (mesh from parallel.foe / build.model_mesh)
    print(format_foe_summary(summ))

Device numbers in replica groups are logical ids: positions in the program's device assignment,
which for a jit over NamedShardings of `mesh` is `mesh.devices.flat` order. Bytes are per device
(the operands of one participant), summed over tuple operands (XLA combines collectives into tuples).
Synchronous ops (`all-to-all(`, CPU) and the ops inside GPU async wrappers / `*-start(` are read the
same way; a collective is counted once.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

import numpy as np

from farskip_jax.analysis.hlo import ELEMENT_BYTES

_OPS = ("all-to-all", "all-reduce", "all-gather", "reduce-scatter", "collective-permute")
_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.*?)\s(?P<op>" + "|".join(_OPS)
                   + r")(?:-start)?\((?P<args>[^)]*)\)(?P<attrs>.*)$")
_TYPE = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_OPNAME = re.compile(r'op_name="([^"]*)"')


@dataclass
class HloCollective:
    name: str
    op: str  # all-to-all | all-reduce | ...
    bytes: int  # per participant (operands)
    groups: Optional[list[tuple[int, ...]]]  # None = every device in one group (replica_groups={})
    op_name: str = ""
    shapes: tuple = ()  # ((dtype, dims), ...) of the operands


    @property
    def group_size(self) -> Optional[int]:
        return len(self.groups[0]) if self.groups else None


def _shapes(text: str) -> tuple:
    """((dtype, dims), ...) of the array types in an HLO shape string (tuples flattened)."""
    out = []
    for dtype, dims in _TYPE.findall(text):
        if dtype.upper() in ELEMENT_BYTES:
            out.append((dtype, tuple(int(x) for x in dims.split(",") if x)))
    return tuple(out)


def shapes_bytes(shapes) -> int:
    return int(sum(math.prod(dims) * ELEMENT_BYTES[dt.upper()] for dt, dims in shapes))


def _operand_shapes(m) -> tuple:
    """Operand shapes: inline in the operand list when printed there, else the result shape (an
    all-to-all / all-reduce returns one array of its operand's shape per operand; a *-start's
    result also holds the outputs, so its operands are read from the operand list or halved)."""
    inline = _shapes(m.group("args"))
    if inline:
        return inline
    res = _shapes(m.group("shape"))
    n_args = len([a for a in m.group("args").split(",") if a.strip()])
    return res[:n_args] if n_args and len(res) >= n_args else res


def parse_replica_groups(attrs: str) -> Optional[list[tuple[int, ...]]]:
    """replica_groups of an HLO attribute string: explicit {{0,1},{2,3}} or iota [G,S]<=[dims]T(perm)."""
    m = re.search(r"replica_groups=\{(\{[\d,{} ]*\})?\}", attrs)
    if m:
        if not m.group(1):
            return None
        return [tuple(int(x) for x in g.split(",") if x.strip()) for g in re.findall(r"\{([\d, ]*)\}", m.group(1))]
    m = re.search(r"replica_groups=mesh\[([^\]]*)\], device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\) \{([^}]*)\}",
                  attrs)
    if m:  # replica_groups=mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'a'}: groups along the named axes
        axes = [(a.split("=")[0].strip("' "), int(a.split("=")[1])) for a in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        ids = ids.reshape([n for _, n in axes])
        along = [a.strip("' ") for a in m.group(4).split(",") if a.strip()]
        names = [a for a, _ in axes]
        move = [names.index(a) for a in along]
        keep = [i for i in range(len(names)) if i not in move]
        t = ids.transpose(keep + move)
        return [tuple(int(x) for x in row) for row in t.reshape(-1, int(np.prod([ids.shape[i] for i in move])))]
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if m:
        g, s = int(m.group(1)), int(m.group(2))
        dims = [int(x) for x in m.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(x) for x in m.group(4).split(",")])
        return [tuple(int(x) for x in row) for row in ids.reshape(g, s)]
    return None


def hlo_collectives(hlo_text: str, ops: tuple[str, ...] = _OPS) -> list[HloCollective]:
    """Every collective of `ops` in compiled HLO text, in text order."""
    out = []
    for line in hlo_text.splitlines():
        m = _LINE.match(line)
        if not m or m.group("op") not in ops or "-done(" in line:
            continue
        nm = _OPNAME.search(m.group("attrs"))
        shapes = _operand_shapes(m)
        out.append(HloCollective(name=m.group("name"), op=m.group("op"), bytes=shapes_bytes(shapes),
                                 groups=parse_replica_groups(m.group("attrs")), op_name=nm.group(1) if nm else "",
                                 shapes=shapes))
    return out


def axis_groups(mesh, axes: tuple[str, ...]) -> list[tuple[int, ...]]:
    """Logical device ids (positions in mesh.devices.flat) of the groups that differ only along `axes`."""
    names = list(mesh.axis_names)
    ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
    keep = [i for i, a in enumerate(names) if a not in axes]
    move = [names.index(a) for a in axes]
    t = ids.transpose(keep + move)
    return [tuple(int(x) for x in row) for row in t.reshape(-1, int(np.prod([ids.shape[i] for i in move])))]


def _same_groups(a, b) -> bool:
    return a is not None and sorted(map(sorted, a)) == sorted(map(sorted, b))


@dataclass
class FoESummary:
    group_devices: list[tuple[int, ...]]  # logical ids of each device group (a `group` index)
    all_to_all: list[HloCollective]
    confined: bool  # every all-to-all's replica groups lie inside one device group each
    cross_group: list[HloCollective]  # all-reduces whose groups are exactly the `group` axis
    other_all_reduce: list[HloCollective]

    @property
    def all_to_all_bytes(self) -> int:
        return sum(c.bytes for c in self.all_to_all)

    @property
    def cross_group_bytes(self) -> int:
        return sum(c.bytes for c in self.cross_group)


def foe_summary(hlo_text: str, mesh) -> FoESummary:
    """The FoE view of a program compiled on `mesh` (with a `group` axis; a plain mesh counts as one group)."""
    colls = hlo_collectives(hlo_text, ("all-to-all", "all-reduce"))
    n = mesh.devices.size
    if "group" in mesh.axis_names:
        inside = axis_groups(mesh, tuple(a for a in mesh.axis_names if a != "group"))  # one per group index
        across = axis_groups(mesh, ("group",))
    else:
        inside, across = [tuple(range(n))], []
    where = {d: g for g, devs in enumerate(inside) for d in devs}
    a2a = [c for c in colls if c.op == "all-to-all"]

    def confined(c):
        groups = c.groups or [tuple(range(n))]
        return all(len({where[d] for d in grp}) == 1 for grp in groups)

    ar = [c for c in colls if c.op == "all-reduce"]
    cross = [c for c in ar if across and (_same_groups(c.groups, across) or (c.groups is None and len(across) == 1))]
    return FoESummary(group_devices=inside, all_to_all=a2a, confined=all(confined(c) for c in a2a),
                      cross_group=cross, other_all_reduce=[c for c in ar if c not in cross])


def format_foe_summary(s: FoESummary, label: str = "") -> str:
    gs = sorted({c.group_size or 0 for c in s.all_to_all})
    lines = [f"[{label}] device groups: {[list(g) for g in s.group_devices]}",
             f"  all-to-alls: {len(s.all_to_all)}, {s.all_to_all_bytes:,} B per device, replica group sizes {gs}, "
             f"{'all confined to one group' if s.confined else 'NOT confined: some cross the groups'}",
             f"  cross-group all-reduces: {len(s.cross_group)}, {s.cross_group_bytes:,} B per device"
             + (f" (groups {[list(g) for g in s.cross_group[0].groups or []][:4]}...)" if s.cross_group else ""),
             f"  other all-reduces: {len(s.other_all_reduce)}, {sum(c.bytes for c in s.other_all_reduce):,} B"]
    return "\n".join(lines)


def foe_json(hlo_text: str, mesh) -> dict:
    """foe_summary as a JSON-able dict (overlap report.json)."""
    f = foe_summary(hlo_text, mesh)
    return {"group_devices": [list(g) for g in f.group_devices], "all_to_all_confined": f.confined,
            "all_to_alls": len(f.all_to_all), "all_to_all_bytes": f.all_to_all_bytes,
            "all_to_all_group_sizes": sorted({c.group_size or 0 for c in f.all_to_all}),
            "cross_group_all_reduces": len(f.cross_group), "cross_group_all_reduce_bytes": f.cross_group_bytes}

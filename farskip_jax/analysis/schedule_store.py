"""A compiled program's schedule kept on disk, compact, so the cost model re-times it without compiling.

    save_schedule(schedule, "prog.json.gz", meta={"model": "dsv3_6l", ...})
    schedule, meta = load_schedule_file("prog.json.gz")
    sched, durs = cost_model.simulate(schedule, hw, ...)

What is kept is what the two-stream model, the overlap report and the attention pricing read:
every op (id, name, opcode, op_name, operands, kind, collective, bytes in / out, dot FLOPs) in
schedule order, and every async collective pair (start / done ids, kind, payload, group size,
replica groups). XLA's own timestamps are kept too (start, end) so XLA's report can be re-read.
Repeated op_name strings are stored once (an index table); the file is gzip'd JSON.
"""

from __future__ import annotations

import gzip
import json
from typing import Optional

from farskip_jax.analysis.hlo import CollectivePair, HloOp, Schedule
from farskip_jax.errors import ConfigError

FORMAT = 1


def _encode(schedule: Schedule) -> dict:
    names: dict[str, int] = {}

    def name_id(s: str) -> int:
        return names.setdefault(s or "", len(names))

    ops = [[o.id, o.name, o.opcode, name_id(o.op_name), list(o.operands), o.kind, o.collective, int(o.out_bytes),
            int(o.in_bytes), float(o.flops), float(o.start), float(o.end)] for o in schedule.ops]
    pairs = [[p.start.id, p.done.id, p.collective, int(p.bytes), int(p.group_size),
              None if p.groups is None else [list(g) for g in p.groups], [list(d) if isinstance(d, (list, tuple))
                                                                          else d for d in p.dims]]
             for p in schedule.pairs]
    return {"format": FORMAT, "module_name": schedule.module_name, "peak_memory": int(schedule.peak_memory),
            "op_names": sorted(names, key=names.get), "ops": ops, "pairs": pairs}


def _decode(d: dict) -> Schedule:
    if d.get("format") != FORMAT:
        raise ConfigError(f"schedule file format {d.get('format')!r} is not {FORMAT}; recompile it "
                          "(python -m farskip_jax.analysis.calibration --compile)")
    names = d["op_names"]
    ops = [HloOp(id=i, name=n, opcode=oc, op_name=names[ni], operands=tuple(opnds), kind=k, collective=c,
                 out_bytes=ob, in_bytes=ib, flops=f, start=s, end=e, index=idx)
           for idx, (i, n, oc, ni, opnds, k, c, ob, ib, f, s, e) in enumerate(d["ops"])]
    by = {o.id: o for o in ops}
    pairs = [CollectivePair(start=by[s], done=by[dn], collective=c, bytes=b, group_size=g,
                            groups=None if groups is None else tuple(tuple(x) for x in groups),
                            dims=tuple(tuple(x) if isinstance(x, list) else x for x in dims))
             for s, dn, c, b, g, groups, dims in d["pairs"]]
    return Schedule(ops=ops, by_id=by, pairs=pairs, module_name=d.get("module_name", ""),
                    peak_memory=d.get("peak_memory", 0))


def save_schedule(schedule: Schedule, path: str, meta: Optional[dict] = None) -> None:
    """Write `schedule` (and a JSON-serialisable `meta`) to `path` (gzip'd JSON)."""
    with gzip.open(path, "wt", compresslevel=9) as f:
        json.dump({"meta": meta or {}, "schedule": _encode(schedule)}, f, separators=(",", ":"))


def load_schedule_file(path: str) -> tuple[Schedule, dict]:
    """(Schedule, meta) from a save_schedule file; ConfigError when the file is of another format."""
    with gzip.open(path, "rt") as f:
        d = json.load(f)
    return _decode(d["schedule"]), d.get("meta", {})

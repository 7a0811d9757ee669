"""Structural upper bound on hideable collective time, from the dependency graph alone.

A compute op can run under collective c only if it is neither an ancestor of c's start nor a
descendant of c's done ("independent" of c). With one collective in flight at a time (or, more
generally, counting each compute microsecond at most once), the hidden time of a set of
collectives is at most the maximum flow of

    source --cost(op)--> op --(op independent of c)--> c --duration(c)--> sink

(a transportation problem that ignores ordering, so it is an upper bound on any schedule).
`structural_bound` returns that flow per collective subset (e.g. forward and backward apart).
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import maximum_flow

from farskip_jax.analysis.hlo import CollectivePair, Schedule

_SCALE = 1000.0  # flow capacities are integers: nanoseconds


def _bits(mask: int, n: int) -> np.ndarray:
    """Indices of the set bits of `mask` (< n)."""
    if mask == 0:
        return np.zeros(0, np.int64)
    raw = np.frombuffer(mask.to_bytes((n + 7) // 8, "little"), np.uint8)
    return np.nonzero(np.unpackbits(raw, bitorder="little")[:n])[0]


def independent_ops(schedule: Schedule, pairs: Sequence[CollectivePair]) -> list[np.ndarray]:
    """For each pair, schedule indices of compute ops independent of it (data dependencies only)."""
    ops = schedule.ops
    n = len(ops)
    pos = {o.id: i for i, o in enumerate(ops)}
    anc = [0] * n
    for i, o in enumerate(ops):  # the schedule is a topological order
        m = 0
        for x in o.operands:
            j = pos.get(x)
            if j is not None:
                m |= anc[j] | (1 << j)
        anc[i] = m
    desc = [0] * n
    for i in range(n - 1, -1, -1):
        for x in ops[i].operands:
            j = pos.get(x)
            if j is not None:
                desc[j] |= desc[i] | (1 << i)
    compute = 0
    for i, o in enumerate(ops):
        if o.kind == "compute" and o.duration > 0:
            compute |= 1 << i
    out = []
    for p in pairs:
        s, d = pos[p.start.id], pos[p.done.id]
        out.append(_bits(compute & ~anc[s] & ~desc[d], n))
    return out


def max_hidden(costs: np.ndarray, durations: Sequence[float], indep: Sequence[np.ndarray]) -> float:
    """Max flow of the transportation problem above (costs per op index, durations per collective)."""
    used = sorted({int(i) for ix in indep for i in ix})
    if not used or not len(durations):
        return 0.0
    local = {op: k for k, op in enumerate(used)}
    n_ops, n_c = len(used), len(durations)
    src, sink = 0, 1 + n_ops + n_c
    rows, cols, caps = [], [], []
    big = min(int(np.ceil(float(np.sum(costs[used])) * _SCALE)) + 1, 2**31 - 1)
    for k, op in enumerate(used):
        rows.append(src), cols.append(1 + k), caps.append(int(round(costs[op] * _SCALE)))
    for c, ix in enumerate(indep):
        for op in ix:
            rows.append(1 + local[int(op)]), cols.append(1 + n_ops + c), caps.append(big)
        rows.append(1 + n_ops + c), cols.append(sink), caps.append(int(round(durations[c] * _SCALE)))
    caps = np.minimum(np.asarray(caps, np.int64), 2**31 - 1).astype(np.int32)
    g = csr_matrix((caps, (rows, cols)), shape=(sink + 1, sink + 1))
    return maximum_flow(g, src, sink).flow_value / _SCALE


def structural_bound(schedule: Schedule, pairs: Sequence[CollectivePair], durations: Sequence[float],
                     subsets: Iterable[Sequence[int]], indep: Optional[list[np.ndarray]] = None) -> list[float]:
    """Upper bound on the hidden time of each subset (lists of indices into `pairs`); `indep` may
    pass `independent_ops(schedule, pairs)` when the caller has it already."""
    indep = independent_ops(schedule, pairs) if indep is None else indep
    costs = np.asarray([o.duration if o.kind == "compute" else 0.0 for o in schedule.ops])
    return [max_hidden(costs, [durations[i] for i in sub], [indep[i] for i in sub]) for sub in subsets]

"""A modelled speedup split into the part from hiding communication and the part from compute that
differs between the two programs.

    s = split_speedup(standard_report, farskip_report)    # two OverlapReports of one cost model
    s.total == s.hiding * s.compute
    print("\n".join(split_lines(s, "farskip / standard")))

A step's modelled time T is its compute at full speed C (OverlapReport.compute_time) plus its
communication cost X = T - C (waits at the dones of collectives, and compute slowed by collectives in
flight). For a reference program r and another program o:

    total    T_r / T_o
    hiding   (C_r + X_r) / (C_r + X_o)   r's compute with o's communication cost: what communicating
                                          (hiding) as o does gains; at most ceiling = T_r / C_r (every
                                          microsecond of r's communication cost gone)
    compute  (C_r + X_o) / (C_o + X_o)   the rest: the two programs' compute differs

so total = hiding x compute exactly. Two programs that differ only in compute have hiding = 1 when
their communication cost is the same. `scopes`: the named scopes (analysis/scopes.py) whose compute
differs most, (scope, us in r, us in o). `compute_dominates`: |log compute| > |log hiding|.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SpeedupSplit:
    total: float
    hiding: float
    compute: float
    ceiling: float  # the most hiding can give: T_r / C_r
    ref_compute_us: float
    other_compute_us: float
    ref_comm_us: float  # X_r
    other_comm_us: float  # X_o
    scopes: tuple = field(default_factory=tuple)  # ((scope, ref us, other us), ...), largest difference first

    @property
    def compute_dominates(self) -> bool:
        return abs(math.log(self.compute)) > abs(math.log(self.hiding))


def split_speedup(ref, other, top: int = 3) -> SpeedupSplit:
    """The split of ref.step_time / other.step_time (module doc); ref, other: report.OverlapReport."""
    cr, co = ref.compute_time, other.compute_time
    xr, xo = ref.step_time - cr, other.step_time - co
    sr, so = ref.compute_by_scope, other.compute_by_scope
    diff = sorted(((k, sr.get(k, 0.0), so.get(k, 0.0)) for k in set(sr) | set(so)), key=lambda t: -abs(t[1] - t[2]))
    return SpeedupSplit(total=ref.step_time / other.step_time, hiding=(cr + xr) / (cr + xo),
                        compute=(cr + xo) / (co + xo), ceiling=ref.step_time / cr if cr > 0 else float("inf"),
                        ref_compute_us=cr, other_compute_us=co, ref_comm_us=xr, other_comm_us=xo,
                        scopes=tuple(d for d in diff[:top] if abs(d[1] - d[2]) > 0.0))


def split_lines(s: SpeedupSplit, what: str, ref: str = "standard", other: str = "farskip") -> list[str]:
    """The split in words: `what` names the speedup (e.g. 'farskip / standard'); a NOTE when the
    compute difference dominates."""
    scopes = ", ".join(f"{k} {a / 1e3:.2f} vs {b / 1e3:.2f} ms" for k, a, b in s.scopes) or "none"
    out = [f"SPLIT {what} {s.total:.3f}x = hiding communication {s.hiding:.3f}x (communication cost "
           f"{s.ref_comm_us / 1e3:.2f} ms {ref} -> {s.other_comm_us / 1e3:.2f} ms {other}; ceiling {s.ceiling:.3f}x "
           f"= all of {ref}'s hidden) x compute difference {s.compute:.3f}x (compute {s.ref_compute_us / 1e3:.2f} "
           f"vs {s.other_compute_us / 1e3:.2f} ms; differs most: {scopes})"]
    if s.compute_dominates and abs(s.total - 1.0) > 1e-4:
        out.append(f"NOTE {what}: most of this speedup ({s.compute:.3f}x of {s.total:.3f}x) is compute that differs "
                   f"between the two programs, not communication hidden ({s.hiding:.3f}x)")
    return out

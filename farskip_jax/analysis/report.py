"""Per-collective overlap statistics from a timed schedule, and the side-by-side text report.

For an async collective c with start/done ops, its *window* is [end of start, start of done] on the
compute stream's timeline. Compute ops whose modelled execution falls inside the window run under
it. With `duration(c)` the modelled transfer time,

    hidden(c)  = min(duration(c), compute time inside the window)
    exposed(c) = duration(c) - hidden(c)     (the compute stream waits that long at the done)

Timelines come either from XLA's own cost-model schedule (hlo.Schedule timestamps) or from the
two-stream cost model (cost_model.py); both fill the same `HloOp.start/end` fields.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional, Sequence

from farskip_jax.analysis.bound import independent_ops, structural_bound
from farskip_jax.analysis.hlo import Schedule
from farskip_jax.analysis.loop_schedule import ROW_COPY
from farskip_jax.analysis.scopes import direction_of, label_of, layer_of, scope_of
from farskip_jax.analysis.speedup import split_speedup

ALL_TO_ALLS = ("all-to-all", "ragged-all-to-all")


@dataclass
class CollectiveStat:
    name: str
    collective: str
    layer: Optional[int]
    role: str  # dispatch | combine | other (the scope the collective was issued in)
    direction: str  # fwd | bwd
    bytes: int
    duration: float  # us
    window: float  # us between start and done on the compute stream
    hidden: float  # us
    inside: dict[str, float] = field(default_factory=dict)  # scope label -> us of compute in the window
    independent: float = 0.0  # us of compute that does not depend on / feed this collective
    t_start: float = 0.0
    t_done: float = 0.0

    @property
    def exposed(self) -> float:
        return self.duration - self.hidden


@dataclass
class OverlapReport:
    label: str
    stats: list[CollectiveStat]
    step_time: float  # us, end of the last op
    compute_time: float  # us, sum of compute op durations
    other_collective_time: float  # us the other collectives (gradient all-reduces, ...) take: modelled transfer time
    bound: dict[str, float]  # direction ("fwd", "bwd", "all") -> structural max hideable us
    peak_memory: int = 0  # bytes, LHS's estimate of the schedule's peak (memory pressure stops overlap)
    other_exposed: float = 0.0  # us the compute stream waits at dones of the other collectives
    row_copy_time: float = 0.0  # us of a scanned program's stacked-row copies (loop_schedule.ROW_COPY ops)
    contention_time: float = 0.0  # us compute lost to collectives in flight (HloOp.stretch; not in compute_time)
    compute_by_scope: dict[str, float] = field(default_factory=dict)  # scope -> us of compute (alone)

    @property
    def communication_cost(self) -> float:
        """us of the step that are not compute at full speed: waits at collectives + contention."""
        return self.step_time - self.compute_time

    def ceiling_step(self) -> float:
        """Step time if every all-to-all microsecond of this schedule were hidden (us)."""
        return self.step_time - self.totals("all")["exposed"]

    def ceiling_speedup(self) -> float:
        """step / (step - exposed all-to-all): the most any overlap of the all-to-alls can gain."""
        c = self.ceiling_step()
        return self.step_time / c if c > 0 else float("inf")

    def totals(self, direction: Optional[str] = None) -> dict[str, float]:
        sel = [s for s in self.stats if direction in (None, "all", s.direction)]
        dur = sum(s.duration for s in sel)
        hid = sum(s.hidden for s in sel)
        bnd = self.bound.get(direction or "all", 0.0)
        return dict(count=len(sel), duration=dur, hidden=hid, exposed=dur - hid, bound=bnd,
                    hidden_frac=hid / dur if dur else 1.0, bound_frac=bnd / dur if dur else 1.0,
                    of_bound=hid / bnd if bnd else 1.0,
                    empty=sum(1 for s in sel if s.hidden <= 1e-9))


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def analyze(schedule: Schedule, durations: Optional[Sequence[float]] = None, label: str = "",
            kinds: Sequence[str] = ALL_TO_ALLS, with_bound: bool = True) -> OverlapReport:
    """Overlap statistics of the collectives of `kinds` in a timed schedule.

    durations: modelled duration per entry of `schedule.pairs` (default: the window when the done
    had to wait, which is XLA's latency whenever anything is exposed); `other_collective_time` sums
    them over the collectives not of `kinds` (their transfer time, not their windows).
    compute_time / compute_by_scope: the compute ops' time alone (HloOp.work), contention_time what
    collectives in flight added to it (cost_model.simulate)."""
    pairs = list(schedule.pairs)
    compute = [o for o in schedule.ops if o.kind == "compute" and o.duration > 0]
    by_scope: dict[str, float] = defaultdict(float)
    for o in compute:
        by_scope[scope_of(o.op_name)] += o.work
    sel = [i for i, p in enumerate(pairs) if p.collective in kinds]
    stats = []
    for i in sel:
        p = pairs[i]
        w0, w1 = p.start.end, p.done.start
        inside: dict[str, float] = defaultdict(float)
        busy = 0.0
        for o in compute:
            if o.end <= w0 or o.start >= w1:
                continue
            t = _overlap(o.start, o.end, w0, w1)
            busy += t
            inside[label_of(o.op_name)] += t
        dur = durations[i] if durations is not None else max(w1 - w0, 0.0)
        name = p.start.op_name
        stats.append(CollectiveStat(name=p.start.name, collective=p.collective, layer=layer_of(name),
                                    role=scope_of(name) if scope_of(name) in ("dispatch", "combine") else "other",
                                    direction=direction_of(name), bytes=p.bytes, duration=dur,
                                    window=max(w1 - w0, 0.0), hidden=min(dur, busy), inside=dict(inside),
                                    t_start=w0, t_done=w1))
    bound = {}
    if with_bound and stats:
        subsets = {"all": list(range(len(sel))),
                   "fwd": [k for k, s in enumerate(stats) if s.direction == "fwd"],
                   "bwd": [k for k, s in enumerate(stats) if s.direction == "bwd"]}
        indep = independent_ops(schedule, [pairs[i] for i in sel])
        costs = {o.index: o.duration for o in compute}
        for k, ix in enumerate(indep):
            stats[k].independent = float(sum(costs.get(int(j), 0.0) for j in ix))
        vals = structural_bound(schedule, [pairs[i] for i in sel], [s.duration for s in stats], subsets.values(),
                                  indep=indep)
        bound = dict(zip(subsets.keys(), vals))
    other = sum(durations[i] if durations is not None else max(p.done.start - p.start.end, 0.0)
                for i, p in enumerate(pairs) if p.collective not in kinds)
    other_exposed = sum(max(p.done.end - p.done.start, 0.0) for p in pairs if p.collective not in kinds)
    row_copy = sum(o.work for o in compute if (o.op_name or "").endswith("/" + ROW_COPY))
    return OverlapReport(label=label, stats=stats, step_time=schedule.makespan,
                         compute_time=sum(o.work for o in compute), other_collective_time=other, bound=bound,
                         peak_memory=schedule.peak_memory, other_exposed=other_exposed, row_copy_time=row_copy,
                         contention_time=sum(o.stretch for o in compute), compute_by_scope=dict(by_scope))


def _top_inside(s: CollectiveStat, n: int = 3) -> str:
    items = sorted(s.inside.items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{k} {v:.0f}" for k, v in items) if items else "-"


def format_collectives(rep: OverlapReport) -> str:
    """One line per collective: layer, role, fwd/bwd, MB, duration, hidden, % and what ran inside."""
    lines = [f"[{rep.label}] all-to-alls in schedule order (times in us)",
             f"{'name':<28}{'layer':>6} {'role':<9}{'dir':<4}{'MB':>8}{'dur':>9}{'hidden':>9}{'%':>6}"
             f"{'indep':>9}  scopes inside (us)"]
    for s in rep.stats:
        pct = 100 * s.hidden / s.duration if s.duration else 100.0
        lines.append(f"{s.name[:27]:<28}{'-' if s.layer is None else s.layer:>6} {s.role:<9}{s.direction:<4}"
                     f"{s.bytes / 2**20:>8.1f}{s.duration:>9.1f}{s.hidden:>9.1f}{pct:>6.1f}{s.independent:>9.0f}"
                     f"  {_top_inside(s)}")
    return "\n".join(lines)


def format_side_by_side(reports: Sequence[OverlapReport]) -> str:
    """Totals of several reports (e.g. standard vs farskip) as one table, plus the step speedup."""
    w = max([16] + [len(r.label) + 2 for r in reports])
    head = f"{'':<34}" + "".join(f"{r.label:>{w}}" for r in reports)
    rows = [head]

    def row(name, fn, fmt="{:>16.1f}"):
        fmt = fmt.replace("{:>15", "{:>" + str(w - 1)).replace("{:>16", "{:>" + str(w))
        rows.append(f"{name:<34}" + "".join(fmt.format(fn(r)) for r in reports))

    for d in ("fwd", "bwd", "all"):
        if not any(r.totals(d)["count"] for r in reports):
            continue
        row(f"{d}: all-to-alls", lambda r: r.totals(d)["count"], "{:>16d}")
        row(f"{d}: all-to-all time (us)", lambda r: r.totals(d)["duration"])
        row(f"{d}: hidden (us)", lambda r: r.totals(d)["hidden"])
        row(f"{d}: exposed (us)", lambda r: r.totals(d)["exposed"])
        row(f"{d}: hidden fraction", lambda r: 100 * r.totals(d)["hidden_frac"], "{:>15.1f}%")
        row(f"{d}: structural bound", lambda r: 100 * r.totals(d)["bound_frac"], "{:>15.1f}%")
        row(f"{d}: hidden / bound", lambda r: 100 * r.totals(d)["of_bound"], "{:>15.1f}%")
        row(f"{d}: with nothing inside", lambda r: r.totals(d)["empty"], "{:>16d}")
    row("compute time (us)", lambda r: r.compute_time)
    if any(r.row_copy_time for r in reports):  # a scanned program: XLA copies layer rows out of the stacks
        row("  of which stacked-row copies (us)", lambda r: r.row_copy_time)
    if any(r.contention_time for r in reports):
        row("compute slowed by collectives (us)", lambda r: r.contention_time)
    row("other collectives: transfer (us)", lambda r: r.other_collective_time)
    row("other collectives: waited (us)", lambda r: r.other_exposed)
    row("scheduler peak memory (GiB)", lambda r: r.peak_memory / 2**30, "{:>16.2f}")
    row("modelled step time (us)", lambda r: r.step_time)
    base = reports[0].step_time
    row(f"speedup vs {reports[0].label}", lambda r: base / r.step_time if r.step_time else 0.0, "{:>15.3f}x")
    if len(reports) > 1:
        row("  of which hiding communication", lambda r: split_speedup(reports[0], r).hiding, "{:>15.3f}x")
        row("  of which compute difference", lambda r: split_speedup(reports[0], r).compute, "{:>15.3f}x")
    row("step, every all-to-all hidden (us)", lambda r: r.ceiling_step())
    row(f"ceiling speedup vs {reports[0].label}", lambda r: base / r.ceiling_step() if r.ceiling_step() > 0 else 0.0,
        "{:>15.3f}x")
    return "\n".join(rows)

"""How the modelled step speedup depends on the all-to-all bandwidth and on contention (two-stream
cost model).

    rows = bandwidth_sweep(std_schedule, fs_schedule, HARDWARE["mi300x"], [25e9, 50e9, 100e9, 200e9])
    print(format_sweep(rows))
    bws = implied_bandwidth(std_schedule, fs_schedule, HARDWARE["mi300x"], speedup=1.11)  # crossings
    rows = contention_sweep(std_schedule, fs_schedule, HARDWARE["mi300x"], [1.0, 0.9, 0.8, 0.7])
    print(format_contention_sweep(rows))

Each compiled schedule (standard, farskip) is re-timed with `Hardware.a2a_bw` replaced (every
other parameter, the compute times and the other collectives unchanged). Per bandwidth:

    standard        standard's step, all-to-alls overlapped as XLA scheduled them
    no overlap      standard's step with every all-to-all synchronous (the paper's Megatron baseline)
    farskip         farskip's step
    speedup         standard / farskip;  vs no overlap: no-overlap / farskip
    ceiling         standard / (standard - its exposed all-to-all time): what perfect hiding gives
    a2a share       all-to-all time / no-overlap step

`implied_bandwidth` inverts the farskip-vs-no-overlap speedup: the bandwidth at which this model
reproduces a measured speedup of the paper's kind (FarSkip vs a baseline without overlap). It is a
property of the model's compute times too (roofline kernels, naive or blockwise attention), so it is
read as "the all-to-all share of the step the paper's number implies", expressed as a bandwidth.

`contention_sweep` re-times both schedules with `Hardware.contention` replaced (compute speed while a
collective is in flight, cost_model.simulate) and splits each speedup into hiding communication x
compute difference (analysis/speedup.py). Keyword arguments of the sweeps (fused_attention,
topology, ...) go to cost_model.simulate.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

from farskip_jax.analysis.cost_model import Hardware, simulate
from farskip_jax.analysis.hlo import Schedule
from farskip_jax.analysis.report import ALL_TO_ALLS, analyze
from farskip_jax.analysis.speedup import split_speedup


@dataclass(frozen=True)
class SweepRow:
    a2a_gbs: float  # GB/s per GPU
    standard_us: float
    no_overlap_us: float
    farskip_us: float
    a2a_us: float  # standard's all-to-all time
    std_exposed_us: float

    @property
    def speedup(self) -> float:
        return self.standard_us / self.farskip_us

    @property
    def speedup_vs_no_overlap(self) -> float:
        return self.no_overlap_us / self.farskip_us

    @property
    def ceiling(self) -> float:
        return self.standard_us / (self.standard_us - self.std_exposed_us)

    @property
    def a2a_share(self) -> float:
        return self.a2a_us / self.no_overlap_us


def sweep_point(std: Schedule, fs: Schedule, hw: Hardware, a2a_bw: float, group_size: int = 8, **kw) -> SweepRow:
    """One bandwidth (bytes/s): the three re-timed steps."""
    h = dataclasses.replace(hw, a2a_bw=a2a_bw)
    s_sched, s_d = simulate(std, h, group_size, in_place_updates=True, **kw)
    s_rep = analyze(s_sched, s_d, with_bound=False)
    n_sched, _ = simulate(std, h, group_size, serialize=ALL_TO_ALLS, in_place_updates=True, **kw)
    f_sched, _ = simulate(fs, h, group_size, in_place_updates=True, **kw)
    tot = s_rep.totals("all")
    return SweepRow(a2a_bw / 1e9, s_rep.step_time, n_sched.makespan, f_sched.makespan, tot["duration"], tot["exposed"])


def bandwidth_sweep(std: Schedule, fs: Schedule, hw: Hardware, bandwidths: Sequence[float],
                    group_size: int = 8, **kw) -> list[SweepRow]:
    return [sweep_point(std, fs, hw, bw, group_size, **kw) for bw in bandwidths]


def implied_bandwidth(std: Schedule, fs: Schedule, hw: Hardware, speedup: float = 1.11, group_size: int = 8,
                      lo: float = 10e9, hi: float = 2e12, grid: int = 16, iters: int = 20, **kw) -> list[float]:
    """Bandwidths (bytes/s) in [lo, hi] at which farskip / no-overlap standard equals `speedup`.

    The curve is not monotone: at low bandwidth the all-to-alls outgrow the compute that could hide
    them (the speedup falls towards 1 from above as hiding saturates), at high bandwidth they vanish
    from the step (falls to 1 again). So: a log grid, then bisection inside every sign change."""
    f = lambda bw: sweep_point(std, fs, hw, bw, group_size, **kw).speedup_vs_no_overlap - speedup
    xs = [lo * (hi / lo) ** (i / (grid - 1)) for i in range(grid)]
    ys = [f(x) for x in xs]
    out = []
    for (a, fa), (b, fb) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if (fa > 0) == (fb > 0):
            continue
        for _ in range(iters):
            mid = (a * b) ** 0.5
            fm = f(mid)
            if (fm > 0) == (fa > 0):
                a, fa = mid, fm
            else:
                b = mid
        out.append((a * b) ** 0.5)
    return out


def format_sweep(rows: Sequence[SweepRow], marks: Optional[dict[float, str]] = None) -> str:
    """Table of a sweep; `marks` {GB/s: note} labels rows (e.g. the hardware default, the paper's)."""
    marks = marks or {}
    out = [f"{'a2a GB/s':>9}{'a2a share':>10}{'standard':>10}{'no ovl':>10}{'farskip':>10}"
           f"{'fs/std':>8}{'ceiling':>8}{'fs/no-ovl':>10}  (steps in ms)"]
    for r in rows:
        note = next((v for k, v in marks.items() if abs(k - r.a2a_gbs) < 1e-6 * max(k, 1)), "")
        out.append(f"{r.a2a_gbs:>9.1f}{100 * r.a2a_share:>9.1f}%{r.standard_us / 1e3:>10.2f}"
                   f"{r.no_overlap_us / 1e3:>10.2f}{r.farskip_us / 1e3:>10.2f}{r.speedup:>7.3f}x{r.ceiling:>7.3f}x"
                   f"{r.speedup_vs_no_overlap:>9.3f}x  {note}")
    return "\n".join(out)


@dataclass(frozen=True)
class ContentionRow:
    contention: float
    standard_us: float
    no_overlap_us: float
    farskip_us: float
    vs_standard: object  # speedup.SpeedupSplit of farskip / standard
    vs_no_overlap: object  # speedup.SpeedupSplit of farskip / standard without overlap
    std_hidden: float  # hidden fraction of the all-to-all time, standard
    fs_hidden: float


def contention_sweep(std: Schedule, fs: Schedule, hw: Hardware, contentions: Sequence[float], group_size: int = 8,
                     **kw) -> list[ContentionRow]:
    """Both schedules re-timed at each contention (cost_model.simulate's `contention`)."""
    rows = []
    for c in contentions:
        s_rep = analyze(*simulate(std, hw, group_size, in_place_updates=True, contention=c, **kw), with_bound=False)
        n_rep = analyze(*simulate(std, hw, group_size, serialize=ALL_TO_ALLS, in_place_updates=True, contention=c,
                                  **kw), with_bound=False)
        f_rep = analyze(*simulate(fs, hw, group_size, in_place_updates=True, contention=c, **kw), with_bound=False)
        rows.append(ContentionRow(c, s_rep.step_time, n_rep.step_time, f_rep.step_time, split_speedup(s_rep, f_rep),
                                  split_speedup(n_rep, f_rep), s_rep.totals("all")["hidden_frac"],
                                  f_rep.totals("all")["hidden_frac"]))
    return rows


def format_contention_sweep(rows: Sequence[ContentionRow], default: Optional[float] = None) -> str:
    """Table of a contention sweep; `default` marks the hardware's default row."""
    out = [f"{'contention':>10}{'standard':>10}{'no ovl':>10}{'farskip':>10}{'fs/std':>8}{'= hide':>8}{'x comp':>8}"
           f"{'fs/no-ovl':>10}{'= hide':>8}{'x comp':>8}{'hidden std/fs':>15}  (steps in ms)"]
    for r in rows:
        a, b = r.vs_standard, r.vs_no_overlap
        note = "  <- default" if default is not None and abs(r.contention - default) < 1e-9 else ""
        out.append(f"{r.contention:>10.2f}{r.standard_us / 1e3:>10.2f}{r.no_overlap_us / 1e3:>10.2f}"
                   f"{r.farskip_us / 1e3:>10.2f}{a.total:>7.3f}x{a.hiding:>7.3f}x{a.compute:>7.3f}x"
                   f"{b.total:>9.3f}x{b.hiding:>7.3f}x{b.compute:>7.3f}x"
                   f"{100 * r.std_hidden:>7.1f}/{100 * r.fs_hidden:.1f}%{note}")
    return "\n".join(out)

"""A modelled speedup split into hiding communication x compute difference (analysis/speedup.py), and
"other collectives" reported as transfer time, on hand-built schedules timed by the two-stream model."""

import math

import pytest

from farskip_jax.analysis.cost_model import Hardware, simulate
from farskip_jax.analysis.hlo import CollectivePair, HloOp, Schedule
from farskip_jax.analysis.report import analyze, format_side_by_side
from farskip_jax.analysis.speedup import split_lines, split_speedup

TOY = Hardware("toy", peak_flops=1e15, hbm_bw=1e9, a2a_bw=1e9, coll_bw=1e9, coll_latency_us=0.0, launch_us=0.0,
               matmul_eff=1.0, mem_eff=1.0)


def program(spec, pairs, collective="all-to-all") -> Schedule:
    """spec: (name, kind, operands, us of compute, scope); pairs: (start, done, payload bytes)."""
    ids = {n: i + 1 for i, (n, *_) in enumerate(spec)}
    ops = [HloOp(id=ids[n], name=n, opcode="fusion" if k == "compute" else f"async-{k}",
                 op_name=f"jit(f)/layer_0/{scope}/op", operands=tuple(ids[o] for o in opnds), kind=k,
                 in_bytes=int(500 * us), out_bytes=int(500 * us), index=i)
           for i, (n, k, opnds, us, scope) in enumerate(spec)]
    by = {o.id: o for o in ops}
    return Schedule(ops=ops, by_id=by, pairs=[
        CollectivePair(start=by[ids[s]], done=by[ids[d]], collective=collective, bytes=b, group_size=2)
        for s, d, b in pairs])


def two_programs(z_us: float, y_inside: bool = True):
    """x (10) -> all-to-all (20 us); y (30, attention) under it or after it; z (z_us, other)."""
    mid = [("y", "compute", (), 30.0, "attention"), ("d", "done", ("s",), 0.0, "moe/dispatch")]
    spec = [("x", "compute", (), 10.0, "router"), ("s", "start", ("x",), 0.0, "moe/dispatch")]
    spec += mid if y_inside else mid[::-1]
    spec.append(("z", "compute", ("d", "y"), z_us, "other"))
    return program(spec, [("s", "d", 40000)])


def timed(sched, contention=1.0, label=""):
    return analyze(*simulate(sched, TOY, group_size=2, contention=contention), label=label)


@pytest.mark.parametrize("contention", [1.0, 0.8, 0.5])
def test_programs_differing_only_in_compute_have_no_hiding_part(contention):
    """z costs 10 us in one program, 25 in the other; the collective is hidden alike in both: all of
    the speedup is compute (hiding = 1 exactly), and the report says so."""
    a, b = timed(two_programs(10.0), contention, "a"), timed(two_programs(25.0), contention, "b")
    s = split_speedup(b, a)
    assert s.hiding == pytest.approx(1.0, abs=1e-12)
    assert s.compute == pytest.approx(s.total) and s.total == pytest.approx(b.step_time / a.step_time)
    assert s.total == pytest.approx((a.step_time + 15.0) / a.step_time)
    assert s.compute_dominates and s.scopes[0] == ("other", pytest.approx(25.0), pytest.approx(10.0))
    lines = split_lines(s, "a / b", ref="b", other="a")
    assert lines[0].startswith(f"SPLIT a / b {s.total:.3f}x = hiding communication 1.000x")
    assert "other 0.03 vs 0.01 ms" in lines[0]
    assert lines[1].startswith("NOTE a / b: most of this speedup") and "compute that differs" in lines[1]


def test_programs_differing_only_in_overlap_have_no_compute_part():
    """The same ops, y before or after the done: T = 60 exposed, 40 hidden (by hand); all of the
    speedup is hiding, bounded by the ceiling T / C of the slower one (here reached: 60 / 40)."""
    exposed, hidden = timed(two_programs(0.0, y_inside=False)), timed(two_programs(0.0))
    assert (exposed.step_time, hidden.step_time) == (pytest.approx(60.0), pytest.approx(40.0))
    s = split_speedup(exposed, hidden)
    assert s.compute == pytest.approx(1.0) and s.hiding == pytest.approx(1.5) and s.ceiling == pytest.approx(1.5)
    assert not s.compute_dominates and len(split_lines(s, "x")) == 1
    # with contention the hidden program pays for its overlap: hiding < ceiling, compute still 1
    slowed = timed(two_programs(0.0), 0.5)
    s = split_speedup(exposed, slowed)
    assert slowed.step_time == pytest.approx(50.0) and s.hiding == pytest.approx(60 / 50) and s.compute == 1.0
    assert math.isclose(s.total, s.hiding * s.compute)


def test_split_rows_of_the_side_by_side_table():
    a, b = timed(two_programs(10.0), label="a"), timed(two_programs(25.0), label="b")
    text = format_side_by_side([b, a])
    hide = next(l for l in text.splitlines() if "of which hiding communication" in l)
    comp = next(l for l in text.splitlines() if "of which compute difference" in l)
    assert hide.split()[-1] == "1.000x" and comp.split()[-1] == f"{b.step_time / a.step_time:.3f}x"


def test_other_collectives_report_transfer_time_not_windows():
    """An all-reduce of 512 B started early and waited for late: its window holds 30 us of compute,
    its transfer takes 2 x 512 x 1/2 / 1 GB/s = 0.512 us."""
    spec = [("x", "compute", (), 10.0, "attention"), ("s", "start", ("x",), 0.0, "grad"),
            ("y", "compute", (), 30.0, "attention"), ("d", "done", ("s",), 0.0, "grad"),
            ("z", "compute", ("d", "y"), 10.0, "other")]
    sched, durs = simulate(program(spec, [("s", "d", 512)], collective="all-reduce"), TOY, group_size=2)
    rep = analyze(sched, durs)
    assert rep.other_collective_time == pytest.approx(0.512)
    assert analyze(sched).other_collective_time == pytest.approx(30.0)  # without durations: the window
    assert "other collectives: transfer (us)" in format_side_by_side([rep])

"""Contention in the two-stream cost model (cost_model.simulate): compute under a collective in flight
runs at a fraction of its speed, against times computed by hand; the CLI's --contention checks."""

import pytest

from farskip_jax.analysis.cost_model import HARDWARE, Hardware, simulate, stretched_end, with_contention
from farskip_jax.analysis.hlo import CollectivePair, HloOp, Schedule
from farskip_jax.analysis.report import ALL_TO_ALLS, analyze
from farskip_jax.errors import ConfigError

# every op moves its bytes at 1 GB/s (1000 B = 1 us), no launch cost; an all-to-all over 2 devices
# moves half its payload at 1 GB/s, no latency (40 KB -> 20 us)
TOY = Hardware("toy", peak_flops=1e15, hbm_bw=1e9, a2a_bw=1e9, coll_bw=1e9, coll_latency_us=0.0, launch_us=0.0,
               matmul_eff=1.0, mem_eff=1.0)


def toy_schedule(y_us: float, a2a_us: float, y_inside: bool = True, z_us: float = 10.0) -> Schedule:
    """x (10 us) -> all-to-all start; y (y_us, independent of the all-to-all) inside the window (or
    after the done); done -> z (z_us)."""
    spec = [("x", "compute", (), 10.0), ("s", "start", ("x",), 0.0)]
    spec += [("y", "compute", (), y_us), ("d", "done", ("s",), 0.0)] if y_inside else \
            [("d", "done", ("s",), 0.0), ("y", "compute", (), y_us)]
    spec.append(("z", "compute", ("d", "y"), z_us))
    ids = {n: i + 1 for i, (n, *_) in enumerate(spec)}
    ops = [HloOp(id=ids[n], name=n, opcode="fusion" if k == "compute" else f"all-to-all-{k}",
                 op_name=f"jit(f)/layer_0/{'moe/dispatch' if k != 'compute' else 'attention/attention_qkv'}/op",
                 operands=tuple(ids[o] for o in opnds), kind=k, collective=None if k == "compute" else "all-to-all",
                 in_bytes=int(500 * us), out_bytes=int(500 * us), index=i)
           for i, (n, k, opnds, us) in enumerate(spec)]
    by = {o.id: o for o in ops}
    pair = CollectivePair(start=by[ids["s"]], done=by[ids["d"]], collective="all-to-all", bytes=int(2000 * a2a_us),
                          group_size=2)
    return Schedule(ops=ops, by_id=by, pairs=[pair])


def times(sched):
    return {o.name: (o.start, o.end) for o in sched.ops}


def test_stretched_end_by_hand():
    busy = [(0.0, 10.0), (20.0, 30.0)]
    # from 5: [5, 10] at half speed = 2.5 us of work, [10, 20] 10 us, [20, 30] 5 us, then 2.5 us: ends 32.5
    assert stretched_end(5.0, 20.0, busy, 0.5) == pytest.approx(32.5)
    assert stretched_end(5.0, 2.0, busy, 0.5) == pytest.approx(9.0)
    assert stretched_end(12.0, 5.0, busy, 0.5) == pytest.approx(17.0)  # in the gap: full speed
    assert stretched_end(5.0, 20.0, busy, 1.0) == pytest.approx(25.0)


def test_compute_under_a_collective_is_stretched_by_hand():
    """y (30 us) under a 20 us all-to-all: at contention c, y does 20c us of work while it is in
    flight and the rest at full speed: ends at 10 + 20 + (30 - 20c); z follows."""
    for c, y_end in ((1.0, 40.0), (0.8, 44.0), (0.5, 50.0)):
        sched, durs = simulate(toy_schedule(30.0, 20.0), TOY, group_size=2, contention=c)
        t = times(sched)
        assert durs == [pytest.approx(20.0)]  # the collective's own time is unchanged
        assert t["x"] == (0.0, pytest.approx(10.0))
        assert t["y"] == (pytest.approx(10.0), pytest.approx(y_end))
        assert t["z"] == (pytest.approx(y_end), pytest.approx(y_end + 10.0))
        y = next(o for o in sched.ops if o.name == "y")
        assert y.stretch == pytest.approx(y_end - 40.0) and y.work == pytest.approx(30.0)
        rep = analyze(sched, durs)
        assert rep.compute_time == pytest.approx(50.0)  # at full speed
        assert rep.contention_time == pytest.approx(y_end - 40.0)
        assert rep.step_time == pytest.approx(y_end + 10.0)


def test_only_the_overlapped_part_is_stretched():
    """A 50 us all-to-all over a 30 us op at c = 0.5: the op does 25 us of work by 60 (the end of the
    transfer) and its last 5 us at full speed (65); the done no longer waits; without contention
    the op ends at 40 and the done waits until 60."""
    sched, _ = simulate(toy_schedule(30.0, 50.0), TOY, group_size=2, contention=0.5)
    t = times(sched)
    assert t["y"][1] == pytest.approx(65.0) and t["d"] == (pytest.approx(65.0), pytest.approx(65.0))
    assert sched.makespan == pytest.approx(75.0)
    sched, _ = simulate(toy_schedule(30.0, 50.0), TOY, group_size=2, contention=1.0)
    t = times(sched)
    assert t["y"][1] == pytest.approx(40.0) and t["d"] == (pytest.approx(40.0), pytest.approx(60.0))
    assert sched.makespan == pytest.approx(70.0)


def test_no_overlap_means_no_contention():
    # y after the done, or the all-to-all synchronous: nothing runs under it, nothing is stretched
    for sched in (simulate(toy_schedule(30.0, 20.0, y_inside=False), TOY, group_size=2, contention=0.5)[0],
                  simulate(toy_schedule(30.0, 20.0), TOY, group_size=2, contention=0.5, serialize=ALL_TO_ALLS)[0]):
        assert sched.makespan == pytest.approx(10 + 20 + 30 + 10)
        assert all(o.stretch == pytest.approx(0.0) for o in sched.ops)


def test_default_is_the_hardware_field():
    assert all(0.0 < hw.contention <= 1.0 for hw in HARDWARE.values())
    hw = with_contention(TOY, 0.5)  # compute and communication alike: the 20 us all-to-all takes 40 us under y,
    # y (30 us) does 20 us of work by then (50) and its last 10 at full speed (60); z: 70
    assert (hw.contention, hw.contention_comm) == (0.5, 0.5)
    assert simulate(toy_schedule(30.0, 20.0), hw, group_size=2)[0].makespan == pytest.approx(70.0)
    assert simulate(toy_schedule(30.0, 20.0), hw, group_size=2, contention_comm=1.0)[0].makespan == pytest.approx(60.0)
    assert simulate(toy_schedule(30.0, 20.0), TOY, group_size=2)[0].makespan == pytest.approx(50.0)  # TOY: 1.0
    assert with_contention(TOY, None) is TOY
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ConfigError, match="contention"):
            with_contention(TOY, bad)


@pytest.mark.parametrize("argv, culprit", [
    (["--contention", "1.5"], "contention"),
    (["--contention-sweep", "1,0.8,x"], "contention-sweep"),
    (["--contention-sweep", "1,0"], "contention-sweep"),
    (["--hardware", "none", "--contention", "0.8"], "--hardware"),
])
def test_overlap_cli_refuses_bad_contention(argv, culprit, capsys):
    from farskip_jax.analysis.overlap import main

    assert main(["--programs", "forward"] + argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and culprit in err[0]


def test_cost_model_line_states_the_default():
    from farskip_jax.analysis.overlap import ProgramResult, cost_model_line

    r = ProgramResult("standard", "train", None, None, None, 0.0, hardware="mi300x",
                      contention=HARDWARE["mi300x"].contention)
    line = cost_model_line(r)
    assert f"{HARDWARE['mi300x'].contention:.2f} of its speed" in line and "the default for mi300x" in line
    r.contention = 1.0
    assert "overridden by --contention; default" in cost_model_line(r)

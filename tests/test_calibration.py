"""The calibrated cost model: its new terms against times computed by hand, the constants' fit against
a known curve and against the committed fitted.json, and the hold-out table re-tabled and re-timed
from the committed schedules and results (docs/calibration.md)."""

import json
import os

import pytest

from farskip_jax.analysis.cost_model import (Hardware, collective_time_us, simulate, size_efficiency,
                                             unfused_attention_us)
from tests.test_contention import TOY, toy_schedule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results", "calibration")


def test_communication_slowed_by_compute_by_hand():
    """x 10 us; a 20 us all-to-all under y (30 us); z 10 us. Compute unslowed, communication at 0.5
    while y runs: by 40 the transfer has done 15 us, its last 5 at full speed: done at 45, z 45-55."""
    sched, durs = simulate(toy_schedule(30.0, 20.0), TOY, group_size=2, contention=1.0, contention_comm=0.5)
    t = {o.name: (o.start, o.end) for o in sched.ops}
    assert durs == [pytest.approx(20.0)]
    assert t["y"] == (pytest.approx(10.0), pytest.approx(40.0))
    assert t["d"] == (pytest.approx(40.0), pytest.approx(45.0))
    assert sched.makespan == pytest.approx(55.0)
    # synchronous: nothing runs under it, nothing is slowed: 10 + 20 + 30 + 10
    ser, _ = simulate(toy_schedule(30.0, 20.0), TOY, group_size=2, contention=0.5, contention_comm=0.5,
                      serialize=("all-to-all",))
    assert ser.makespan == pytest.approx(70.0)


@pytest.mark.parametrize("y_inside, c", [(True, 0.7), (False, 0.7), (True, 1.0)])
def test_coupled_path_converges_to_the_fixed_path(y_inside, c):
    """The event-by-event path with communication (almost) unslowed equals the fixed-duration path."""
    sched = toy_schedule(30.0, 50.0, y_inside=y_inside)
    fixed, _ = simulate(sched, TOY, group_size=2, contention=c)
    coupled, _ = simulate(sched, TOY, group_size=2, contention=c, contention_comm=1.0 - 1e-9)
    for a, b in zip(fixed.ops, coupled.ops):
        assert (a.start, a.end) == (pytest.approx(b.start, abs=1e-6), pytest.approx(b.end, abs=1e-6))


def test_unfused_attention_by_hand():
    hw = Hardware("toy", peak_flops=1e12, hbm_bw=1e9, a2a_bw=1e9, coll_bw=1e9, launch_us=1.0, matmul_eff=0.5,
                  mem_eff=1.0)
    # forward: 640 FLOPs per score (MLA 192 + 128), 6.4e6 FLOPs = 1e4 scores: GEMMs 6.4e6 / 0.5e12 = 12.8 us;
    # 4 passes x 1e4 x 2 B + 1000 B of q/k/v/O = 81000 B at 1 GB/s = 81 us; 3 kernels
    assert unfused_attention_us(6.4e6, 1000.0, "fwd", hw, 640.0) == pytest.approx(3.0 + 12.8 + 81.0)
    # backward: 4 GEMMs (2x the FLOPs for the same 1e4 scores), 7 passes
    assert unfused_attention_us(12.8e6, 1000.0, "bwd", hw, 640.0) == pytest.approx(5.0 + 25.6 + 141.0)


def test_size_curve_by_hand():
    assert size_efficiency(4.0, 4.0, 1.0) == pytest.approx(0.5)
    assert size_efficiency(16.0, 4.0, 0.5) == pytest.approx(2.0 / 3.0)
    assert size_efficiency(1e9, 0.0, 0.5) == 1.0
    hw = Hardware("toy", peak_flops=1e12, hbm_bw=1e9, a2a_bw=1e9, coll_bw=2e9, coll_latency_us=5.0,
                  coll_size_half=8000.0, coll_size_q=1.0)
    # 8000 B over 2 devices: half the bandwidth; all-to-all 4000 B / 0.5 GB/s, all-reduce 2 x 4000 B / 1 GB/s
    assert collective_time_us("all-to-all", 8000.0, 2, hw) == pytest.approx(5.0 + 8.0)
    assert collective_time_us("all-reduce", 8000.0, 2, hw) == pytest.approx(5.0 + 8.0)


def test_allreduce_fit_recovers_a_known_curve():
    from farskip_jax.analysis.calibration_fit import MIB, allreduce_time_us, fit_allreduce

    sizes = [m * MIB for m in (1, 4, 16, 64, 256)]
    times = [float(allreduce_time_us(s, 8, 12.0, 300e9, 3 * MIB, 0.6)) for s in sizes]
    f = fit_allreduce(sizes, times, 8, 400e9)
    assert f["lat_us"] == pytest.approx(12.0, rel=1e-3) and f["bw"] == pytest.approx(300e9, rel=1e-3)
    assert f["s_half"] == pytest.approx(3 * MIB, rel=1e-2) and f["q"] == pytest.approx(0.6, rel=1e-2)
    assert max(abs(r) for r in f["residuals"]) < 1e-6


def test_committed_constants_are_the_fit_of_the_committed_measurements():
    from farskip_jax.analysis.calibration_fit import fit_constants, fitted_json, load_components, load_fitted

    fresh = json.loads(json.dumps(fitted_json(fit_constants(load_components()))))
    committed = load_fitted()
    for hw, consts in fresh.items():
        for k, v in consts.items():
            for end in ("value", "low", "high"):
                assert committed[hw][k][end] == pytest.approx(v[end], rel=1e-6), (hw, k, end)


def test_schedule_file_round_trip(tmp_path):
    from farskip_jax.analysis.schedule_store import load_schedule_file, save_schedule

    sched = toy_schedule(30.0, 20.0)
    sched.pairs[0].groups = ((0, 1),)
    path = str(tmp_path / "s.json.gz")
    save_schedule(sched, path, {"node_of": [0, 0]})
    back, meta = load_schedule_file(path)
    assert meta == {"node_of": [0, 0]}
    assert [(o.id, o.name, o.kind, o.operands, o.in_bytes, o.op_name) for o in back.ops] == \
        [(o.id, o.name, o.kind, o.operands, o.in_bytes, o.op_name) for o in sched.ops]
    assert back.pairs[0].groups == ((0, 1),) and back.pairs[0].start is back.by_id[sched.pairs[0].start.id]
    assert simulate(back, TOY, group_size=2)[0].makespan == pytest.approx(simulate(sched, TOY, group_size=2)[0].makespan)


def test_holdout_table_retables_from_the_committed_results(tmp_path):
    """The committed table.md is what the committed results.json gives (no compile, no re-timing)."""
    import shutil

    from farskip_jax.analysis.calibration import write_table

    shutil.copy(os.path.join(RESULTS, "results.json"), tmp_path / "results.json")
    text = write_table(str(tmp_path))
    with open(os.path.join(RESULTS, "table.md")) as f:
        assert f.read().strip() == text.strip()


def test_a_committed_schedule_retimes_to_the_committed_figures():
    """Re-timing one cached compile (DeepSeek-V3-6L, EP 8, standard) under the central constants gives
    the figures results.json holds."""
    from farskip_jax.analysis.calibration import retime, score_flops
    from farskip_jax.analysis.calibration_programs import PROGRAMS
    from farskip_jax.analysis.schedule_store import load_schedule_file

    spec = PROGRAMS["dsv3_6l_ep8_b1"]
    sched, meta = load_schedule_file(os.path.join(RESULTS, "schedules", spec.key("standard", 6) + ".json.gz"))
    got = retime(sched, meta["node_of"], spec.hardware, {}, {}, score_flops(spec))
    with open(os.path.join(RESULTS, "results.json")) as f:
        want = json.load(f)["programs"][spec.name]["central"]["standard"]
    for part, fig in want.items():
        for k, v in fig.items():
            assert got[part][k] == pytest.approx(v, rel=1e-9), (part, k)

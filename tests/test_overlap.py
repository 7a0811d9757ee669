"""Overlap analysis: schedule parsing, hidden-time accounting, structural bound, cost model (pure
unit tests on hand-built schedules), and deviceless GPU compiles of a 2-layer model (skipped when the
compile-only CUDA plugin is not installed)."""

import importlib.util
import os

import numpy as np
import pytest

from farskip_jax.analysis.bound import independent_ops, max_hidden, structural_bound
from farskip_jax.analysis.cost_model import HARDWARE, Hardware, compute_time_us, simulate
from farskip_jax.analysis.hlo import CollectivePair, HloOp, Schedule, shape_bytes
from farskip_jax.analysis.report import analyze, format_side_by_side
from farskip_jax.analysis.scopes import direction_of, label_of, layer_of, scope_of
from farskip_jax.analysis.textproto import parse_textproto


def test_textproto_nested_repeated_and_strings():
    text = 'a: 1\nb {\n  c: "x\\"y"\n  c: "z"\n  d {\n    e: 2.5\n  }\n}\nb {\n  f: ENUM\n}\n# comment\ng: -3e2\n'
    t = parse_textproto(text)
    assert t["a"] == [1] and t["g"] == [-300.0]
    assert t["b"][0]["c"] == ['x"y', "z"] and t["b"][0]["d"][0]["e"] == [2.5]
    assert t["b"][1]["f"] == ["ENUM"]
    with pytest.raises(ValueError):
        parse_textproto("a {\n b: 1\n")


def test_shape_bytes_tuple_and_types():
    s = {"tuple_shapes": [{"element_type": ["BF16"], "dimensions": [4, 8]},
                          {"element_type": ["F32"], "dimensions": [3]}]}
    assert shape_bytes(s) == 4 * 8 * 2 + 3 * 4


def test_scope_parsing_fwd_bwd():
    fwd = "jit(step)/jvp(layer_3)/moe/dispatch/all_to_all"
    bwd = "jit(step)/transpose(jvp(layer_12))/attention/attention_qkv/dot_general"
    assert (layer_of(fwd), scope_of(fwd), direction_of(fwd)) == (3, "dispatch", "fwd")
    assert (layer_of(bwd), scope_of(bwd), direction_of(bwd)) == (12, "attention_qkv", "bwd")
    assert label_of("jit(f)/final_norm/mul") == "other"


def _sched(spec, pairs):
    """spec: (name, kind, operands(names), start, end, op_name); pairs: (start_name, done_name)."""
    ops, ids = [], {}
    for i, (name, kind, opnds, t0, t1, op_name) in enumerate(spec):
        ids[name] = i + 1
        ops.append(HloOp(id=i + 1, name=name, opcode="fusion" if kind == "compute" else f"async-{kind}",
                         op_name=op_name, operands=tuple(ids[o] for o in opnds), kind=kind,
                         collective="all-to-all" if kind in ("start", "done") else None,
                         in_bytes=1000, out_bytes=1000, flops=0.0, start=t0, end=t1, index=i))
    by = {o.id: o for o in ops}
    ps = [CollectivePair(start=by[ids[s]], done=by[ids[d]], collective="all-to-all", bytes=8000, group_size=8)
          for s, d in pairs]
    return Schedule(ops=ops, by_id=by, pairs=ps)


# x -> start -> done -> y ; attn independent of the collective, placed half inside the window.
SPEC = [
    ("x", "compute", (), 0.0, 10.0, "jit(f)/layer_0/moe/router/dot"),
    ("s", "start", ("x",), 10.0, 11.0, "jit(f)/layer_0/moe/dispatch/all_to_all"),
    ("attn", "compute", (), 11.0, 31.0, "jit(f)/layer_0/attention/attention_core/dot"),
    ("d", "done", ("s",), 41.0, 42.0, "jit(f)/layer_0/moe/dispatch/all_to_all"),
    ("y", "compute", ("d", "attn"), 42.0, 50.0, "jit(f)/layer_0/moe/expert_compute/dot"),
]


def test_analyze_hidden_exposed_and_inside():
    rep = analyze(_sched(SPEC, [("s", "d")]), durations=[30.0], label="t")
    (st,) = rep.stats
    assert st.window == pytest.approx(30.0) and st.hidden == pytest.approx(20.0) and st.exposed == pytest.approx(10.0)
    assert st.inside == {"L0/attention_core": pytest.approx(20.0)}
    assert (st.layer, st.role, st.direction) == (0, "dispatch", "fwd")
    assert st.independent == pytest.approx(20.0)  # attn only: x feeds the start, y needs the done
    tot = rep.totals("fwd")
    assert tot["bound"] == pytest.approx(20.0) and tot["of_bound"] == pytest.approx(1.0)
    assert rep.step_time == pytest.approx(50.0)
    assert "hidden fraction" in format_side_by_side([rep, rep])


def test_bound_max_flow_shares_compute_between_collectives():
    # two collectives, one independent op of 10 us each could use: the flow counts it once
    costs = np.array([10.0, 0.0])
    assert max_hidden(costs, [8.0, 8.0], [np.array([0]), np.array([0])]) == pytest.approx(10.0)
    # disjoint ops: each collective capped by its own duration
    costs = np.array([10.0, 3.0])
    assert max_hidden(costs, [8.0, 8.0], [np.array([0]), np.array([1])]) == pytest.approx(11.0)


def test_independent_ops_uses_ancestors_and_descendants():
    s = _sched(SPEC, [("s", "d")])
    (ix,) = independent_ops(s, s.pairs)
    assert [s.ops[i].name for i in ix] == ["attn"]
    assert structural_bound(s, s.pairs, [100.0], [[0]]) == [pytest.approx(20.0)]


def test_cost_model_two_streams():
    hw = Hardware("toy", peak_flops=1e12, hbm_bw=1e9, a2a_bw=8e9 * 7 / 8, coll_bw=1e9, coll_latency_us=1.0,
                  launch_us=0.0, matmul_eff=1.0, mem_eff=1.0)
    # every compute op moves 2000 bytes at 1e9 B/s = 2 us; the all-to-all 8000 * 7/8 / (7e9) s = 1 us + 1 us
    sched, durs = simulate(_sched(SPEC, [("s", "d")]), hw, group_size=8)
    assert durs == [pytest.approx(2.0)]
    t = {o.name: (o.start, o.end) for o in sched.ops}
    assert t["x"] == (0.0, pytest.approx(2.0)) and t["attn"] == (pytest.approx(2.0), pytest.approx(4.0))
    assert t["d"][0] == pytest.approx(4.0)  # the collective (2..4) finished with attn: no wait
    rep = analyze(sched, durs)
    assert rep.stats[0].hidden == pytest.approx(2.0) and rep.step_time == pytest.approx(6.0)
    assert compute_time_us(2e12, 0, HARDWARE["mi300x"]) > 1e6 * 2e12 / HARDWARE["mi300x"].peak_flops


# ---------------------------------------------------------------- deviceless GPU compiles (slow)

HAS_CUDA_PLUGIN = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
# CI installs the plugin (dev extra): there a missing plugin must fail, not skip
gpu = pytest.mark.skipif(not HAS_CUDA_PLUGIN and not os.environ.get("CI"),
                         reason="jax-cuda12-plugin/pjrt (compile-only) not installed")


def _tiny(dispatch="all_to_all", **over):
    from farskip_jax.config import load_config

    args = ["model.num_layers=2", "model.d_model=256", "model.num_heads=4", "model.num_kv_heads=4",
            "model.vocab_size=512", "runtime.compute_dtype=bfloat16", "model.max_seq_len=512",
            "moe.num_experts=8", "moe.top_k=2", "moe.expert_hidden=512", f"runtime.dispatch={dispatch}",
            "mesh.data=1", "mesh.expert=8", "train.seq_len=512", "train.batch_size=8"]
    if dispatch == "all_to_all":
        args.append("runtime.capacity_factor=1.0")
    return load_config(None, args + [f"{k}={v}" for k, v in over.items()])


@pytest.fixture(scope="module")
def forward_reports():
    from farskip_jax.analysis.overlap import run_overlap

    res = run_overlap(_tiny(), ("standard", "farskip"), ("forward",), flags=None, hardware="mi300x")
    return {r.preset: r for r in res}


def _dispatch(rep):
    """The big (token) dispatch all-to-all of each MoE layer, forward."""
    ds = [s for s in rep.stats if s.role == "dispatch" and s.direction == "fwd"]
    by_layer = {}
    for s in ds:
        if s.layer not in by_layer or s.bytes > by_layer[s.layer].bytes:
            by_layer[s.layer] = s
    return by_layer


@gpu
def test_farskip_dispatch_hides_under_attention_standard_cannot(forward_reports):
    std, fs = forward_reports["standard"].report, forward_reports["farskip"].report
    attn = lambda s: sum(v for k, v in s.inside.items() if "attention" in k)
    assert all(attn(s) == 0 for s in _dispatch(std).values())  # standard: attention feeds the MoE
    assert any(attn(s) > 0 for s in _dispatch(fs).values())
    # the standard layer's structure leaves the dispatch nothing but the shared experts
    assert fs.totals("fwd")["bound"] > std.totals("fwd")["bound"]


@gpu
def test_report_totals_consistent(forward_reports):
    for r in forward_reports.values():
        for rep in (r.report, r.modelled):
            for s in rep.stats:
                assert 0 <= s.hidden <= s.duration + 1e-9 and s.duration > 0
                assert s.layer in (0, 1) and s.role in ("dispatch", "combine")
            tot = rep.totals("all")
            assert tot["hidden"] <= tot["duration"] + 1e-6
            assert tot["hidden"] <= tot["bound"] + 1e-3  # the bound bounds the real schedule
            assert rep.step_time >= rep.compute_time - 1e-6


@gpu
def test_ragged_backend_compiles_for_gpu():
    from farskip_jax.analysis.overlap import run_overlap

    (r,) = run_overlap(_tiny("ragged", **{"farskip.preset": "farskip"}), ("farskip",), ("forward",))
    kinds = {p.collective for p in r.schedule.pairs}
    assert "ragged-all-to-all" in kinds
    assert any(s.collective == "ragged-all-to-all" for s in r.report.stats)


@gpu
def test_bf16_gpu_train_step_reduces_expert_gradients_in_bf16():
    """EP x data parallel, compute_dtype bf16: the expert weights are cast to bf16 outside the
    expert-parallel shard_map, so their gradients are all-reduced over `data` in bf16; the only f32
    all-reduce is the embedding table's (f32 gather -> f32 scatter-add gradient)."""
    import re

    from farskip_jax.analysis.overlap import run_overlap

    cfg = _tiny(**{"mesh.data": 2, "mesh.expert": 4, "train.seq_len": 256, "farskip.preset": "farskip"})
    (r,) = run_overlap(cfg, ("farskip",), ("train",))
    nbytes = {"bf16": 0, "f32": 0}
    for line in r.hlo_text.splitlines():
        if "all-reduce-start(" in line or " all-reduce(" in line:
            for dt, dims in re.findall(r"(bf16|f32)\[([\d,]*)\]", line.split("=", 1)[1].split("all-reduce")[0]):
                nbytes[dt] += int(np.prod([int(d) for d in dims.split(",") if d])) * (2 if dt == "bf16" else 4)
    expert_bf16 = 3 * (8 // 4) * 256 * 512 * 2 * cfg.model.num_layers  # this device's experts, bf16
    assert nbytes["bf16"] >= expert_bf16
    assert nbytes["f32"] <= 512 * 256 * 4 + 64 * 1024  # the embedding table + norm scales


def test_target_lines_verdicts():
    from farskip_jax.analysis.overlap import target_lines

    rep = analyze(_sched(SPEC, [("s", "d")]), durations=[30.0], label="farskip")
    lines = target_lines({"standard": rep, "farskip": rep})
    assert any(l.startswith("PASS farskip fwd") and "100.0% of the structural bound" in l for l in lines)
    assert any(l.startswith("FAIL modelled step speedup") for l in lines)  # 1.000x < 1.11x
    empty = analyze(_sched(SPEC, [("s", "d")]), durations=[30.0])
    empty.stats[0].hidden = 0.0  # the first dispatch may be empty
    assert any(l.startswith("PASS farskip: 0 all-to-alls") for l in target_lines({"farskip": empty}))


def test_timeline_picture(tmp_path):
    from farskip_jax.analysis.timeline import plot_layer_timelines

    s = _sched(SPEC, [("s", "d")])
    rep = analyze(s, durations=[30.0], label="farskip")
    path = tmp_path / "t.png"
    plot_layer_timelines([("standard", s, rep), ("farskip", s, rep)], layer=0, direction="fwd", path=str(path))
    assert path.stat().st_size > 1000
    with pytest.raises(ValueError):
        plot_layer_timelines([("x", s, rep)], layer=5)


# ---------------------------------------------------------------- ceiling, no-overlap baseline, bandwidth sweep

TOY_HW = Hardware("toy", peak_flops=1e12, hbm_bw=1e9, a2a_bw=8e9 * 7 / 8, coll_bw=1e9, coll_latency_us=1.0,
                  launch_us=0.0, matmul_eff=1.0, mem_eff=1.0)
# standard-like: attn feeds the collective, nothing can hide it
STD_SPEC = [
    ("x", "compute", (), 0.0, 10.0, "jit(f)/layer_0/moe/router/dot"),
    ("attn", "compute", ("x",), 10.0, 30.0, "jit(f)/layer_0/attention/attention_core/dot"),
    ("s", "start", ("attn",), 30.0, 31.0, "jit(f)/layer_0/moe/dispatch/all_to_all"),
    ("d", "done", ("s",), 41.0, 42.0, "jit(f)/layer_0/moe/dispatch/all_to_all"),
    ("y", "compute", ("d",), 42.0, 50.0, "jit(f)/layer_0/moe/expert_compute/dot"),
]


def test_cost_model_serialized_all_to_all_is_fully_exposed():
    from farskip_jax.analysis.report import ALL_TO_ALLS

    sched, durs = simulate(_sched(SPEC, [("s", "d")]), TOY_HW, group_size=8, serialize=ALL_TO_ALLS)
    rep = analyze(sched, durs)
    # x 0..2, the transfer 2..4 blocks the stream, attn 4..6, y 6..8
    assert rep.stats[0].hidden == 0.0 and rep.stats[0].exposed == pytest.approx(2.0)
    assert rep.step_time == pytest.approx(8.0)
    over, d2 = simulate(_sched(SPEC, [("s", "d")]), TOY_HW, group_size=8)
    assert analyze(over, d2).step_time == pytest.approx(6.0)
    # a done that has to wait records the wait as its [start, end]
    slow = Hardware(**{**TOY_HW.__dict__, "a2a_bw": TOY_HW.a2a_bw / 3})  # 1 + 3 us transfer
    sw, _ = simulate(_sched(SPEC, [("s", "d")]), slow, group_size=8)
    d = next(o for o in sw.ops if o.name == "d")
    assert (d.start, d.end) == (pytest.approx(4.0), pytest.approx(6.0))


def test_ceiling_and_no_overlap_lines():
    from farskip_jax.analysis.overlap import no_overlap_step, target_lines

    std = analyze(_sched(STD_SPEC, [("s", "d")]), durations=[30.0], label="standard")
    fs = analyze(_sched(SPEC, [("s", "d")]), durations=[30.0], label="farskip")
    assert std.totals("all")["exposed"] == pytest.approx(30.0)  # window 10 us, no compute inside
    assert std.ceiling_step() == pytest.approx(20.0) and std.ceiling_speedup() == pytest.approx(2.5)
    assert no_overlap_step(fs) == pytest.approx(50.0 + 20.0)  # XLA model: step + what it hid
    lines = target_lines({"standard": std, "farskip": fs})
    sp = next(l for l in lines if "speedup farskip/standard" in l)
    assert "1.000x" in sp and "ceiling" in sp and "2.500x" in sp
    assert any(l.startswith("INFO vs standard WITHOUT overlap") for l in lines)


def test_bandwidth_sweep_and_implied_bandwidth():
    from farskip_jax.analysis.sensitivity import bandwidth_sweep, format_sweep, implied_bandwidth, sweep_point

    std, fs = _sched(STD_SPEC, [("s", "d")]), _sched(SPEC, [("s", "d")])
    rows = bandwidth_sweep(std, fs, TOY_HW, [1e9, 7e9, 1e12])
    for r in rows:
        assert r.no_overlap_us >= r.standard_us - 1e-9 and r.speedup_vs_no_overlap >= r.speedup - 1e-9
        assert 0 < r.a2a_share < 1 and r.ceiling >= 1.0
    assert rows[-1].speedup_vs_no_overlap == pytest.approx(1.0, abs=0.2)  # fast fabric: nothing to gain
    assert "a2a share" in format_sweep(rows, {7.0: "mark"}) and "mark" in format_sweep(rows, {7.0: "mark"})
    # transfer T = 1 + 7000 / bw us; no overlap 6 + T; farskip 6 (T <= 2, hidden) or 4 + T (T > 2):
    # 1.2x at T = 6 (bw 1.4 GB/s, too slow to hide) and at T = 1.2 (bw 35 GB/s, too fast to matter)
    lo_bw, hi_bw = implied_bandwidth(std, fs, TOY_HW, 1.2, lo=1e8, hi=1e12)
    assert lo_bw == pytest.approx(1.4e9, rel=1e-3) and hi_bw == pytest.approx(35e9, rel=1e-3)
    assert sweep_point(std, fs, TOY_HW, lo_bw).speedup_vs_no_overlap == pytest.approx(1.2, rel=1e-3)
    assert implied_bandwidth(std, fs, TOY_HW, 100.0, lo=1e8, hi=1e12) == []  # never reached


# ---------------------------------------------------------------- headline model


def _program_result(preset, spec, hw=TOY_HW):
    from farskip_jax.analysis.overlap import ProgramResult

    xla = _sched(spec, [("s", "d")])
    sched_hw, durs = simulate(xla, hw, group_size=8)
    return ProgramResult(preset, "forward", analyze(xla, durations=[30.0], label=preset),
                         analyze(sched_hw, durs, label=f"{preset}@toy"), xla, 0.0,
                         modelled_schedule=sched_hw, hardware="toy")


def test_headline_is_the_two_stream_model_and_disagreement_is_flagged(tmp_path, monkeypatch):
    """XLA's deviceless model prices the hand-built ops at 38 us of compute, the two-stream toy model
    at 6 us: the report leads with the two-stream figures, draws its timeline, and warns (> 2x)."""
    from farskip_jax.analysis import overlap
    from farskip_jax.analysis.overlap import compute_disagreement, format_results, to_json, write_timelines

    res = [_program_result("standard", STD_SPEC), _program_result("farskip", SPEC)]
    std = res[0]
    rep, sched, name = std.headline
    assert rep is std.modelled and sched is std.modelled_schedule and name == "two-stream toy"
    assert compute_disagreement(std.report, std.modelled) == pytest.approx(38.0 / 6.0)
    text = format_results(res, ["forward"])
    head, xla = text.index("two-stream cost model (toy) [headline]"), text.index("XLA's deviceless cost model")
    assert head < xla  # the realistic model comes first
    warn = [l for l in text.splitlines() if l.startswith("WARNING forward")]
    assert len(warn) == 2 and "6.3x" in warn[0] and "expert_compute" in warn[0]
    assert to_json(res)["forward"]["standard"]["headline_model"] == "two-stream toy"
    drawn = []
    monkeypatch.setattr(overlap, "plot_layer_timelines", lambda items, *a, **k: drawn.extend(items))
    assert write_timelines(res, ["forward"], str(tmp_path)) == [str(tmp_path / "timeline_forward_fwd.png")]
    assert [s for _, s, _ in drawn] == [r.modelled_schedule for r in res]
    # the two models agree within 2x: no warning; without the two-stream model XLA's is the headline
    close = Hardware(**{**TOY_HW.__dict__, "hbm_bw": TOY_HW.hbm_bw / 6})  # 12 us per op: 36 us of compute
    agree = [_program_result("standard", STD_SPEC, close)]
    assert "WARNING" not in format_results(agree, ["forward"])
    agree[0].modelled = agree[0].modelled_schedule = None
    assert agree[0].headline[2] == "XLA" and "[headline]" not in format_results(agree, ["forward"])

"""The overlap report on scanned programs (runtime.scan_layers): analysis/loop_schedule.py unrolls the
layers' while loops as executed, analysis/overlap.py reads them (docs/scan.md "Overlap inside the
scan body").

- A hand-written LHS dump of a scanned program (a forward and a backward loop over 3 layers) and its
  unrolled twin (the same ops, layer after layer, in the entry) give the same report: every
  all-to-all with its layer, role and direction, hidden time, independent compute, structural bound
  and step time, under XLA's timestamps and the two-stream model. Without the as-executed reading
  (iterations not linked by their carry) the bound differs: the check can fail.
- A deviceless GPU compile of a tiny scanned train step: the report finds every all-to-all (layers x
  the per-layer count of the unrolled program), with the unrolled program's payloads.
"""

import json
from collections import Counter

import pytest

from farskip_jax.analysis.bound import independent_ops
from farskip_jax.analysis.cost_model import Hardware, simulate
from farskip_jax.analysis.hlo import load_schedule
from farskip_jax.analysis.loop_schedule import layer_loops, layer_names, load_unrolled_schedule
from farskip_jax.analysis.report import analyze
from test_overlap import gpu

F = {"element_type": "F32", "dimensions": [1024]}
S32 = {"element_type": "S32"}
CARRY = {"tuple_shapes": [S32, F, F]}
GROUP = {"replica_ids": list(range(8))}
# local durations (us) of one layer's ops in XLA's schedule: router, start, attention, done, experts, 2 adds
TIMES = {"router": 2.0, "start": 0.5, "attn": 10.0, "done": 1.0, "experts": 3.0, "full": 1.0, "no_routed": 1.0}


def _emit(msg: dict, ind: int = 0) -> list[str]:
    out = []
    for k, v in msg.items():
        for x in v if isinstance(v, list) else [v]:
            if isinstance(x, dict):
                out += [" " * ind + f"{k} {{", *_emit(x, ind + 2), " " * ind + "}"]
            else:
                out.append(" " * ind + f"{k}: {json.dumps(x) if isinstance(x, str) else x}")
    return out


class Dump:
    """Builds an LHS schedule dump: computations of instructions with (start, end) times."""

    def __init__(self):
        self.comps, self.times, self.next_id = [], {}, 1

    def ins(self, comp, name, opcode, operands=(), op_name="", shape=F, t=None, **extra):
        iid = self.next_id
        self.next_id += 1
        d = {"id": iid, "name": f"{name}.{iid}", "opcode": opcode, "shape": shape}
        if operands:
            d["operand_ids"] = list(operands)
        if op_name:
            d["metadata"] = {"op_name": op_name}
        d.update(extra)
        comp["instructions"].append(d)
        self.times.setdefault(comp["id"], []).append((iid, t))
        return iid

    def comp(self, name):
        c = {"id": 1000 + len(self.comps), "name": name, "instructions": []}
        self.comps.append(c)
        return c

    def layer(self, comp, h, nr, pre, clock):
        """One FarSkip-like layer: the dispatch of h hides attention of nr; returns (full, no_routed)."""
        def timed(key):
            t0 = clock[0]
            clock[0] += TIMES[key]
            return (t0, clock[0])

        r = self.ins(comp, "router", "fusion", [h], f"{pre}/moe/router/dot", t=timed("router"))
        s = self.ins(comp, "a2a_start", "all-to-all-start", [r], f"{pre}/moe/dispatch/all_to_all", t=timed("start"),
                     replica_groups=GROUP)
        a = self.ins(comp, "attn", "fusion", [nr], f"{pre}/attention/attention_core/dot", t=timed("attn"))
        d = self.ins(comp, "a2a_done", "all-to-all-done", [s], f"{pre}/moe/dispatch/all_to_all", t=timed("done"))
        e = self.ins(comp, "experts", "fusion", [d], f"{pre}/moe/expert_compute/dot", t=timed("experts"))
        full = self.ins(comp, "full", "fusion", [h, a, e], f"{pre}/add", t=timed("full"))
        no_routed = self.ins(comp, "no_routed", "fusion", [h, a], f"{pre}/add_1", t=timed("no_routed"))
        return full, no_routed

    def text(self, entry_id):
        mod = {"name": "jit_f", "entry_computation_id": entry_id, "computations": []}
        for c in self.comps:
            mod["computations"].append(dict(c, root_id=c["instructions"][-1]["id"]))
        timed = lambda ts: [{"id": iid, "start_timestamp_cycles": t[0], "end_timestamp_cycles": t[1]}  # noqa: E731
                            for iid, t in ts if t is not None]
        scheds = [{"computation_id": cid, "instructions": timed(ts)} for cid, ts in self.times.items()]
        return "\n".join(_emit({"hlo_module": mod, "computation_schedules": scheds})) + "\n"


N = 3  # layers


def scanned_dump() -> str:
    """Entry: embed, a forward while loop over the 3 layers, a backward one (op_names under
    transpose(...)), final op. Bodies carry (counter, full, no_routed)."""
    dm = Dump()
    loops = []
    for direction in ("fwd", "bwd"):
        body = dm.comp(f"body_{direction}")
        p = dm.ins(body, "param", "parameter", shape=CARRY, t=(0.0, 0.0), parameter_number=0)
        i = dm.ins(body, "gte", "get-tuple-element", [p], shape=S32, t=(0.0, 0.0), tuple_index=0)
        h = dm.ins(body, "gte", "get-tuple-element", [p], t=(0.0, 0.0), tuple_index=1)
        nr = dm.ins(body, "gte", "get-tuple-element", [p], t=(0.0, 0.0), tuple_index=2)
        pre = ("jit(f)/transpose(jvp(scan_L0_P1))" if direction == "bwd" else "jit(f)/jvp(scan_L0_P1)") \
            + "/while/body/layer_q0"
        clock = [0.0]
        full, no_routed = dm.layer(body, h, nr, pre, clock)
        inc = dm.ins(body, "inc", "add", [i], "jit(f)/while/body/add", shape=S32, t=(clock[0], clock[0]))
        dm.ins(body, "root", "tuple", [inc, full, no_routed], shape=CARRY, t=(clock[0], clock[0]))
        cond = dm.comp(f"cond_{direction}")
        cp = dm.ins(cond, "param", "parameter", shape=CARRY, parameter_number=0)
        dm.ins(cond, "lt", "compare", [cp], shape={"element_type": "PRED"})
        loops.append((body["id"], cond["id"]))
    entry = dm.comp("main")
    x = dm.ins(entry, "x", "parameter", t=(0.0, 0.0), parameter_number=0)
    e = dm.ins(entry, "embed", "fusion", [x], "jit(f)/embed", t=(0.0, 5.0))
    c0 = dm.ins(entry, "c0", "constant", shape=S32, t=(5.0, 5.0))
    h, nr = e, e
    trip = json.dumps({"known_trip_count": {"n": str(N)}})
    for body, cond in loops:
        init = dm.ins(entry, "init", "tuple", [c0, h, nr], shape=CARRY, t=(5.0, 5.0))
        w = dm.ins(entry, "while", "while", [init], shape=CARRY, t=(5.0, 5.0), called_computation_ids=[cond, body],
                   backend_config=trip)
        h = dm.ins(entry, "gte", "get-tuple-element", [w], t=(5.0, 5.0), tuple_index=1)
        nr = dm.ins(entry, "gte", "get-tuple-element", [w], t=(5.0, 5.0), tuple_index=2)
    dm.ins(entry, "final", "fusion", [h, nr], "jit(f)/final_norm", t=(5.0, 7.0))
    return dm.text(entry["id"])


def unrolled_dump() -> str:
    """The same program with its layers as a Python loop: every op in the entry, in the order and at
    the times the scanned program executes them."""
    dm = Dump()
    entry = dm.comp("main")
    x = dm.ins(entry, "x", "parameter", t=(0.0, 0.0), parameter_number=0)
    e = dm.ins(entry, "embed", "fusion", [x], "jit(f)/embed", t=(0.0, 5.0))
    c0 = dm.ins(entry, "c0", "constant", shape=S32, t=(5.0, 5.0))
    h, nr, i = e, e, c0
    clock = [5.0]
    for direction in ("fwd", "bwd"):
        i = c0
        for k in range(N):
            layer = N - 1 - k if direction == "bwd" else k
            pre = f"jit(f)/transpose(jvp(layer_{layer}))" if direction == "bwd" else f"jit(f)/jvp(layer_{layer})"
            h, nr = dm.layer(entry, h, nr, pre, clock)
            i = dm.ins(entry, "inc", "add", [i], "jit(f)/add", shape=S32, t=(clock[0], clock[0]))
    dm.ins(entry, "final", "fusion", [h, nr], "jit(f)/final_norm", t=(clock[0], clock[0] + 2.0))
    return dm.text(entry["id"])


TOY = Hardware("toy", peak_flops=1e12, hbm_bw=1e9, a2a_bw=1e9, coll_bw=1e9, coll_latency_us=1.0, launch_us=0.5,
               matmul_eff=1.0, mem_eff=1.0)


def _facts(rep):
    return [(s.layer, s.role, s.direction, round(s.window, 6), round(s.hidden, 6), round(s.independent, 6))
            for s in rep.stats]


def test_scanned_dump_reads_as_its_unrolled_twin():
    scanned = load_unrolled_schedule(scanned_dump(), as_executed=True)
    unrolled = load_schedule(unrolled_dump())
    assert [lp.direction for lp in layer_loops(scanned_dump())] == ["fwd", "bwd"]
    assert layer_loops(unrolled_dump()) == []
    order = [(s.layer, s.direction) for s in analyze(scanned).stats]
    assert order == [(0, "fwd"), (1, "fwd"), (2, "fwd"), (2, "bwd"), (1, "bwd"), (0, "bwd")]  # bwd runs in reverse
    for timed in (lambda s: (s, None), lambda s: simulate(s, TOY, 8)):  # XLA's timestamps, the two-stream model
        a, b = analyze(*timed(scanned)), analyze(*timed(unrolled))
        assert _facts(a) == _facts(b) and len(a.stats) == 2 * N
        assert a.step_time == pytest.approx(b.step_time) and a.compute_time == pytest.approx(b.compute_time)
        assert a.bound == pytest.approx(b.bound)
        assert all(s.hidden > 0 for s in a.stats)  # attention hides every dispatch
    # read without the carry links, copy k+1's router no longer waits for copy k's experts: a larger bound
    loose = load_unrolled_schedule(scanned_dump())
    indep = lambda s: [len(ix) for ix in independent_ops(s, s.pairs)]  # noqa: E731
    assert indep(loose) != indep(scanned) and indep(scanned) == indep(unrolled)


def test_layer_names_forward_and_reverse():
    name = "jit(step)/transpose(jvp(stack_1))/scan_L1_P2/while/body/closed_call/layer_q1/moe/dispatch/all_to_all"
    assert "/layer_4/moe" in layer_names(name, 1)  # 1 + 1 * 2 + 1
    assert "/layer_6/moe" in layer_names(name, 0, trips=3, reverse=True)  # row 2: 1 + 2 * 2 + 1
    assert layer_names("jit(f)/layer_3/attention", 5) == "jit(f)/layer_3/attention"


# ---------------------------------------------------------------- a deviceless GPU compile (tiny model)


def _tiny(scan: bool):
    from farskip_jax.config import load_config

    return load_config(None, [
        "model.num_layers=4", "model.first_k_dense=1", "model.d_model=256", "model.num_heads=4",
        "model.num_kv_heads=4", "model.vocab_size=512", "runtime.compute_dtype=bfloat16", "model.max_seq_len=256",
        "model.mlp_hidden=512", "moe.num_experts=8", "moe.top_k=2", "moe.expert_hidden=256",
        "runtime.dispatch=all_to_all", "runtime.capacity_factor=1.0", "mesh.data=1", "mesh.expert=8", "train.seq_len=256",
        "train.batch_size=8", "farskip.preset=farskip", f"runtime.scan_layers={str(scan).lower()}"])


@gpu
def test_scanned_train_report_finds_every_all_to_all():
    """Layer 0 dense (a stack of one), layers 1-3 one scan: the report of the scanned train step sees
    3 x the per-layer all-to-alls of the unrolled program, forward and backward, with its payloads."""
    from farskip_jax.analysis.overlap import format_results, run_overlap, to_json

    (scan,) = run_overlap(_tiny(True), ("farskip",), ("train",), hardware="mi300x", probe_latency=False)
    (loop,) = run_overlap(_tiny(False), ("farskip",), ("train",), hardware="mi300x", probe_latency=False)
    assert (scan.layout, loop.layout) == ("scanned", "unrolled")
    assert sorted((lp.direction, lp.first, lp.trips) for lp in scan.layer_loops) == [("bwd", 1, 3), ("fwd", 1, 3)]
    key = lambda s: (s.layer, s.direction, s.role)  # noqa: E731
    for rep in (scan.report, scan.modelled):
        per = Counter(key(s) for s in rep.stats)
        assert {k[0] for k in per} == {1, 2, 3}
        per_layer = [Counter({k[1:]: v for k, v in per.items() if k[0] == layer}) for layer in (1, 2, 3)]
        assert per_layer[0] == per_layer[1] == per_layer[2] and {d for d, _ in per_layer[0]} == {"fwd", "bwd"}
        assert len(rep.stats) == 3 * sum(per_layer[0].values())
        assert per == Counter(key(s) for s in loop.report.stats)  # the unrolled program's all-to-alls
    dur = lambda r: sorted((key(s), round(s.duration, 6)) for s in r.modelled.stats)  # noqa: E731
    assert dur(scan) == dur(loop)  # same payloads, same two-stream transfer times
    assert scan.modelled.totals("fwd")["hidden"] > 0 and scan.modelled.step_time > 0
    assert "program analysed: scanned" in format_results([scan], ["train"])
    assert to_json([scan])["train"]["farskip"]["program_layout"] == "scanned"

"""The overlap report of the serving programs (analysis/inference_report.py, issue 24 part 4).

1. On a tiny tp_ep model's prefill and decode programs compiled for 8 compile-only H100s, the
   two-stream model hides a larger share of the layer all-reduces under FarSkip than under
   standard, and FarSkip's modelled time is shorter; one attention and one routed all-reduce per
   layer, each of batch x tokens x d_model x dtype bytes.
2. The all-reduce cost of the topology model equals the hand-computed ring / hierarchical formula
   for a tiny case, inside one node and over two nodes.
"""

import numpy as np
import pytest

from farskip_jax.analysis import inference_report as ir
from farskip_jax.analysis.cost_model import HARDWARE, collective_time_us
from farskip_jax.analysis.topology import GBIT, LINKS, Topology
from farskip_jax.config import replace
from test_inference_layout import tiny_cfg

LAYERS = 2


def _pair(devices, program, batch, tokens, max_len):
    out = {}
    for preset in ("standard", "farskip"):
        cfg = replace(tiny_cfg(num_layers=LAYERS, first_k_dense=0), **{"farskip.preset": preset})
        mesh = ir.serving_mesh(cfg, devices)
        prog = ir.compile_serving(cfg, mesh, program, batch, tokens, max_len)
        out[preset] = (cfg, prog.schedule, ir.time_serving(prog.schedule, ir.node_of(mesh), "h100_sxm", program))
    return out


@pytest.mark.parametrize("program,batch,tokens,max_len", [("prefill", 4, 16, 16), ("decode", 8, 1, 32)])
def test_farskip_hides_more_allreduce_time_than_standard(h100x8, program, batch, tokens, max_len):
    res = _pair(h100x8, program, batch, tokens, max_len)
    for preset, (cfg, sched, t) in res.items():
        ars = [p for p in sched.pairs if p.collective == "all-reduce"]
        roles = [ir.role_of(p.start.op_name) for p in ars]
        assert roles.count("attention") == LAYERS and roles.count("routed") == LAYERS, (preset, roles)
        want = ir.expected_ar_bytes(cfg, batch, tokens)
        assert {p.bytes for p, r in zip(ars, roles) if r in ir.LAYER_ROLES} == {want}
        assert t.layer_ar_us > 0 and t.ceiling_us <= t.time_us <= t.serial_us + 1e-6
    std, fs = res["standard"][2], res["farskip"][2]
    assert fs.layer_hidden_frac > std.layer_hidden_frac + 0.2, (std.layer_hidden_frac, fs.layer_hidden_frac)
    assert fs.hidden_frac > std.hidden_frac
    assert fs.time_us < std.time_us
    assert abs(fs.compute_us - std.compute_us) < 0.05 * std.compute_us  # same work, another order


def test_allreduce_cost_matches_hand_computed():
    from farskip_jax.analysis.cost_model import size_efficiency

    payload = 4 * 16 * 32 * 2  # batch 4 x 16 tokens x d_model 32, bf16
    lk = LINKS["h200"]
    # the fitted intra-node all-reduce bus bandwidth x the size curve at this payload; fitted latency
    intra = lk.intra_allreduce_bw * size_efficiency(payload, lk.size_half, lk.size_q)
    # one node, 8 GPUs: ring all-reduce 2 (n-1)/n P / bw + latency
    one = Topology.of(lk, 8)
    want = lk.intra_latency_us + 1e6 * 2 * 7 / 8 * payload / intra
    assert one.all_reduce_us(payload, [tuple(range(8))]) == pytest.approx(want)
    assert one.collective_time_us("all-reduce", payload, [tuple(range(8))]) == pytest.approx(want)
    assert collective_time_us("all-reduce", payload, 8, HARDWARE["h200"]) == pytest.approx(want)
    # two nodes of 8: reduce-scatter + all-gather inside the node, the 1/8 shard all-reduced over the NICs
    two = Topology.of(lk, 16, gpus_per_node=8)
    inter = lk.inter_eff * 400 * GBIT  # one 400 Gb/s NIC per GPU x efficiency
    want2 = 20.0 + 1e6 * (2 * 7 / 8 * payload / intra + 2 * 1 / 2 * (payload / 8) / inter)
    assert two.all_reduce_us(payload, [tuple(range(16))]) == pytest.approx(want2)
    # the TP groups of a 2 x 8 mesh stay inside their node: the one-node figure
    assert two.all_reduce_us(payload, [tuple(range(8)), tuple(range(8, 16))]) == pytest.approx(want)
    assert ir.topology_for([i // 8 for i in range(16)], "h200").all_reduce_us(payload) == pytest.approx(want2)


def test_extrapolate_is_linear_in_depth():
    def t(x):
        role = {r: {"count": x, "us": 2.0 * x, "hidden_us": x, "bytes": 10.0 * x} for r in ir.ROLES}
        return ir.ServingTiming(time_us=100 + 10 * x, serial_us=100 + 12 * x, compute_us=90 + 8 * x, ar_us=4 * x,
                                ar_hidden_us=3 * x, layer_ar_us=2 * x, layer_ar_hidden_us=2 * x, ar_count=2 * x,
                                ar_bytes=20.0 * x, by_role=role)

    got = ir.extrapolate(t(2), 2, t(4), 4, 60)
    assert got == t(60)
    assert got.ceiling_us == pytest.approx(100 + 10 * 60 - 60)


def test_useful_rows_and_serving_shape():
    from farskip_jax.config import MeshConfig

    cfg = tiny_cfg(MeshConfig(data=1, tensor=8))  # 8 experts top-2 on EP 8: 1 local expert, T*1 rows, T*2/8 real
    mesh = type("M", (), {"shape": {"expert": 1, "tensor": 8}})()
    assert ir.useful_fraction(cfg, mesh) == pytest.approx(2 / 8)
    assert ir.serving_shape(cfg, 8) == (1, 8)
    assert ir.serving_shape(replace(cfg, **{"model.num_heads": 40, "model.num_kv_heads": 8, "model.head_dim": 4}), 16, 8) == (2, 8)
    from farskip_jax.kernels.gmm import gmm

    with ir.balanced_grouped_gemm(0.25):  # 16 rows over 2 groups -> 2 + 2 useful rows, the rest zeros
        y = gmm(np.ones((16, 4), np.float32), np.ones((2, 4, 3), np.float32), np.array([8, 8], np.int32),
                backend="ragged_dot")  # the seam's ragged_dot: what runtime.gmm resolves to on GPU
    assert y.shape == (16, 3) and float(y[:4].sum()) == 4 * 3 * 4 and float(y[4:].sum()) == 0


def test_scanned_serving_program_unrolls_to_its_layers(h100x8):
    """A scanned prefill (runtime.scan_layers: the 3 MoE layers are one while loop, serving/generate.py)
    re-timed from its loop-unrolled schedule (analysis/loop_schedule.py) has the per-layer program's
    all-reduces (roles, layers, bytes), the stacked-row copies tagged, and with them free a time near
    the per-layer program's; FarSkip still hides more inside the loop body than standard. Without the
    unrolling the entry computation shows the embedding's all-reduce only (the check can fail).
    Replicated shared experts: with tensor-parallel ones FarSkip's a + s all-reduce also waits for the
    shared experts, and on these tiny shapes it hides less (0.62 vs standard's 0.50, 2026-12-06)."""
    from farskip_jax.analysis.scopes import layer_of

    def timing(preset, scan):
        cfg = replace(tiny_cfg(num_layers=3, first_k_dense=0), **{"farskip.preset": preset, "runtime.scan_layers": scan,
                                                                   "inference.shared_experts": "replicated"})
        mesh = ir.serving_mesh(cfg, h100x8)
        prog = ir.compile_serving(cfg, mesh, "prefill", 4, 16, 16)
        return cfg, prog, ir.time_serving(prog.schedule, ir.node_of(mesh), "h100_sxm", "prefill")

    cfg, scan, t_scan = timing("farskip", True)
    _, loop, t_loop = timing("farskip", False)
    _, _, t_std = timing("standard", True)
    assert " while(" in scan.hlo_text and " while(" not in loop.hlo_text
    entry = scan.hlo_text[scan.hlo_text.index("\nENTRY"):].split("\n}\n")[0]
    assert entry.count("all-reduce-start(") < 6  # the layers' all-reduces sit in the while body
    for prog in (scan, loop):
        ars = [p for p in prog.schedule.pairs if p.collective == "all-reduce" and ir.role_of(p.start.op_name) != "other"]
        got = sorted((layer_of(p.start.op_name), ir.role_of(p.start.op_name), p.bytes) for p in ars)
        want = sorted((k, r, ir.expected_ar_bytes(cfg, 4, 16)) for k in range(3) for r in ("attention", "routed"))
        assert got == want, got
    assert t_scan.ar_count == t_loop.ar_count
    assert t_scan.row_copy_us > 0 and t_loop.row_copy_us == 0 and t_loop.inplace_us == 0
    assert t_scan.time_inplace_us < t_scan.time_us
    assert abs(t_scan.time_inplace_us - t_loop.time_us) < 0.25 * t_loop.time_us, (t_scan.time_inplace_us, t_loop.time_us)
    assert t_scan.layer_hidden_frac > t_std.layer_hidden_frac + 0.2, (t_std.layer_hidden_frac, t_scan.layer_hidden_frac)

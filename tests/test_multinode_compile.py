"""Multi-node deviceless compiles (jax 0.10.2 `get_topology_desc(topology="1x2x4")`: 8 compile-only
GPUs on 2 hosts) of a small MoE model, re-timed with the multi-node topology cost model: which
all-to-alls cross nodes, what they cost, and that Federation of Experts with one group per node keeps
them inside a node. Skipped without the compile-only CUDA plugin (failing on CI, which installs it)."""

import importlib.util
import os

import pytest

HAS_CUDA_PLUGIN = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
pytestmark = pytest.mark.skipif(not HAS_CUDA_PLUGIN and not os.environ.get("CI"),
                                reason="jax-cuda12-plugin/pjrt (compile-only) not installed")


def _small(**over):
    from farskip_jax.config import load_config

    args = ["model.num_layers=2", "model.d_model=256", "model.num_heads=4", "model.num_kv_heads=4",
            "model.vocab_size=512", "runtime.compute_dtype=bfloat16", "model.max_seq_len=256",
            "moe.num_experts=8", "moe.top_k=2", "moe.expert_hidden=256", "runtime.dispatch=all_to_all",
            "runtime.capacity_factor=1.0", "mesh.data=1", "mesh.expert=8"]
    return load_config(None, args + [f"{k}={v}" for k, v in over.items()])


def _run(cfg, presets, program, **kw):
    from farskip_jax.analysis.overlap import run_overlap

    return run_overlap(cfg, presets, (program,), batch=8, seq=256, num_devices=8, gpus_per_node=4,
                       hardware="mi325x", grouped_gemm=True, probe_latency=False, **kw)


def _token_a2a(r):
    return [s for s in r.modelled.stats if s.bytes >= 0.1 * max(x.bytes for x in r.modelled.stats)]


def test_expert_parallel_across_two_nodes_train_step():
    from farskip_jax.analysis.topology import LINKS, Topology

    (r,) = _run(_small(**{"farskip.preset": "farskip"}), ("farskip",), "train")
    assert r.topology is not None and r.topology.num_nodes == 2 and r.topology.node_of == (0,) * 4 + (1,) * 4
    pairs = [p for p in r.schedule.pairs if p.collective == "all-to-all"]
    assert pairs and all(p.groups == (tuple(range(8)),) for p in pairs)  # EP 8 spans both hosts
    assert r.topology.crossing_fraction(pairs[0].groups) == pytest.approx(4 / 7)
    # each all-to-all is priced by hand's formula: 4 of 8 chunks through the NIC (inter_eff x 50 GB/s), 3
    # to node peers over the node's fabric at the size curve's share of its bandwidth, the slower of the two
    lk = r.topology.links
    for s in _token_a2a(r):
        nic = 1e6 * s.bytes * 4 / 8 / lk.inter_bw
        intra = 1e6 * max(s.bytes * 3 / 8 / lk.intra_bw, s.bytes / 8 / lk.intra_peer_bw) / lk.g(s.bytes)
        assert s.duration == pytest.approx(lk.inter_latency_us + max(nic, intra), rel=1e-6)
    # the NIC's share per GPU is several times slower than the node's fabric (at these tiny payloads the
    # fitted size curve makes both paths latency- and protocol-bound, so the times themselves are close)
    assert 4 * lk.inter_bw < Topology.of(LINKS["mi325x"], 8).links.intra_bw
    assert {s.direction for s in r.modelled.stats} == {"fwd", "bwd"}
    assert r.modelled.step_time > 0 and r.serial.step_time >= r.modelled.step_time - 1e-6


def test_data_across_nodes_experts_inside_and_foe_one_group_per_node():
    """data=2 x expert=4 on 2 nodes: the all-to-alls stay inside a node (expert is the inner mesh
    axis); FoE with H=2 groups on an EP-8 mesh: each group's all-to-all stays on its own node."""
    (dp,) = _run(_small(**{"mesh.data": 2, "mesh.expert": 4}), ("standard",), "forward")
    a2a = [p for p in dp.schedule.pairs if p.collective == "all-to-all"]
    assert a2a and all(sorted(p.groups) == [(0, 1, 2, 3), (4, 5, 6, 7)] for p in a2a)
    assert all(dp.topology.crossing_fraction(p.groups) == 0.0 for p in a2a)
    (foe,) = _run(_small(**{"runtime.num_groups": 2, "moe.top_k": 2}), ("farskip",), "forward")
    from farskip_jax.analysis.groups import foe_summary

    summ = foe_summary(foe.hlo_text, foe.mesh)
    assert summ.confined and sorted(summ.group_devices) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    fa = [p for p in foe.schedule.pairs if p.collective == "all-to-all"]
    assert fa and all(foe.topology.crossing_fraction(p.groups) == 0.0 for p in fa)
    # the same bytes priced inside a node cost less than EP 8 across the two nodes would
    big = max(fa, key=lambda p: p.bytes)
    assert foe.topology.all_to_all_us(big.bytes, big.groups) < foe.topology.all_to_all_us(big.bytes)


def test_levers_token_chunks_and_fp8_dispatch_in_the_compiled_program():
    """ep_options chunks=2: twice the token all-to-alls at half the bytes each; fp8 dispatch: the
    dispatch payload at half the bf16 bytes, the combine unchanged."""
    cfg = _small(**{"farskip.preset": "farskip"})

    def token_a2a(r):
        big = max(p.bytes for p in r.schedule.pairs if p.collective == "all-to-all")
        return [p for p in r.schedule.pairs if p.collective == "all-to-all" and p.bytes >= 0.1 * big]

    (base,) = _run(cfg, ("farskip",), "forward")
    (ch,) = _run(cfg, ("farskip",), "forward", ep_options={"chunks": 2})
    (f8,) = _run(cfg, ("farskip",), "forward", ep_options={"dispatch_dtype": "float8_e4m3fn"})
    b, c = token_a2a(base), token_a2a(ch)
    assert len(c) == 2 * len(b) and sum(p.bytes for p in c) == sum(p.bytes for p in b)
    by_role = lambda r, role: sum(p.bytes for p in token_a2a(r) if f"/{role}/" in p.start.op_name)
    assert by_role(f8, "dispatch") * 2 == by_role(base, "dispatch")
    assert by_role(f8, "combine") == by_role(base, "combine")


def test_hierarchical_dispatch_cross_node_groups_hold_one_gpu_per_node():
    """runtime.dispatch=hierarchical on 16 compile-only GPUs over 2 nodes (EP 16, top-4): the token
    all-to-alls are either cross-node ones whose replica groups hold one GPU per node (the same
    local rank) or intra-node ones over a node's 8 GPUs, and the bytes through each GPU's NIC are
    half those of the all_to_all dispatch (C1 = T_l rows to each of 2 nodes instead of E*C = 2 T_l)."""
    from farskip_jax.analysis.overlap import run_overlap

    def nic_bytes(r, pairs):  # per device: bytes to members on other nodes, summed over the exchanges
        node = r.topology.node_of
        return sum(p.bytes * max(sum(node[x] != node[d] for x in g) for g in p.groups for d in g) / len(p.groups[0])
                   for p in pairs)

    out = {}
    for dispatch in ("hierarchical", "all_to_all"):
        cfg = _small(**{"runtime.dispatch": dispatch, "moe.num_experts": 16, "moe.top_k": 4, "mesh.expert": 16})
        (r,) = run_overlap(cfg, ("farskip",), ("forward",), batch=16, seq=256, num_devices=16, gpus_per_node=8,
                           hardware="mi325x", grouped_gemm=True, probe_latency=False)
        assert r.topology.node_of == (0,) * 8 + (1,) * 8
        big = max(p.bytes for p in r.schedule.pairs if p.collective == "all-to-all")
        out[dispatch] = (r, [p for p in r.schedule.pairs if p.collective == "all-to-all" and p.bytes >= 0.1 * big])
    r, tok = out["hierarchical"]
    cross = [p for p in tok if "cross_node" in p.start.op_name]
    intra = [p for p in tok if "intra_node" in p.start.op_name]
    # per MoE layer (2): a cross-node and an intra-node exchange in the dispatch and in the combine
    assert len(cross) == len(intra) == 4 and len(cross) + len(intra) == len(tok)
    for p in cross:
        assert sorted(p.groups) == [(g, 8 + g) for g in range(8)]  # one GPU per node, same local rank
        assert all(len({r.topology.node_of[d] for d in g}) == len(g) for g in p.groups)
        assert r.topology.crossing_fraction(p.groups) == 1.0
    for p in intra:
        assert sorted(p.groups) == [tuple(range(8)), tuple(range(8, 16))]
        assert r.topology.crossing_fraction(p.groups) == 0.0
    ra, ta = out["all_to_all"]
    assert all(p.groups == (tuple(range(16)),) for p in ta)
    assert nic_bytes(r, tok) == pytest.approx(0.5 * nic_bytes(ra, ta))


def test_foe_sharded_tokens_and_strided_groups_on_two_nodes():
    """FoE H = 2 on 16 compile-only GPUs over 2 nodes with runtime.foe_tokens=sharded: no activation
    all-reduce is left (the cross-group sums are reduce-scatters, the group views all-gathers);
    contiguous placement (a group per node): every all-to-all inside a node, every sum across the two
    (one GPU per node: {g, 8+g}). The strided placement compiles to the same schedule (only the
    device assignment differs: the benchmark re-times one compile for both) and puts every sum inside
    a node ({2i, 2i+1}) while each group's all-to-all spans both nodes (4 + 4 GPUs)."""
    from farskip_jax.analysis.deviceless import LHS_FLAGS, compile_deviceless, gpu_devices, preset_options
    from farskip_jax.analysis.overlap import run_overlap
    from farskip_jax.analysis.programs import forward_program, grouped_gemm_proxy
    from farskip_jax.config import replace
    from farskip_jax.parallel.foe import foe_mesh_from
    from farskip_jax.parallel.mesh import make_mesh

    cfg = _small(**{"runtime.num_groups": 2, "moe.num_experts": 16, "mesh.expert": 16, "runtime.foe_tokens": "sharded"})
    (r,) = run_overlap(cfg, ("farskip",), ("forward",), batch=16, seq=256, num_devices=16, gpus_per_node=8,
                       hardware="mi325x", grouped_gemm=True, probe_latency=False)
    assert r.topology.node_of == (0,) * 8 + (1,) * 8
    act = 256 * 256 * 2  # bytes of one sequence's [s, d] bf16 activation (a device's own tokens)
    acts = [p for p in r.schedule.pairs if p.bytes >= act and p.collective != "all-to-all"]
    assert acts and {p.collective for p in acts} == {"reduce-scatter", "all-gather"}  # no all-reduce left
    rs = [p for p in acts if p.collective == "reduce-scatter"]
    assert sum(len(p.operand_shapes) for p in rs) == 4  # 2 layers x (attention sum, routed sum)
    # the group views under farskip: layer 0 reads the embedding (already replicated), layer 1 gathers
    # its attention input and its MoE input
    assert sum(1 for p in acts if p.collective == "all-gather" for dt, dims in p.operand_shapes if dims[-1] == 256) == 2
    sums = acts
    for p in sums:
        assert sorted(p.groups) == [(g, 8 + g) for g in range(8)]  # one GPU per node: across the NICs
    assert r.topology.crossing_fraction(sums[0].groups) == 1.0
    # the token exchanges (the routing, computed on the own tokens, is redistributed in small pieces)
    a2a = [p for p in r.schedule.pairs if p.collective == "all-to-all" and p.bytes >= act]
    assert a2a and all(sorted(p.groups) == [tuple(range(8)), tuple(range(8, 16))] for p in a2a)

    devices = gpu_devices("h100_sxm", 16, gpus_per_node=8)
    mesh = foe_mesh_from(make_mesh(cfg.mesh, devices), 2, "strided")
    c = replace(cfg, **{"farskip.preset": "farskip"})
    with grouped_gemm_proxy():
        fn, args = forward_program(c, mesh, 16, 256)
        strided = compile_deviceless(fn, *args, flags=dict(preset_options("cuda_hopper"), **LHS_FLAGS))
    sig = lambda sc: ([(o.opcode, o.kind, o.in_bytes, o.out_bytes, o.flops) for o in sc.ops],  # noqa: E731
                      [(p.collective, p.bytes, p.groups) for p in sc.pairs])
    assert sig(strided.schedule) == sig(r.schedule)  # the same schedule (logical replica groups too)
    node = [d.process_index for d in mesh.devices.flat]  # node of each logical device, strided
    for p in sums:
        assert all(len({node[x] for x in g}) == 1 for g in p.groups)  # inside a node
    for p in a2a:
        assert all(sorted(node[x] for x in g) == [0] * 4 + [1] * 4 for g in p.groups)


def test_foe_local_attention_and_fp8_sums_on_two_nodes():
    """FoE H = 2, token-sharded, on 16 compile-only GPUs over 2 nodes, farskip forward with
    runtime.foe_attention=local and runtime.foe_sum_dtype=float8_e4m3fn: the attention sums are gone (layer 0
    and the FarSkip layers run their attention on the own tokens), one fp8 sum per MoE layer is left,
    an all-to-all of uint8 [.., d + 4] over {g, 8+g} (one GPU per node) with no reduce-scatter or
    all-reduce of activations; the MoE input is gathered as uint8 too (d + 4 bytes a row, not 2 d)."""
    from farskip_jax.analysis.overlap import run_overlap

    d, s = 256, 256
    cfg = _small(**{"runtime.num_groups": 2, "moe.num_experts": 16, "mesh.expert": 16, "runtime.foe_tokens": "sharded",
                    "runtime.foe_attention": "local", "runtime.foe_sum_dtype": "float8_e4m3fn"})
    (r,) = run_overlap(cfg, ("farskip",), ("forward",), batch=16, seq=s, num_devices=16, gpus_per_node=8,
                       hardware="mi325x", grouped_gemm=True, probe_latency=False)
    big = [p for p in r.schedule.pairs if p.bytes >= s * d]
    assert not [p for p in big if p.collective in ("all-reduce", "reduce-scatter")]
    sums = [p for p in big if "group_sum" in p.start.op_name]
    gathers = [p for p in big if "group_gather" in p.start.op_name]
    # one routed sum per MoE layer (2), as an all-to-all of uint8 rows: a chunk of one sequence per
    # member (2 members), d + 4 bytes a row where the bf16 reduce-scatter moved 2 d
    assert len(sums) == 2 and {p.collective for p in sums} == {"all-to-all"}
    assert all(p.operand_shapes == (("U8", (2, 1, s, d + 4)),) and p.bytes == 2 * s * (d + 4) for p in sums), \
        [(p.operand_shapes, p.bytes) for p in sums]
    # the MoE inputs: layer 0's (outdated: the embedding, on every group already) is copied, layer 1's
    # gathered as uint8 rows (XLA combines it with a small routing redistribution, int32)
    u8 = [dims for p in gathers for dt, dims in p.operand_shapes if dt == "U8"]
    assert {p.collective for p in gathers} == {"all-gather"} and u8 == [(1, s, d + 4)], u8
    for p in sums + gathers:
        assert sorted(p.groups) == [(g, 8 + g) for g in range(8)]

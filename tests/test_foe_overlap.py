"""Federation of Experts collectives from compiled HLO (analysis/groups.py, the overlap tool's FoE path).

- bytes per MoE layer, ordinary MoE vs FoE H = 2, 4, 8 on 8 CPU devices (ep = 8), compiled forward:
  exact against the formula below, which is the paper's single-node k-fold formula plus the
  implementation's fixed terms (capacity buffers, the count exchange, the last layer's routed sum);
- replica-group parsing of the three HLO spellings (explicit, iota, mesh axes);
- deviceless GPU compile (overlap tool, H100 spec): all-to-all replica groups inside one group's
  devices, a cross-group all-reduce, modelled step times (XLA model and two-stream MI300X model).

Formula (per device, forward, L MoE layers, standard connectivity; T tokens per data shard, d, k, E,
ep, fp32 b = 4; all_to_all backend with capacity_factor = 1 so a buffer holds exactly the T/ep*k
expected rows; G = min(H, ep) device groups of n = ep / G devices):
    all-to-all  = L * (2 * (T/ep) * k * d * b  +  4 * E / G)     over n devices (none when n = 1)
                  (dispatch + combine rows: the same for MoE and FoE; + int32 counts [n, E/G / n])
    cross-group = (L + 1) * (T/n) * d * b                          over the G device groups
                  (one sum of sum_h (m^h_{k-1} + a^h_k) per layer, plus the last routed sum)
Wire bytes per token per layer (the paper's single-node view, ring all-reduce): ordinary MoE
2*k*d*b*(ep-1)/ep; FoE with H = ep 2*d*b*(ep-1)/ep: k-fold fewer.
"""

import importlib.util
import os

import jax
import pytest

from farskip_jax.analysis.groups import axis_groups, foe_summary, hlo_collectives, parse_replica_groups, shapes_bytes
from farskip_jax.config import load_config

L, D, E, K, EP, B, S = 2, 64, 16, 8, 8, 8, 16
T = B * S


def _cfg(h, *extra):
    return load_config(None, ["model.vocab_size=64", f"model.d_model={D}", f"model.num_layers={L}",
                              "model.num_heads=8", "model.num_kv_heads=8", "model.mlp_hidden=64",
                              f"moe.num_experts={E}", f"moe.top_k={K}", "moe.expert_hidden=32",
                              "moe.num_shared_experts=0", "runtime.dispatch=all_to_all", "runtime.capacity_factor=1.0",
                              f"mesh.expert={EP}", "mesh.data=1", f"runtime.num_groups={h}", *extra])


def _formula(h):
    g = min(h, EP)
    n = EP // g
    a2a = L * (2 * (T // EP) * K * D * 4 + 4 * E // g) if n > 1 else 0
    cross = (L + 1) * (T // n) * D * 4 if h > 1 else 0
    return a2a, n, cross


@pytest.mark.parametrize("h", [1, 2, 4, 8])
def test_bytes_per_layer_match_formula(h):
    from farskip_jax.analysis.programs import analysis_mesh, forward_program

    cfg = _cfg(h)
    mesh = analysis_mesh(cfg, jax.devices())
    fn, args = forward_program(cfg, mesh, B, S)
    s = foe_summary(fn.lower(*args).compile().as_text(), mesh)
    a2a, n, cross = _formula(h)
    assert s.confined and s.all_to_all_bytes == a2a
    assert {c.group_size for c in s.all_to_all} <= {n}
    # the residual sums ([.., d] operands); router statistics (scalars / [E] vectors) ride along
    sums = sum(shapes_bytes([(dt, dims)]) for c in s.cross_group for dt, dims in c.shapes if dims and dims[-1] == D)
    assert sums == cross
    if h == 1:
        assert not s.cross_group
    per_token_moe = 2 * K * D * 4 * (EP - 1) / EP
    if h == EP:  # single node, one group per device: no all-to-all; the all-reduce is k-fold smaller per token
        per_layer = cross / (L + 1)  # bytes of one sum per device = T tokens * d * b
        per_token_foe = 2 * (EP - 1) / EP * per_layer / T
        assert per_token_moe / per_token_foe == pytest.approx(K)
    if h == 1:  # measured MoE wire bytes per token per layer = the formula's 2 k d b (ep-1)/ep
        rows = (a2a / L - 4 * E) * (EP - 1) / EP / (T // EP)
        assert rows == pytest.approx(per_token_moe)


def test_replica_group_spellings():
    assert parse_replica_groups("x, replica_groups={{0,4},{1,5}}, y") == [(0, 4), (1, 5)]
    assert parse_replica_groups("replica_groups={}, to_apply") is None
    assert parse_replica_groups("replica_groups=[2,4]<=[8], x") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert parse_replica_groups("replica_groups=[4,2]<=[2,4]T(1,0)") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    # mesh-axes spelling: devices laid out [4, 2] (iota [2,4] transposed), groups along axis_0
    got = parse_replica_groups("replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, x")
    assert got == [(0, 1, 2, 3), (4, 5, 6, 7)]
    line = ("  %all-to-all.1 = (f32[1,32,64]{2,1,0}, f32[1,32,64]{2,1,0}) all-to-all(%a, %b), channel_id=1, "
            'replica_groups={{0,1,2,3},{4,5,6,7}}, metadata={op_name="jit(f)/layer_0/dispatch/all_to_all"}')
    (c,) = hlo_collectives(line)
    assert (c.op, c.bytes, c.group_size, c.op_name) == ("all-to-all", 2 * 32 * 64 * 4, 4, "jit(f)/layer_0/dispatch/all_to_all")


def test_axis_groups_of_foe_mesh():
    from farskip_jax.parallel.foe import make_foe_mesh

    cfg = _cfg(2)
    mesh = make_foe_mesh(cfg.mesh, 2)
    assert axis_groups(mesh, ("group",)) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert axis_groups(mesh, ("data", "fsdp", "expert", "tensor")) == [(0, 1, 2, 3), (4, 5, 6, 7)]


# ---------------------------------------------------------------- deviceless GPU compile (overlap tool)

HAS_CUDA_PLUGIN = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
gpu = pytest.mark.skipif(not HAS_CUDA_PLUGIN and not os.environ.get("CI"),
                         reason="jax-cuda12-plugin/pjrt (compile-only) not installed")


@gpu
def test_overlap_tool_on_foe_gpu_compile():
    from farskip_jax.analysis.overlap import run_overlap, to_json

    cfg = load_config(None, ["model.num_layers=2", "model.d_model=256", "model.num_heads=4", "model.num_kv_heads=2",
                             "model.vocab_size=512", "runtime.compute_dtype=bfloat16", "model.max_seq_len=512",
                             "moe.num_experts=8", "moe.top_k=2", "moe.expert_hidden=512", "runtime.dispatch=all_to_all",
                             "runtime.capacity_factor=1.0", "runtime.num_groups=2", "mesh.data=1", "mesh.expert=8",
                             "train.seq_len=512", "train.batch_size=8"])
    res = run_overlap(cfg, ("standard", "farskip"), ("forward",), hardware="mi300x")
    for r in res:
        assert dict(r.mesh.shape) == dict(data=1, fsdp=1, group=2, expert=4, tensor=1)
        s = foe_summary(r.hlo_text, r.mesh)
        assert len(s.all_to_all) >= 2 * L and s.confined and {c.group_size for c in s.all_to_all} == {4}
        assert s.cross_group and {c.group_size for c in s.cross_group} == {2}
        # the scheduled async all-to-alls the report times are the group-confined ones
        assert r.report.stats and all(st.layer in (0, 1) for st in r.report.stats)
        assert {p.group_size for p in r.schedule.pairs if p.collective == "all-to-all"} == {4}
        assert r.report.step_time > 0 and r.modelled.step_time > 0
        assert r.report.other_collective_time > 0  # the cross-group all-reduces take modelled time
    js = to_json(res)["forward"]
    assert js["farskip"]["foe"]["all_to_all_confined"] and js["standard"]["foe"]["cross_group_all_reduces"] > 0

"""The multi-node collective cost model (analysis/topology.py) against times computed by hand, and
the two-stream model re-timing a hand-built schedule with it."""

import dataclasses

import pytest

from farskip_jax.analysis.cost_model import HARDWARE, Hardware, collective_time_us, simulate
from farskip_jax.analysis.hlo import CollectivePair, HloOp, Schedule
from farskip_jax.analysis.topology import GBIT, LINKS, SUM_ALL_TO_ALL, Links, Topology
from farskip_jax.errors import ConfigError

# 2 nodes x 2 GPUs. Inside a node: one 1 GB/s link per peer (full mesh); per node 2 NICs of 0.25 GB/s
# (one per GPU); efficiencies 1; latency 1 us inside a node, 5 us across.
TOY = Links("toy", intra_link_bw=1e9, intra_links=1, switch=False, nic_bw=0.25e9, nics_per_node=2, gpus_per_node=2,
            intra_eff=1.0, inter_eff=1.0, intra_latency_us=1.0, inter_latency_us=5.0)
TOPO = Topology(TOY, node_of=(0, 0, 1, 1))


def test_all_to_all_by_hand():
    # P = 4000 B per device over all 4: 1000 B to each member. Device 0 sends 1000 B to its node peer
    # (1 us on the 1 GB/s link) and 2000 B through its 0.25 GB/s NIC (8 us), at once: 5 + max(1, 8) us
    assert TOPO.all_to_all_us(4000, [(0, 1, 2, 3)]) == pytest.approx(13.0)
    assert TOPO.collective_time_us("ragged-all-to-all", 4000, [(0, 1, 2, 3)]) == pytest.approx(13.0)
    # groups inside a node: 2000 B to the peer over the link, 2 us + 1 us
    assert TOPO.all_to_all_us(4000, [(0, 1), (2, 3)]) == pytest.approx(3.0)
    # groups across the nodes: 2000 B through the NIC, 8 us + 5 us
    assert TOPO.all_to_all_us(4000, [(0, 2), (1, 3)]) == pytest.approx(13.0)
    assert TOPO.crossing_fraction([(0, 1, 2, 3)]) == pytest.approx(2 / 3)
    assert TOPO.crossing_fraction([(0, 1), (2, 3)]) == 0.0
    assert TOPO.all_to_all_us(4000, [(0,), (1,)]) == 0.0  # nothing to exchange
    # FoE's fp8 reduce-scatter (an all-to-all + local sum) is priced as the all-to-all it is; over one GPU
    # per node it equals the reduce-scatter of the same payload: 5 + 2000 B / 0.25 GB/s
    assert TOPO.collective_time_us(SUM_ALL_TO_ALL, 4000, [(0, 2), (1, 3)]) == pytest.approx(13.0)
    assert TOPO.collective_time_us("reduce-scatter", 4000, [(0, 2), (1, 3)]) == pytest.approx(13.0)


def test_all_reduce_and_others_by_hand():
    # all 4: l = 2 per node, m = 2 nodes. Reduce-scatter + all-gather inside the node:
    # 2 * 1/2 * 4000 B / 1 GB/s = 4 us; the 2000 B shard all-reduced over 2 nodes: 2 * 1/2 * 2000 / 0.25e9 = 8 us
    assert TOPO.all_reduce_us(4000, [(0, 1, 2, 3)]) == pytest.approx(5.0 + 4.0 + 8.0)
    assert TOPO.collective_time_us("all-reduce", 4000, None) == pytest.approx(17.0)  # None = every device
    assert TOPO.collective_time_us("all-gather", 4000, [(0, 1, 2, 3)]) == pytest.approx(5.0 + 2.0 + 4.0)
    assert TOPO.collective_time_us("all-reduce", 4000, [(0, 1), (2, 3)]) == pytest.approx(1.0 + 4.0)
    # data-parallel pairs across nodes (l = 1): only the NIC phase, 2 * 1/2 * 4000 / 0.25e9 = 16 us
    assert TOPO.collective_time_us("all-reduce", 4000, [(0, 2), (1, 3)]) == pytest.approx(5.0 + 16.0)
    assert TOPO.collective_time_us("collective-permute", 1000, [(0, 2)]) == pytest.approx(5.0 + 4.0)
    assert TOPO.collective_time_us("collective-permute", 1000, [(0, 1)]) == pytest.approx(1.0 + 1.0)


def test_switch_vs_full_mesh_and_single_node_formula():
    # behind a switch a GPU's aggregate is one port: 8 GPUs, P = 8000 B, 7000 B leave the device
    sw = Topology(dataclasses.replace(TOY, switch=True, intra_link_bw=7e9, gpus_per_node=8), node_of=(0,) * 8)
    assert sw.all_to_all_us(8000) == pytest.approx(1.0 + 7000 / 7e9 * 1e6)
    # a full mesh of 7 x 1 GB/s links gives the same aggregate; a group using only 1 peer is link bound
    mesh = Topology(dataclasses.replace(TOY, intra_links=7, gpus_per_node=8), node_of=(0,) * 8)
    assert mesh.all_to_all_us(8000) == pytest.approx(1.0 + 1.0)
    assert mesh.all_to_all_us(8000, [(0, 1), (2, 3), (4, 5), (6, 7)]) == pytest.approx(1.0 + 4.0)
    assert sw.all_to_all_us(8000, [(0, 1), (2, 3), (4, 5), (6, 7)]) == pytest.approx(1.0 + 4000 / 7e9 * 1e6)
    # one MI300X node: exactly the single-node formula of cost_model.py
    one = Topology.of(LINKS["mi300x"], 8)
    hw = HARDWARE["mi300x"]
    for kind in ("all-to-all", "all-reduce", "all-gather"):
        assert one.collective_time_us(kind, 2**24) == pytest.approx(collective_time_us(kind, 2**24, 8, hw))
    # 4 nodes x 8: 24 of 31 peers are remote; NIC = inter_eff (fitted) * 50 GB/s per GPU
    four = Topology.of(LINKS["mi325x"], 32)
    eff = LINKS["mi325x"].inter_eff
    assert four.num_nodes == 4 and four.links.inter_bw == pytest.approx(eff * 400 * GBIT)
    assert four.all_to_all_us(32e6) == pytest.approx(20.0 + 1e6 * 24e6 / (eff * 50e9))
    small = Topology.of(LINKS["mi325x"], 32, gpus_per_node=4).links
    assert small.intra_links == 3 and small.nics_per_node == 4  # one NIC per GPU stays one per GPU
    assert small.inter_bw == pytest.approx(four.links.inter_bw)
    with pytest.raises(ConfigError, match="gpus_per_node"):
        Topology.of(LINKS["mi325x"], 12, gpus_per_node=8)


def test_simulate_with_topology():
    """x -> start -> done -> y, attn independent (2 us): the cross-node all-to-all (13 us) is hidden
    for 2 us and exposed for 11; inside a node (3 us) 2 of 3 us are hidden."""
    hw = Hardware("toy", peak_flops=1e12, hbm_bw=1e9, a2a_bw=1e9, coll_bw=1e9, launch_us=0.0, matmul_eff=1.0,
                  mem_eff=1.0)
    names = ["x", "s", "attn", "d", "y"]
    kinds = ["compute", "start", "compute", "done", "compute"]
    opnds = [(), (1,), (), (2,), (4, 3)]

    def sched(groups):
        ops = [HloOp(id=i + 1, name=n, opcode="fusion" if k == "compute" else f"async-{k}",
                     op_name=f"jit(f)/layer_0/{'attention' if n == 'attn' else 'moe/dispatch'}/op", operands=o,
                     kind=k, collective="all-to-all" if k != "compute" else None, in_bytes=1000, out_bytes=1000,
                     index=i)
               for i, (n, k, o) in enumerate(zip(names, kinds, opnds))]
        by = {o.id: o for o in ops}
        return Schedule(ops=ops, by_id=by, pairs=[CollectivePair(start=by[2], done=by[4], collective="all-to-all",
                                                                 bytes=4000, group_size=len(groups[0]), groups=groups)])

    from farskip_jax.analysis.report import analyze

    s, d = simulate(sched(((0, 1, 2, 3),)), hw, topology=TOPO)
    assert d == [pytest.approx(13.0)]
    rep = analyze(s, d)
    assert rep.stats[0].hidden == pytest.approx(2.0) and rep.step_time == pytest.approx(2 + 13 + 2)
    s, d = simulate(sched(((0, 1), (2, 3))), hw, topology=TOPO)
    assert d == [pytest.approx(3.0)] and analyze(s, d).step_time == pytest.approx(2 + 3 + 2)


def test_replica_group_forms_of_the_schedule_dump():
    from farskip_jax.analysis.hlo import replica_groups_of

    explicit = {"collective_device_list": [{"replica_groups": [{"replica_ids": [0, 1]}, {"replica_ids": [2, 3]}]}]}
    assert replica_groups_of(explicit) == ((0, 1), (2, 3))
    iota = {"collective_device_list": [{"iota_replica_group_list": [{"num_replica_groups": [2],
            "num_devices_per_group": [2], "iota_reshape_dims": [2, 2], "iota_transpose_perm": [1, 0]}]}]}
    assert replica_groups_of(iota) == ((0, 2), (1, 3))
    # mesh axes (native all-reduce-start): axes {} = mesh axis 0; here the [2, 4] mesh's axis 1
    mesh = {"mesh_axes_replica_group_list": [{"mesh": [{"axes": [{"name": ["a"], "size": [2]},
                                                                  {"name": ["b"], "size": [4]}]}],
                                              "axes": [{"mesh_axis_index": [1]}]}]}
    assert replica_groups_of(mesh) == ((0, 1, 2, 3), (4, 5, 6, 7))
    whole = {"mesh_axes_replica_group_list": [{"mesh": [{"axes": [{"size": [4]}, {"size": [1]}]}], "axes": [{}]}]}
    assert replica_groups_of(whole) == ((0, 1, 2, 3),)
    assert replica_groups_of({}) is None


def test_gradient_all_reduce_on_its_own_stream():
    """ar-start, a2a-start, y (independent), a2a-done, ar-done: on one FIFO stream the all-to-all
    queues behind the 17 us all-reduce; on its own stream it starts at once (13 us, all-to-all)."""
    hw = Hardware("toy", peak_flops=1e12, hbm_bw=1e9, a2a_bw=1e9, coll_bw=1e9, launch_us=0.0, matmul_eff=1.0,
                  mem_eff=1.0)
    spec = [("x", "compute", ()), ("ar", "start", (1,)), ("s", "start", (1,)), ("y", "compute", ()),
            ("d", "done", (3,)), ("ard", "done", (2,)), ("z", "compute", (5, 6))]
    ops = [HloOp(id=i + 1, name=n, opcode="fusion" if k == "compute" else f"async-{k}", op_name="jit(f)/op",
                 operands=o, kind=k, in_bytes=1000, out_bytes=1000, index=i) for i, (n, k, o) in enumerate(spec)]
    by = {o.id: o for o in ops}
    full = ((0, 1, 2, 3),)
    sched = Schedule(ops=ops, by_id=by, pairs=[
        CollectivePair(start=by[2], done=by[6], collective="all-reduce", bytes=4000, group_size=4, groups=full),
        CollectivePair(start=by[3], done=by[5], collective="all-to-all", bytes=4000, group_size=4, groups=full)])
    one, d = simulate(sched, hw, topology=TOPO)
    assert d == [pytest.approx(17.0), pytest.approx(13.0)]
    t = {o.name: (o.start, o.end) for o in one.ops}
    assert t["d"][1] == pytest.approx(2 + 17 + 13)  # queued behind the all-reduce
    split, _ = simulate(sched, hw, topology=TOPO, own_stream=("all-reduce",))
    t = {o.name: (o.start, o.end) for o in split.ops}
    assert t["d"][1] == pytest.approx(2 + 13) and t["ard"][1] == pytest.approx(2 + 17)
    assert split.makespan == pytest.approx(2 + 17 + 2)


def _op(i, name, kind, operands, op_name, flops=0.0, nbytes=1000):
    return HloOp(id=i, name=name, opcode="fusion" if kind == "compute" else f"async-{kind}", op_name=op_name,
                 operands=operands, kind=kind, in_bytes=nbytes, out_bytes=nbytes, flops=flops, index=i - 1)


def test_fused_attention_pricing_by_hand():
    from farskip_jax.analysis.cost_model import fused_attention_us

    hw = Hardware("toy", peak_flops=1e12, hbm_bw=1e9, a2a_bw=1e9, coll_bw=1e9, launch_us=1.0, matmul_eff=1.0,
                  mem_eff=1.0, attn_eff=0.5)
    # causal half of 2 MFLOP at 0.5 TFLOP/s = 2 us (+1 launch); backward x 1.25 recompute
    assert fused_attention_us(2e6, 0.0, "fwd", hw) == pytest.approx(1.0 + 2.0)
    assert fused_attention_us(2e6, 0.0, "bwd", hw) == pytest.approx(1.0 + 2.5)
    # bytes-bound: 10 KB at 1 GB/s = 10 us > 2 us of FLOPs
    assert fused_attention_us(2e6, 1e4, "fwd", hw) == pytest.approx(1.0 + 10.0)
    fwd = _op(1, "qk", "compute", (), "jit(f)/layer_0/attention/attention_core/dot_general", flops=2e6, nbytes=0)
    bwd = _op(2, "dqk", "compute", (), "jit(f)/transpose(jvp(layer_0))/attention/attention_core/dot", flops=2e6,
              nbytes=0)
    sm = _op(3, "softmax", "compute", (), "jit(f)/layer_0/attention/attention_core/exp", nbytes=10**9)
    sched = Schedule(ops=[fwd, bwd, sm], by_id={1: fwd, 2: bwd, 3: sm})
    # as compiled (roofline): each dot 2 MFLOP / 1 TFLOP/s = 2 us + 1; the softmax 2 GB: 2 s
    assert simulate(sched, hw)[0].makespan == pytest.approx(3.0 + 3.0 + 1.0 + 2e6)
    # flash kernels: one per pass; the softmax alone (no dot) is generated inside a kernel: free
    assert simulate(sched, hw, fused_attention=True)[0].makespan == pytest.approx(3.0 + 3.5)


def test_optimizer_step_parts_are_free_in_the_steady_state():
    """grad -> all-reduce -> update: the gradient all-reduce and the update are once-per-step work;
    an all-reduce whose result a layer consumes (FoE's cross-group sum) is not."""
    from farskip_jax.analysis.cost_model import optimizer_step

    hw = Hardware("toy", peak_flops=1e12, hbm_bw=1e9, a2a_bw=1e9, coll_bw=1e9, launch_us=0.0, matmul_eff=1.0,
                  mem_eff=1.0)
    ops = [_op(1, "g", "compute", (), "jit(step)/transpose(jvp(layer_1))/attention/attention_out/dot"),
           _op(2, "ar", "start", (1,), "jit(step)/transpose(jvp(layer_1))/attention/attention_out/transpose"),
           _op(3, "foe", "start", (1,), "jit(step)/transpose(jvp(layer_1))/foe_routed/psum"),
           _op(4, "foed", "done", (3,), "jit(step)/transpose(jvp(layer_1))/foe_routed/psum"),
           _op(5, "l0", "compute", (4,), "jit(step)/transpose(jvp(layer_0))/attention/attention_qkv/dot"),
           _op(6, "ard", "done", (2,), ""),
           _op(7, "upd", "compute", (6,), "jit(step)/sub")]
    by = {o.id: o for o in ops}
    sched = Schedule(ops=ops, by_id=by, pairs=[
        CollectivePair(start=by[2], done=by[6], collective="all-reduce", bytes=4000, groups=((0, 1, 2, 3),)),
        CollectivePair(start=by[3], done=by[4], collective="all-reduce", bytes=4000, groups=((0, 1), (2, 3)))])
    free = optimizer_step(sched)
    assert free.ops == {7} and free.pairs == {0}
    full, d = simulate(sched, hw, topology=TOPO)
    steady, d2 = simulate(sched, hw, topology=TOPO, free=free)
    assert d == [pytest.approx(17.0), pytest.approx(5.0)] and d2 == [0.0, pytest.approx(5.0)]
    # g 2, FoE sum 5 (the gradient all-reduce queued first on the one stream: 17 + 5), l0 2, update 2
    assert full.makespan == pytest.approx(2 + 17 + 5 + 2 + 2)
    assert steady.makespan == pytest.approx(2 + 5 + 2)


def test_ragged_payload_is_the_smaller_buffer():
    from farskip_jax.analysis.cost_model import ragged_payload

    send = _op(1, "send", "compute", (), "x", nbytes=4000)  # exact rows
    recv = _op(2, "recv", "compute", (), "x", nbytes=32000)  # worst-case buffer
    dispatch = _op(3, "s", "start", (1, 2), "x")
    combine = _op(4, "s2", "start", (2, 1), "x")
    sched = Schedule(ops=[send, recv, dispatch, combine], by_id={o.id: o for o in (send, recv, dispatch, combine)})
    for st in (dispatch, combine):
        pair = CollectivePair(start=st, done=st, collective="ragged-all-to-all", bytes=36000)
        assert ragged_payload(sched, pair) == 4000.0


def test_all_gather_priced_by_its_gathered_buffer():
    """An all-gather's operand is the device's shard: the formula takes the gathered buffer (shard x
    group size); reduce-scatter / all-reduce / all-to-all take their operands."""
    from types import SimpleNamespace

    from farskip_jax.analysis.cost_model import collective_payload

    def pair(kind, group_size):
        return SimpleNamespace(collective=kind, bytes=1000, group_size=group_size)

    assert collective_payload(None, pair("all-gather", 4), 8) == 4000
    assert collective_payload(None, pair("all-gather", 0), 8) == 8000  # no replica groups: every device
    for kind in ("reduce-scatter", "all-reduce", "all-to-all"):
        assert collective_payload(None, pair(kind, 4), 8) == 1000

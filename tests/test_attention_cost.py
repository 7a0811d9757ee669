"""Attention priced as one flash kernel per layer and pass (analysis/attention_cost.py): two programs
whose attention differs only in how XLA fused it are priced the same, by hand."""

import pytest

from farskip_jax.analysis.attention_cost import attention_kernels
from farskip_jax.analysis.cost_model import flash_attention_times
from farskip_jax.analysis.cost_model import Hardware, simulate
from farskip_jax.analysis.hlo import HloOp, Schedule
from farskip_jax.analysis.scopes import scope_of

HW = Hardware("toy", peak_flops=1e12, hbm_bw=1e9, a2a_bw=1e9, coll_bw=1e9, launch_us=1.0, matmul_eff=1.0,
              mem_eff=1.0, attn_eff=0.5)
CORE = "attention/attention_core"
BWD = "transpose(jvp(layer_{l}))"


def build(spec) -> Schedule:
    """spec: (name, opcode, operands (names), op_name, flops, out_bytes); kind from the opcode."""
    ids = {n: i + 1 for i, (n, *_) in enumerate(spec)}
    ops = []
    for i, (n, opcode, opnds, op_name, flops, out) in enumerate(spec):
        kind = "free" if opcode in ("bitcast", "get-tuple-element", "parameter") else "compute"
        ops.append(HloOp(id=ids[n], name=n, opcode=opcode, op_name=op_name, operands=tuple(ids[o] for o in opnds),
                         kind=kind, out_bytes=out, flops=flops, index=i))
    by = {o.id: o for o in ops}
    for o in ops:
        o.in_bytes = sum(by[x].out_bytes for x in o.operands)
    return Schedule(ops=ops, by_id=by)


def naive_layer(l: int, softmax_ops: int, backward: bool = False, prefix: str = "") -> list:
    """One layer's naive attention: q, k, v from the projections, QK^T (4 MFLOP) -> a softmax of
    `softmax_ops` elementwise kernels (reading a 1 MB mask besides) -> PV (2 MFLOP) -> the output
    projection; with `backward`, its backward reading the saved probabilities: dV (2 MFLOP), dP
    (2 MFLOP) -> dS (elementwise) -> dQ, dK (4 MFLOP each), into the projections' backward."""
    p, L = f"{prefix}L{l}", f"jit(f)/layer_{l}"
    spec = [(f"{p}qkv", "fusion", (), f"{L}/attention/attention_qkv/dot", 0.0, 3000),
            (f"{p}q", "get-tuple-element", (f"{p}qkv",), "", 0.0, 1000),
            (f"{p}k", "get-tuple-element", (f"{p}qkv",), "", 0.0, 1000),
            (f"{p}v", "get-tuple-element", (f"{p}qkv",), "", 0.0, 1000),
            (f"{p}mask", "fusion", (), f"{L}/attention/make_mask", 0.0, 10**6),
            (f"{p}qk", "custom-call", (f"{p}q", f"{p}k"), f"{L}/{CORE}/dot_general", 4e6, 2 * 10**6)]
    prev = f"{p}qk"
    for j in range(softmax_ops):
        spec.append((f"{p}sm{j}", "fusion", (prev, f"{p}mask"), f"{L}/{CORE}/softmax_{j}", 0.0, 2 * 10**6))
        prev = f"{p}sm{j}"
    spec.append((f"{p}probs", "bitcast", (prev,), "", 0.0, 2 * 10**6))
    spec += [(f"{p}pv", "custom-call", (f"{p}probs", f"{p}v"), f"{L}/{CORE}/dot_general", 2e6, 1000),
             (f"{p}out", "fusion", (f"{p}pv",), f"{L}/attention/attention_out/dot", 0.0, 1000)]
    if backward:
        B = f"jit(f)/{BWD.format(l=l)}"
        spec += [(f"{p}dout", "fusion", (f"{p}out",), f"{B}/attention/attention_out/dot", 0.0, 1000),
                 (f"{p}dv", "custom-call", (f"{p}probs", f"{p}dout"), f"{B}/{CORE}/dot_general", 2e6, 1000),
                 (f"{p}dp", "custom-call", (f"{p}dout", f"{p}v"), f"{B}/{CORE}/dot_general", 2e6, 2 * 10**6),
                 (f"{p}ds", "fusion", (f"{p}dp", f"{p}probs", f"{p}mask"), f"{B}/{CORE}/mul", 0.0, 2 * 10**6),
                 (f"{p}dq", "custom-call", (f"{p}ds", f"{p}k"), f"{B}/{CORE}/dot_general", 4e6, 1000),
                 (f"{p}dk", "custom-call", (f"{p}ds", f"{p}q"), f"{B}/{CORE}/dot_general", 4e6, 1000),
                 (f"{p}dqkv", "fusion", (f"{p}dq", f"{p}dk", f"{p}dv"), f"{B}/attention/attention_qkv/dot", 0.0,
                  3000)]
    return spec


def core_us(sched) -> float:
    return sum(o.duration for o in sched.ops if o.kind == "compute" and scope_of(o.op_name) == "attention_core")


def test_kernels_by_hand():
    (k,) = attention_kernels(build(naive_layer(3, softmax_ops=3)))
    # q, k, v in (3 x 1000 B; the mask is not an operand of a dot), O out (1000 B)
    assert (k.layer, k.direction, len(k.ops), k.flops, k.bytes) == (3, "fwd", 5, 6e6, 4000.0)
    kernels = {k.direction: k for k in attention_kernels(build(naive_layer(3, softmax_ops=1, backward=True)))}
    # forward: the probabilities it saves for the backward are exchanged inside the component: not counted
    assert (len(kernels["fwd"].ops), kernels["fwd"].flops, kernels["fwd"].bytes) == (3, 6e6, 4000.0)
    # backward: reads dO, v, k, q (4000 B), writes dV, dQ, dK (3000 B)
    assert (len(kernels["bwd"].ops), kernels["bwd"].flops, kernels["bwd"].bytes) == (5, 12e6, 7000.0)


def test_fusion_does_not_change_the_price():
    """The same attention fused into 1 or 4 softmax kernels: as compiled the 3 extra kernels cost
    3 x (1 + 5 MB / 1 GB/s) us; as flash kernels both programs cost, by hand, forward
    1 + max(6 MFLOP x 0.5 / 0.5 TFLOP/s, 4000 B / 1 GB/s) = 7 us and backward 1 + max(12e6 x 0.5 x
    1.25 / 0.5e12, 7000 / 1e9) s = 16 us, spread over the ops in proportion to their compiled
    roofline times (each + 1 us launch)."""
    fused, unfused = (build(naive_layer(0, n, backward=True)) for n in (1, 4))
    naive = [core_us(simulate(s, HW)[0]) for s in (fused, unfused)]
    assert naive[1] - naive[0] == pytest.approx(3 * (1.0 + 1e6 * (4 * 10**6 + 10**6) / 1e9))
    flash = [core_us(simulate(s, HW, fused_attention=True)[0]) for s in (fused, unfused)]
    assert flash[0] == pytest.approx(flash[1]) and flash[0] == pytest.approx(7.0 + 16.0)
    t = flash_attention_times(unfused, HW)
    by = {o.name: t[o.id] for o in unfused.ops if o.id in t}
    # compiled: qk max(4 us, 2 MB + 2000 B / 1 GB/s = 2002 us) + 1; each softmax op 5 MB: 5001 us; pv as qk
    qk, sm, pv = 1.0 + 2002.0, 1.0 + 5000.0, 1.0 + 2002.0
    total = qk + 4 * sm + pv
    assert by["L0qk"] == pytest.approx(7.0 * qk / total) and by["L0sm0"] == pytest.approx(7.0 * sm / total)
    assert sum(by[n] for n in ("L0qk", "L0sm0", "L0sm1", "L0sm2", "L0sm3", "L0pv")) == pytest.approx(7.0)


def test_layers_are_separate_kernels():
    """Two layers; layer 1's softmax also reads an op of layer 0's core (a broadcast XLA hoisted out of
    the layer loop): still one kernel per layer and pass; a core op without dots costs nothing."""
    spec = [("hoisted", "fusion", (), f"jit(f)/layer_0/{CORE}/broadcast_in_dim", 0.0, 10**6)]
    spec += naive_layer(0, 1) + naive_layer(1, 1)
    spec = [(n, oc, opnds + (("hoisted",) if n == "L1sm0" else ()), nm, f, b) for n, oc, opnds, nm, f, b in spec]
    sched = build(spec)
    ks = attention_kernels(sched)
    assert sorted((k.layer, len(k.ops), k.flops) for k in ks) == [(0, 1, 0.0), (0, 3, 6e6), (1, 3, 6e6)]
    assert flash_attention_times(sched, HW)[sched.ops[0].id] == 0.0
    assert core_us(simulate(sched, HW, fused_attention=True)[0]) == pytest.approx(2 * 7.0)

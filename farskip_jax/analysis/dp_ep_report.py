"""Modelled serving programs of the dp_ep layout (serving/dp_ep.py: data-parallel attention, the MoE by
expert-parallel all-to-alls): prefill and decode compiled deviceless for H100s, their all-to-alls
priced by the two-stream cost model, standard / TBO / FarSkip / FarSkip + TBO.

    cfg = dp_ep_config(base, "farskip", ep=32, layers=4, micro_batches=2)
    c = compile_dp_ep(cfg, "decode", rows_per_gpu=256, tokens=1, context=2048)   # CompiledPoint
    t = time_dp_ep(c)                                                            # DpEpTiming (us)
    t61 = extrapolate(t4, 4, t6, 6, 61)                                          # linear in the layers

Programs: serving/programs.prefill_program (LM head on the last slot: what the first token costs) /
decode_program on a mesh of `ep` compile-only GPUs (8 per node), every GPU its own `rows_per_gpu`
requests (decode: one token each against a `context`-slot cache; prefill: prompts of `tokens`), the
routed experts over all of them (mesh.expert = ep). The dispatch is `runtime.dispatch=hierarchical` (the
training's node-deduplicated all-to-all: a token crosses to a node once, as DeepEP's normal kernels)
at `runtime.capacity_factor=1.0`: at a balanced router every slot of the fixed buffers is a real row, so
the all-to-alls move the rows a ragged exchange (DeepEP) moves; the grouped GEMM is traced as
inference_report's balanced proxy at those rows. Compiled with the latency-hiding scheduler
(inference_report.compile_serving); re-timed by cost_model.simulate on the H100 topology of
analysis/topology.py (NVLink inside a node, 8 x 400 Gb/s NICs), prefill attention as a causal flash
kernel, with the fitted constants (central, or one at the low / high end of its spread).

DpEpTiming: time_us (XLA's schedule, each all-to-all overlapped as scheduled), serial_us (the same
program with every all-to-all synchronous: SGLang without TBO, whose DeepEP calls block the compute
stream), compute_us, a2a_us / a2a_hidden_us (all-to-all time and the part under compute).
A study's results.json (farskip_jax/studies/compare_dp_ep.py) is read back by `at_depth`, `speedups` and
`point_rows` (throughput over the no-overlap standard at the full depth, over the constants' spread).
Imports of JAX-side modules stay inside the functions (as inference_report's): a caller sets
JAX_PLATFORMS and the CPU device count before JAX starts.
"""

from __future__ import annotations

import dataclasses
from typing import Optional
from farskip_jax.config import replace
import time
from farskip_jax.analysis import inference_report as ir
from farskip_jax.analysis.deviceless import gpu_devices
from farskip_jax.analysis.calibration_fit import load_fitted
from farskip_jax.analysis.cost_model import OptimizerStep, hardware_from_fit, simulate, with_contention
from farskip_jax.analysis.inference_report import USED_EXPERTS, flash_scores
from farskip_jax.analysis.report import ALL_TO_ALLS, analyze
from farskip_jax.analysis.topology import Topology, links_from_fit, resized

GPUS_PER_NODE = 8


def dp_ep_config(base, preset: str, ep: int, layers: Optional[int] = None, micro_batches: int = 1,
                 dispatch: str = "hierarchical", num_experts: Optional[int] = None):
    """`base` on the dp_ep layout of `ep` GPUs: connectivity `preset`, micro_batches 2 = TBO, bf16, no
    remat, unrolled layers, a server's kernels (runtime.gmm / attention auto), capacity factor 1.0 (module
    doc); `layers` cuts the depth; num_experts: e.g. 288 = 256 + 32 redundant (EPLB's EP 72 pool)."""

    over = {"inference.layout": "dp_ep", "mesh.data": 1, "mesh.fsdp": 1, "mesh.expert": ep, "mesh.tensor": 1,
            "runtime.dispatch": dispatch if ep > GPUS_PER_NODE or dispatch != "hierarchical" else "all_to_all",
            "runtime.gpus_per_node": GPUS_PER_NODE, "runtime.capacity_factor": 1.0, "farskip.preset": preset,
            "runtime.micro_batches": micro_batches, "runtime.remat": "none", "runtime.compute_dtype": "bfloat16",
            "runtime.param_dtype": "bfloat16", "runtime.gmm": "auto", "runtime.attention_impl": "auto",
            "runtime.scan_layers": False}
    if num_experts:
        over["moe.num_experts"] = num_experts
    if layers is not None:
        over["model.num_layers"] = layers
    return replace(base, **over)


@dataclasses.dataclass
class CompiledPoint:
    schedule: object
    node_of: tuple
    program: str
    scores: int  # one GPU's attention score elements (prefill: its rows x heads x t x t)
    compile_s: float


def compile_dp_ep(cfg, program: str, rows_per_gpu: int, tokens: int, context: int = 0,
                  target: str = "h100_sxm") -> CompiledPoint:
    """The prefill (tokens = the prompt) or decode (tokens = 1, a `context`-slot cache) program of cfg
    on cfg.mesh.expert compile-only `target` GPUs, every GPU `rows_per_gpu` requests."""


    ep = cfg.mesh.expert
    mesh = ir.serving_mesh(cfg, gpu_devices(target, ep, gpus_per_node=min(GPUS_PER_NODE, ep), memory_gb=1e4))
    rows = rows_per_gpu * ep
    t0 = time.time()
    if program == "prefill":
        prog = ir.compile_serving(cfg, mesh, "prefill", rows, tokens, tokens)
    else:
        prog = ir.compile_serving(cfg, mesh, "decode", rows, 1, context)
    scores = rows_per_gpu * cfg.model.num_heads * tokens * tokens if program == "prefill" else 0
    return CompiledPoint(prog.schedule, ir.node_of(mesh), program, scores, time.time() - t0)


@dataclasses.dataclass
class DpEpTiming:
    """Modelled figures of one dp_ep program (us); every field is additive over layers."""

    time_us: float
    serial_us: float
    compute_us: float
    a2a_us: float
    a2a_hidden_us: float

    def scaled(self, f: float) -> "DpEpTiming":
        return DpEpTiming(*(x * f for x in dataclasses.astuple(self)))


def time_dp_ep(c: CompiledPoint, hardware: str = "h100_sxm", which: Optional[tuple] = None,
               imbalance: float = 1.0, contention: Optional[float] = None) -> DpEpTiming:
    """Re-time a compiled point on `hardware` with the fitted constants (which: (Hardware fields, Links
    fields) {name: "low" | "high"}, calibration.SPREAD; None: central); imbalance: the busiest
    device's expert load / the mean (cost_model.simulate); contention: replaces the fitted one of
    compute and communication (1.0: none; a diagnostic, never a fit)."""

    which = which or ({}, {})
    fitted = load_fitted()
    nodes = tuple(c.node_of)
    topo = Topology(resized(links_from_fit(hardware, fitted, which[1]), max(nodes.count(x) for x in set(nodes))),
                    nodes)
    hw = with_contention(hardware_from_fit(hardware, fitted, which[0]), contention)
    sched = c.schedule
    proxy = frozenset(o.id for o in sched.ops if o.kind == "compute" and USED_EXPERTS in (o.op_name or ""))
    if c.program == "prefill" and c.scores:
        sched = flash_scores(sched, c.scores)
    kw = dict(topology=topo, fused_attention=c.program == "prefill", in_place_updates=True, imbalance=imbalance,
              free=OptimizerStep(ops=proxy, pairs=frozenset()) if proxy else None)
    s, durs = simulate(sched, hw, **kw)
    rep = analyze(s, durs, kinds=ALL_TO_ALLS, with_bound=False)
    serial, _ = simulate(sched, hw, serialize=ALL_TO_ALLS, **kw)
    tot = rep.totals("all")
    return DpEpTiming(rep.step_time, serial.makespan, rep.compute_time, tot["duration"], tot["hidden"])


def extrapolate(a: DpEpTiming, la: int, b: DpEpTiming, lb: int, layers: int) -> DpEpTiming:
    """Figures at `layers` from compiles at la < lb layers: a + (b - a)(layers - la)/(lb - la)."""
    f = (layers - la) / (lb - la)
    return DpEpTiming(*(x + (y - x) * f for x, y in zip(dataclasses.astuple(a), dataclasses.astuple(b))))


# ---- a study's results (farskip_jax/studies/compare_dp_ep.py: results.json) ------------------------------------
# point = {program, ep, rows_per_gpu, tokens, variants: {variant: {depth: {constant set: DpEpTiming fields}}}}


def at_depth(per_depth: dict, depths: list, layers: int, key: str = "central") -> dict:
    """One variant's timing fields at `layers` (linear in the layer count from the two depths)."""
    la, lb = depths
    a, b = per_depth[str(la)][key], per_depth[str(lb)][key]
    f = (layers - la) / (lb - la)
    return {k: a[k] + (b[k] - a[k]) * f for k in a}


def speedups(pt: dict, depths: list, layers: int, key: str = "central") -> dict:
    """{row: throughput over the no-overlap standard} of one point under one constant set."""
    t = {v: at_depth(pt["variants"][v], depths, layers, key) for v in pt["variants"]}
    base = t["standard"]["serial_us"]
    out = {"no_overlap": 1.0}
    out.update({v: base / t[v]["time_us"] for v in t})
    return out


def point_rows(pt: dict, depths: list, layers: int) -> dict:
    """{row: {central, low, high, dominant, and each diagnostic set (e.g. no_contention)}}, with ranges
    over the constants' spread; "_standard": the no-overlap step (ms) and its all-to-all share."""
    every = list(next(iter(pt["variants"].values()))[str(depths[0])])
    keys = [k for k in every if not k.startswith("diag:")]  # diagnostics: reported apart, not in the range
    per = {k: speedups(pt, depths, layers, k) for k in every}
    rows = {}
    for r, c in per["central"].items():
        vals = {k: per[k][r] for k in keys}
        swing = {}
        for k, x in vals.items():
            if ":" in k:
                swing.setdefault(k.split(":")[0], []).append(x)
        dom = max(swing, key=lambda n: max(swing[n] + [c]) - min(swing[n] + [c])) if swing else ""
        rows[r] = {"central": c, "low": min(vals.values()), "high": max(vals.values()), "dominant": dom,
                   **{k[5:]: per[k][r] for k in every if k.startswith("diag:")}}
    t = at_depth(pt["variants"]["standard"], depths, layers)
    rows["_standard"] = {"time_ms": t["serial_us"] / 1e3, "a2a_share": t["a2a_us"] / t["serial_us"]}
    return rows

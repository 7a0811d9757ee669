"""Where FarSkip pays: expert parallelism across nodes (EP 8 -> 32), side by side with FoE.

    JAX_PLATFORMS=cpu python -m farskip_jax.studies.multinode_scaling [--model dsv3_6l|dsv2_lite] [--ep 8,16,32]
        [--per-gpu-batch 1] [--seq 4096] [--variants standard,farskip,foe,foe_farskip] [--programs train]
        [--gpus-per-node 8] [--data 1] [--hardware mi325x] [--target h200 --memory-gb 256]
        [--lever NAME] [--out benchmarks/results/multinode] [--plot-only] [config overrides ...]

For each EP size it compiles the program deviceless for EP x data GPUs on EP*data/gpus_per_node
hosts (jax 0.10.2 topologies 1x1x8, 1x2x8, 1x4x8), with the latency-hiding scheduler on, and re-times
XLA's schedule with the two-stream model on a multi-node topology (analysis/topology.py: MI325X
Infinity Fabric inside a node, 8 x 400 Gb/s NICs per node). Variants (each its own compile):

  standard      standard connectivity; its step "as XLA overlaps it", and the same schedule re-timed
                with every all-to-all synchronous: "no overlap" (the paper's Megatron baseline)
  farskip       FarSkip-Collective connectivity
  foe           Federation of Experts with H = nodes groups (runtime.num_groups), standard connectivity:
                each group's all-to-all stays inside one node, a cross-group all-reduce per layer
  foe_farskip   both
  + ceiling     standard's step with every all-to-all microsecond hidden (no compile)

The routed experts are traced as a grouped GEMM's cost proxy (programs.grouped_gemm_proxy: a
deviceless compile would otherwise expand ragged_dot over every local expert, 32x the FLOPs at EP 8,
8x at EP 32). Results go to OUT/results.json (updated after every compile; an existing entry is
reused, so an interrupted sweep resumes), OUT/table.md and OUT/scaling.png.

Levers (--lever, each alone on top of the defaults; docs/multinode.md):
  none          all_to_all dispatch, capacity factor 1.0 (bytes = the useful bytes at balance), bf16
  dropless      all_to_all with capacity_factor=null: worst-case buffers (E/k times the bytes)
  ragged        ragged_all_to_all: exact bytes (dropless)
  causal_blocks cheaper attention core (runtime.attention_impl=causal_blocks)
  limit1        one collective in flight (xla_gpu_experimental_parallel_collective_overlap_limit=1)
  limit4        four collectives in flight
  chunks2/4     token chunking inside a layer: each device's tokens in 2 / 4 chunks with their own
                dispatch, experts and combine (parallel/ep.AllToAllCompute.chunks), so the all-to-all
                of chunk i+1 can run under the experts of chunk i (MaxText's num_moe_token_chunks)
  fp8_dispatch  the dispatch payload sent as float8_e4m3fn (DeepSeek-V3's fp8 dispatch), combine bf16
  chunks4_fp8   both
  foe_sharded   FoE only (standard / farskip reuse `none`): runtime.foe_tokens=sharded, tokens split over the
                FoE device groups between the groups' sub-blocks (parallel/foe.py): the cross-group sums
                are reduce-scatters, the dense parts (dense MLP, LM head, most shared experts) run once
  foe_local     foe_sharded + runtime.foe_attention=local: where every group reads the same attention input
                (FarSkip layers, layer 0) the attention runs on the own tokens, all heads: no cross-group
                sum or gather for it (a FarSkip FoE layer: one reduce-scatter + one all-gather, not two)
  foe_fp8       foe_sharded + runtime.foe_sum_dtype=float8_e4m3fn (per-token scaled fp8 sums and gathers)
  foe_local_fp8 both; foe_local_h8: foe_local with H = 8 groups instead of H = nodes
  --foe-groups strided  re-times the FoE compiles with group g = the ranks r % G == g (each sum
                inside a node, each group's all-to-all across the nodes) instead of one group per
                node: the same program (tests/test_multinode_compile.py), another device assignment
  hierarchical  node-deduplicated dispatch (runtime.dispatch=hierarchical, parallel/ep.HierarchicalCompute):
                a token crosses to each destination node once (all-to-all among the same-local-rank
                GPUs of the nodes), then an intra-node all-to-all forwards it to its experts' GPUs
Cost-model levers re-time the cached compiles: --streams, --attention, --accum, --nic-gbps, --inter-eff,
--contention (compute speed under a collective in flight; default the hardware's, cost_model.HARDWARE).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Optional

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from farskip_jax.studies.harness import (MODEL_OVERRIDES, MODELS, CompileCache, ResultStore, contention_error, fail,
                                          figure, grid, log, md_header, model_config_path, results_dir)
from farskip_jax.analysis.overlap import run_overlap
from farskip_jax.analysis.cost_model import HARDWARE, optimizer_step, simulate, with_contention
from farskip_jax.analysis.report import ALL_TO_ALLS, analyze
from farskip_jax.analysis.topology import LINKS, SUM_ALL_TO_ALL, Topology, resized
import dataclasses
from farskip_jax.analysis.topology import SUM_ALL_TO_ALL
from farskip_jax.analysis.report import ALL_TO_ALLS
from farskip_jax.config import replace
from farskip_jax.parallel.foe import foe_device_order
from farskip_jax.analysis.deviceless import LHS_FLAGS, preset_options
from farskip_jax.config import load_config
from farskip_jax.analysis.topology import GBIT

# the paper's Figure 5 (arXiv 2511.11505, DeepSeek-V3 cut to 6 layers, Megatron on MI325X nodes, 400 Gb/s
# between nodes): FarSkip step speedup over the baseline without overlap
PAPER = {8: 1.10, 32: 1.22}
# XLA's own 30 MiB combine thresholds for reduce-scatter / all-gather instead of the preset's 128 MiB
# (set for FSDP weight gathers): combining an attention sum with the routed sum would make FarSkip's
# next attention wait for the experts
_FOE_FLAGS = {"xla_gpu_reduce_scatter_combine_threshold_bytes": 30 << 20,
              "xla_gpu_all_gather_combine_threshold_bytes": 30 << 20}
LEVERS = {
    "none": ([], {}),
    "dropless": (["runtime.capacity_factor=null"], {}),
    "ragged": (["runtime.dispatch=ragged", "runtime.capacity_factor=null"], {}),
    "causal_blocks": (["runtime.attention_impl=causal_blocks"], {}),
    "limit1": ([], {"xla_gpu_experimental_parallel_collective_overlap_limit": 1}),
    "chunks2": ([], {}),
    "chunks4": ([], {}),
    "fp8_dispatch": ([], {}),
    "chunks4_fp8": ([], {}),
    "limit4": ([], {"xla_gpu_experimental_parallel_collective_overlap_limit": 4}),
    "hierarchical": (["runtime.dispatch=hierarchical"], {}),
    "foe_sharded": (["runtime.foe_tokens=sharded"], _FOE_FLAGS),
    # + token-local attention where every group reads the same input (FarSkip layers, layer 0): one
    # cross-group reduce-scatter + all-gather per FarSkip layer instead of two
    "foe_local": (["runtime.foe_tokens=sharded", "runtime.foe_attention=local"], _FOE_FLAGS),
    # + per-token scaled fp8 payloads of the cross-group sums / gathers (runtime.foe_sum_dtype)
    "foe_fp8": (["runtime.foe_tokens=sharded", "runtime.foe_sum_dtype=float8_e4m3fn"], _FOE_FLAGS),
    "foe_local_fp8": (["runtime.foe_tokens=sharded", "runtime.foe_attention=local", "runtime.foe_sum_dtype=float8_e4m3fn"],
                      _FOE_FLAGS),
    # H = 8 groups of half a node each (instead of H = nodes), with local attention
    "foe_local_h8": (["runtime.foe_tokens=sharded", "runtime.foe_attention=local"], _FOE_FLAGS),
}
# levers that change only the FoE variants: standard / farskip are lever `none`'s compiles
FOE_ONLY_LEVERS = {"foe_sharded", "foe_local", "foe_fp8", "foe_local_fp8", "foe_local_h8"}
# FoE group count per lever (default H = nodes)
FOE_GROUPS = {"foe_local_h8": 8}
EP_OPTIONS = {"chunks2": {"chunks": 2}, "chunks4": {"chunks": 4}, "fp8_dispatch": {"dispatch_dtype": "float8_e4m3fn"},
              "chunks4_fp8": {"chunks": 4, "dispatch_dtype": "float8_e4m3fn"}}
VARIANTS = ("standard", "farskip", "foe", "foe_farskip")


def key(model, lever, ep, data, batch, seq, program, variant):
    return f"{model}|{lever}|ep{ep}|dp{data}|b{batch}|s{seq}|{program}|{variant}"


def compile_one(cfg, variant, program, batch, seq, n, gpus_per_node, nodes, flags, target, memory_gb, log,
                ep_options=None, groups=None) -> dict:
    """Compile one variant deviceless (FoE with `groups` groups, default H = nodes); returns what the
    analysis needs (picklable)."""

    (r,) = run_overlap(cfg, (variant,), (program,), batch=batch, seq=seq, target=target, num_devices=n, flags=flags,
                       hardware=None, log=log, gpus_per_node=min(gpus_per_node, n), memory_gb=memory_gb,
                       grouped_gemm=True, cfg_for=cfg_for_variant(groups or nodes), ep_options=ep_options,
                       probe_latency=False)
    return {"schedule": r.schedule, "node_of": tuple(int(d.process_index) for d in r.mesh.devices.flat),
            "compile_s": r.compile_s, "xla_step_us": r.report.step_time, "peak_memory": r.report.peak_memory,
            "nodes": nodes}


def entry_of(c: dict, hardware: str, links_over: dict, streams: str, fused_attention: bool = True,
             steady: bool = True, retime_gpus_per_node: Optional[int] = None, placement=None,
             contention: Optional[float] = None) -> dict:
    """The figures of one compiled variant: its schedule re-timed by the two-stream model on the
    multi-node topology, as XLA scheduled it and with every all-to-all synchronous (no overlap).
    placement: (device groups, "strided") re-times a contiguous FoE compile with the strided group
    placement (logical device p on plain position foe_device_order(...).flat[p]). contention: compute
    speed while a collective is in flight (default the hardware's)."""

    nodes = c["node_of"]
    if retime_gpus_per_node:  # the same program on nodes of another size (XLA's schedule ignores hosts)
        nodes = tuple(i // retime_gpus_per_node for i in range(len(nodes)))
    if placement is not None:

        gm, data, how = placement
        order = foe_device_order((data, 1, len(nodes) // data, 1), gm, how).reshape(-1)
        nodes = tuple(nodes[int(q)] for q in order)
    per = max(nodes.count(x) for x in set(nodes))
    topo = Topology(resized(LINKS[hardware], per, **links_over), nodes)
    hw = with_contention(HARDWARE[hardware], contention)
    own = ("all-reduce", "all-gather", "reduce-scatter", SUM_ALL_TO_ALL) if streams == "split" else ()
    sched = foe_sums_relabelled(c["schedule"])
    kw = dict(topology=topo, own_stream=own, fused_attention=fused_attention,
              free=optimizer_step(sched) if steady else None)
    s_m, d_m = simulate(sched, hw, **kw)
    m = analyze(s_m, d_m)
    s_s, _ = simulate(sched, hw, serialize=ALL_TO_ALLS, **kw)
    a2a = [p for p in sched.pairs if p.collective in ALL_TO_ALLS]
    tot = m.totals("all")
    return {
        "step_us": m.step_time, "no_overlap_us": s_s.makespan, "ceiling_us": m.ceiling_step(),
        "compute_us": m.compute_time, "a2a_us": tot["duration"], "a2a_hidden_us": tot["hidden"],
        "a2a_exposed_us": tot["exposed"], "a2a_count": tot["count"],
        "hidden_fwd": m.totals("fwd")["hidden_frac"], "hidden_bwd": m.totals("bwd")["hidden_frac"],
        "bound_fwd": m.totals("fwd")["bound_frac"], "bound_bwd": m.totals("bwd")["bound_frac"],
        "other_coll_exposed_us": m.other_exposed, "a2a_bytes": sum(p.bytes for p in a2a),
        "a2a_cross_node_fraction": max((topo.crossing_fraction(p.groups) for p in a2a), default=0.0),
        "a2a_nic_bytes": nic_bytes(a2a, nodes),
        "other_coll_us": sum(d for p, d in zip(sched.pairs, d_m) if p.collective not in ALL_TO_ALLS),
        "other_coll_cross_node_fraction": _other_cross(sched.pairs, d_m, nodes),
        "foe_sum_us": sum(d for p, d in zip(sched.pairs, d_m) if _is_foe_sum(p)),
        "foe_sum_exposed_us": sum(max(p.done.end - p.done.start, 0.0) for p in s_m.pairs if _is_foe_sum(p)),
        "nodes": len(set(nodes)), "compile_s": c["compile_s"], "xla_step_us": c["xla_step_us"],
        "peak_memory_gib": c["peak_memory"] / 2**30, "contention": hw.contention,
        "contention_us": m.contention_time,
    }


def _is_foe_sum(p) -> bool:
    """A cross-group sum / gather of FoE (model/foe.py scopes group_sum, group_gather), either direction."""
    return "group_sum" in (p.start.op_name or "") or "group_gather" in (p.start.op_name or "")


def foe_sums_relabelled(sched):
    """The schedule with FoE's cross-group all-to-alls (scopes group_sum / group_gather: the fp8
    reduce-scatters, parallel/foe.fp8_reduce_scatter, forward sums and the backward of the fp8
    gathers; the routing redistributed over the groups) labelled SUM_ALL_TO_ALL: priced as
    all-to-alls, but on the sums' stream and not counted as the dispatch / combine all-to-alls
    (hidden fractions, the no-overlap baseline)."""


    pairs = [dataclasses.replace(p, collective=SUM_ALL_TO_ALL) if p.collective == "all-to-all" and _is_foe_sum(p)
             else p for p in sched.pairs]
    return sched if pairs == sched.pairs else dataclasses.replace(sched, pairs=pairs)


def _other_cross(pairs, durations, node_of) -> float:
    """Share of the non-all-to-all collective time (modelled) whose replica groups span nodes."""

    tot = cross = 0.0
    for p, d in zip(pairs, durations):
        if p.collective in ALL_TO_ALLS:
            continue
        tot += d
        groups = p.groups or (tuple(range(len(node_of))),)
        if any(len({node_of[x] for x in g}) > 1 for g in groups):
            cross += d
    return cross / tot if tot else 0.0


def nic_bytes(pairs, node_of) -> float:
    """Bytes one GPU sends through its NIC in these all-to-alls (the busiest member of each): an
    all-to-all of P bytes per device over a group of n sends P/n to each member."""
    tot = 0.0
    for p in pairs:
        groups = p.groups or (tuple(range(len(node_of))),)
        tot += max(p.bytes * sum(node_of[x] != node_of[d] for x in g) / len(g) for g in groups for d in g)
    return tot


def cfg_for_variant(groups):
    """variant -> config: the FarSkip preset, and FoE's `groups` (runtime.num_groups) for the FoE variants."""

    def fn(variant, cfg):
        preset = "farskip" if variant in ("farskip", "foe_farskip") else "standard"
        over = {"farskip.preset": preset}
        if variant.startswith("foe"):
            over["runtime.num_groups"] = groups
        return replace(cfg, **over)

    return fn


def rows_of(results: dict, model: str, lever: str, program: str) -> list[dict]:
    """One row per (ep, data, batch, seq) with every variant present."""
    groups: dict = {}
    for k, e in results.items():
        m, lv, ep, dp, b, s, prog, var = k.split("|")
        if m != model or lv != lever or prog != program:
            continue
        groups.setdefault((int(ep[2:]), int(dp[2:]), int(b[1:]), int(s[1:])), {})[var] = e
    rows = []
    for (ep, dp, b, s), v in sorted(groups.items()):
        if "standard" not in v:
            continue
        std = v["standard"]
        row = {"ep": ep, "data": dp, "batch": b, "seq": s, "nodes": std["nodes"], "no_overlap_ms": std["no_overlap_us"] / 1e3,
               "a2a_share": std["a2a_us"] / std["no_overlap_us"], "cross": std["a2a_cross_node_fraction"], "nic_gb": std.get("a2a_nic_bytes", float("nan")) / 1e9,
               "standard_ms": std["step_us"] / 1e3, "ceiling_ms": std["ceiling_us"] / 1e3}
        for var in VARIANTS:
            if var in v:
                row[f"{var}_ms"] = v[var]["step_us"] / 1e3
        if std["nodes"] == 1:  # FoE with H = nodes = 1 is the ordinary MoE
            row.setdefault("foe_ms", row["standard_ms"])
            if "farskip_ms" in row:
                row.setdefault("foe_farskip_ms", row["farskip_ms"])
        for var in ("standard", "ceiling") + VARIANTS:
            if f"{var}_ms" in row:
                row[f"{var}_vs_noov"] = row["no_overlap_ms"] / row[f"{var}_ms"]
                row[f"{var}_vs_std"] = row["standard_ms"] / row[f"{var}_ms"]
        row["fs_hidden"] = (v["farskip"]["hidden_fwd"], v["farskip"]["hidden_bwd"]) if "farskip" in v else None
        row["std_hidden"] = (std["hidden_fwd"], std["hidden_bwd"])
        rows.append(row)
    return rows


def table_md(rows: list[dict], title: str, base: Optional[list[dict]] = None) -> str:
    """Markdown table of rows_of(); `base` = the rows of lever `none`: adds farskip's speedup over
    the default (bf16, one exchange) no-overlap standard, i.e. the lever and FarSkip together."""
    cols = [("standard", "standard (XLA overlap)"), ("farskip", "farskip"), ("foe", "FoE H=nodes"),
            ("foe_farskip", "FoE + farskip"), ("ceiling", "ceiling")]
    out = [f"### {title}", "",
           "Step time (ms) and speedup over standard WITHOUT overlap (the paper's baseline) / over XLA's "
           "overlapped standard.", "",
           *md_header(["EP", "GPUs (nodes)", "batch x seq", "a2a share", "cross-node", "NIC GB/GPU", "no overlap"]
                      + [c for _, c in cols] + ["paper farskip"]
                      + (["farskip / `none` no overlap / `none` XLA standard"] if base else []))]
    base_of = {(r["ep"], r["data"], r["batch"], r["seq"]): r for r in base or []}
    for r in rows:
        cells = []
        for var, _ in cols:
            if f"{var}_ms" in r:
                cells.append(f"{r[f'{var}_ms']:.2f} ({r[f'{var}_vs_noov']:.3f}x / {r[f'{var}_vs_std']:.3f}x)")
            else:
                cells.append("-")
        paper = f"{PAPER[r['ep']]:.2f}x" if r["ep"] in PAPER and r["data"] == 1 else "-"
        out.append(f"| {r['ep']} | {r['ep'] * r['data']} ({r['nodes']}) | {r['batch']} x {r['seq']} | "
                   f"{100 * r['a2a_share']:.1f}% | {100 * r['cross']:.0f}% | {_gb(r['nic_gb'])} | {r['no_overlap_ms']:.2f} | "
                   + " | ".join(cells) + f" | {paper} |" + (_vs_base(r, base_of) if base else ""))
    hid = [f"EP {r['ep']}: standard {100 * r['std_hidden'][0]:.1f} / {100 * r['std_hidden'][1]:.1f}%"
           + (f", farskip {100 * r['fs_hidden'][0]:.1f} / {100 * r['fs_hidden'][1]:.1f}%" if r["fs_hidden"] else "")
           for r in rows]
    out += ["", "All-to-all time hidden, forward / backward: " + "; ".join(hid) + "."]
    return "\n".join(out)


def _gb(x: float) -> str:
    return "-" if x != x else f"{x:.2f}"


def tag_command(model: str, tag: str, layers: Optional[int] = None) -> str:
    """The command line of a results tag (lever + cost-model options, see main)."""
    lever, *opts = tag.split("+")
    flags = {"one_stream": "--streams one", "naive_attn": "--attention naive", "accum1": "--accum 1"}
    out = [f"--model {model}", "--ep EP [--data D] [--seq S]"] + ([f"--layers {layers}"] if layers else [])
    out += [] if lever == "none" else [f"--lever {lever}"]
    for o in opts:
        if o in flags:
            out.append(flags[o])
        elif o.startswith("nic"):
            out.append(f"--nic-gbps {o[3:]}")
        elif o.startswith("eff"):
            out.append(f"--inter-eff {o[3:]}")
        elif o.endswith("gpn"):
            out.append(f"--retime-gpus-per-node {o[:-3]}")
        elif o == "strided":
            out.append("--foe-groups strided")
    return "`JAX_PLATFORMS=cpu python -m farskip_jax.studies.multinode_scaling " + " ".join(out) + "`"


def _vs_base(r: dict, base_of: dict) -> str:
    b = base_of.get((r["ep"], r["data"], r["batch"], r["seq"]))
    if b is None or "farskip_ms" not in r:
        return " - |"
    return f" {b['no_overlap_ms'] / r['farskip_ms']:.3f}x / {b['standard_ms'] / r['farskip_ms']:.3f}x |"


def plot(rows: list[dict], path: str, title: str, seq: Optional[int] = None) -> None:
    """Speedups over no overlap against EP (pure expert-parallel rows of sequence length `seq`) and
    the step times, with the paper's points."""
    rows = [r for r in rows if r["data"] == 1 and (seq is None or r["seq"] == seq)]
    if not rows:
        return
    with figure(path, 1, 2, figsize=(12, 4.4), dpi=120) as (fig, axes):
        _plot_axes(rows, fig, *axes, title)


def _plot_axes(rows: list[dict], fig, ax, bx, title: str) -> None:
    eps = [r["ep"] for r in rows]
    style = {"standard": ("standard (XLA overlap)", "#8C8C8C", "o"), "farskip": ("farskip", "#C44E52", "s"),
             "foe": ("FoE H=nodes", "#4C72B0", "^"), "foe_farskip": ("FoE + farskip", "#8172B3", "D"),
             "ceiling": ("ceiling (every a2a hidden)", "#55A868", "x")}
    for var, (lab, col, mk) in style.items():
        pts = [(r["ep"], r[f"{var}_vs_noov"]) for r in rows if f"{var}_vs_noov" in r]
        if pts:
            ax.plot(*zip(*pts), marker=mk, color=col, label=lab, ls="--" if var == "ceiling" else "-")
    ax.plot(list(PAPER), list(PAPER.values()), "k*", ms=12, label="paper (Figure 5), farskip")
    ax.axhline(1.0, color="black", lw=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xticks(eps, [str(e) for e in eps])
    ax.set_xlabel("expert-parallel size (8 GPUs per node)")
    ax.set_ylabel("speedup over standard without overlap")
    ax.set_title("modelled step speedup", fontsize=10)
    ax.legend(fontsize=8)
    w = 0.8 / 5
    for i, (var, (lab, col, _)) in enumerate([("no_overlap", ("standard, no overlap", "#333333", "")),
                                              *[(v, style[v]) for v in VARIANTS]]):
        xs = [j + (i - 2) * w for j in range(len(rows))]
        ys = [r.get(f"{var}_ms", 0.0) for r in rows]
        bx.bar(xs, ys, width=w, color=col, label=lab)
    bx.set_xticks(range(len(rows)), [f"EP {r['ep']}\n{r['nodes']} node(s)" for r in rows])
    bx.set_ylabel("modelled step time (ms)")
    bx.set_title("step time", fontsize=10)
    bx.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="dsv3_6l", choices=sorted(MODELS))
    ap.add_argument("--layers", type=int, default=None, help="model.num_layers (default: the config's)")
    ap.add_argument("--ep", default="8,16,32")
    ap.add_argument("--data", type=int, default=1, help="data-parallel replicas (mixed data x expert meshes)")
    ap.add_argument("--per-gpu-batch", default="1", help="sequences per GPU, comma separated (a sweep)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--programs", default="train")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--hardware", default="mi325x")
    ap.add_argument("--target", default="h200")
    ap.add_argument("--memory-gb", type=float, default=256.0, help="MI325X's 256 GB (LHS memory limit)")
    ap.add_argument("--lever", default="none", choices=sorted(LEVERS))
    ap.add_argument("--out", default=results_dir("multinode"))
    ap.add_argument("--plot-only", action="store_true", help="rewrite table.md / scaling.png from results.json")
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "farskip_multinode_cache"),
                    help="compiled schedules (pickled) by key: a re-run re-times them without compiling")
    ap.add_argument("--streams", default="split", choices=("split", "one"),
                    help="split: gradient/FoE all-reduces on their own communication stream (NCCL/RCCL "
                         "communicators of Megatron's DP vs EP groups); one: every collective on one FIFO")
    ap.add_argument("--attention", default="fused", choices=("fused", "naive"),
                    help="fused: price each layer's attention core as one causal flash kernel per pass "
                         "(Megatron's TE/CK flash attention; analysis/attention_cost.py); naive: as compiled "
                         "([s, s] scores in HBM)")
    ap.add_argument("--contention", type=float, default=None,
                    help="compute speed while a collective is in flight, fraction (0, 1] (default: the hardware's, "
                         "cost_model.HARDWARE; 1.0 = no contention)")
    ap.add_argument("--accum", default="inf", choices=("inf", "1"),
                    help="inf: time per micro-batch in the steady state of gradient accumulation (gradient "
                         "reductions and the parameter update, once per step, priced at zero); 1: one "
                         "micro-batch per step, everything counted")
    ap.add_argument("--retime-gpus-per-node", type=int, default=None,
                    help="re-time the cached programs on nodes of this many GPUs (e.g. 4: EP 32 on 8 nodes x 4)")
    ap.add_argument("--nic-gbps", type=float, default=None, help="NIC line rate, Gb/s (default 400)")
    ap.add_argument("--inter-eff", type=float, default=None, help="achieved / NIC line rate (default 0.8)")
    ap.add_argument("--foe-groups", default="contiguous", choices=("contiguous", "strided"),
                    help="FoE group placement the FoE compiles are re-timed with (contiguous: a group per node)")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    if contention_error(a.contention):
        return fail(contention_error(a.contention))

    os.makedirs(a.out, exist_ok=True)
    results = ResultStore(os.path.join(a.out, "results.json"))
    if not a.plot_only:


        cache = CompileCache(a.cache)
        links_over = {}
        if a.nic_gbps:
            links_over["nic_bw"] = a.nic_gbps * GBIT
        if a.inter_eff:
            links_over["inter_eff"] = a.inter_eff
        lever_over, lever_flags = LEVERS[a.lever]
        tag = a.lever + ("+one_stream" if a.streams == "one" else "") + (f"+nic{a.nic_gbps:g}" if a.nic_gbps else "") \
            + (f"+eff{a.inter_eff:g}" if a.inter_eff else "") + ("+naive_attn" if a.attention == "naive" else "") \
            + ("+accum1" if a.accum == "1" else "") \
            + (f"+{a.retime_gpus_per_node}gpn" if a.retime_gpus_per_node else "") \
            + ("+strided" if a.foe_groups == "strided" else "") \
            + (f"+c{a.contention:g}" if a.contention is not None else "")
        flags = dict(preset_options("cuda_hopper"), **LHS_FLAGS, **lever_flags)
        for point in grid(b=[int(x) for x in a.per_gpu_batch.split(",")], ep=[int(x) for x in a.ep.split(",")]):
                b, ep = point["b"], point["ep"]
                n = ep * a.data
                nodes = max(1, n // a.gpus_per_node)
                over = [f"mesh.data={a.data}", f"mesh.expert={ep}", "runtime.dispatch=all_to_all",
                        "runtime.capacity_factor=1.0", f"model.max_seq_len={max(a.seq, 4096)}", "runtime.remat=none",
                        # unrolled layers: the two-stream model re-times the entry computation, and a
                        # scanned stack (the real-shape configs' default) hides its collectives in a while body
                        "runtime.scan_layers=false"]
                if a.layers:
                    over.append(f"model.num_layers={a.layers}")
                model_over = MODEL_OVERRIDES.get(a.model, [])
                cfg = load_config(model_config_path(a.model), over + model_over + lever_over + a.overrides)
                for prog in a.programs.split(","):
                    for var in a.variants.split(","):
                        foe_only = a.lever in FOE_ONLY_LEVERS and not var.startswith("foe")
                        # what was compiled (an FoE-only lever's standard / farskip: lever none's program)
                        k = key(a.model, "none" if foe_only else a.lever, ep, a.data, b * n, a.seq, prog, var)
                        rk = key(a.model, tag, ep, a.data, b * n, a.seq, prog, var)  # + how it was re-timed
                        if var.startswith("foe") and nodes == 1:
                            continue  # H = 1: the ordinary MoE (rows_of copies standard / farskip)
                        base_rk = key(a.model, tag.replace(a.lever, "none", 1).replace("+strided", ""), ep, a.data,
                                      b * n, a.seq, prog, var)
                        if (foe_only or (a.foe_groups == "strided" and not var.startswith("foe"))) \
                                and base_rk in results and base_rk != rk:
                            results[rk] = results[base_rk]  # the same program re-timed the same way
                            log(f"[multinode] {rk}: = {base_rk}")
                            continue
                        if var.startswith("foe") and cfg.model.attention == "mla":
                            log(f"[multinode] {k}: skipped (FoE needs GQA attention; use --model {a.model}_gqa)")
                            continue
                        c = cache.get(k)
                        if c is None:
                            t0 = time.time()
                            epo = None if var.startswith("foe") else EP_OPTIONS.get(a.lever)
                            c = compile_one(cfg, var, prog, b * n, a.seq, n, a.gpus_per_node, nodes, flags, a.target,
                                            a.memory_gb, log, ep_options=epo, groups=FOE_GROUPS.get(a.lever))
                            cache.put(k, c)
                            log(f"[multinode] {k}: compiled in {time.time() - t0:.0f}s")
                        gm = min(FOE_GROUPS.get(a.lever, nodes), ep)  # FoE device groups
                        place = (gm, a.data, "strided") if var.startswith("foe") and a.foe_groups == "strided" else None
                        results[rk] = entry_of(c, a.hardware, links_over, a.streams, a.attention == "fused",
                                               a.accum == "inf", a.retime_gpus_per_node, place, a.contention)
                        results.save()
                        e = results[rk]
                        log(f"[multinode] {rk}: step {e['step_us'] / 1e3:.2f} ms, no-overlap "
                            f"{e['no_overlap_us'] / 1e3:.2f} ms, a2a {e['a2a_us'] / 1e3:.2f} ms "
                            f"({100 * e['a2a_hidden_us'] / max(e['a2a_us'], 1e-9):.1f}% hidden), other collectives "
                            f"waited {e['other_coll_exposed_us'] / 1e3:.2f} ms")
    md = [f"# Multi-node scaling (modelled): {a.model}, two-stream {a.hardware} model on a topology of "
          f"{a.gpus_per_node} GPUs per node", "",
          "Modelled (deviceless compiles re-timed on a multi-node topology; docs/multinode.md). "
          "Entries of results.json timed before 2026-12-07 are **pre-calibration** (the cost model's constants "
          "before they were fitted to component measurements; docs/calibration.md). "
          "Speedups: over standard WITHOUT overlap of the same lever / over XLA's overlapped standard. "
          "Each table names the command of its rows (EP, data-parallel size D, sequence length S: the "
          "row's columns).", ""]
    for prog in a.programs.split(","):
        for lever in sorted({k.split("|")[1] for k in results}):
            rows = rows_of(results, a.model, lever, prog)
            if rows:
                base = rows_of(results, a.model, "none", prog) if lever != "none" else None
                md += [table_md(rows, f"{prog}, lever `{lever}`", base), "",
                       f"Reproduce a row: {tag_command(a.model, lever, a.layers)}", ""]
                if lever == a.lever:
                    plot(rows, os.path.join(a.out, f"scaling_{a.model}_{prog}_{lever}.png"),
                         f"{a.model} {prog} (lever {lever}): two-stream {a.hardware}, 8 x 400 Gb/s NICs per node", a.seq)
    with open(os.path.join(a.out, f"table_{a.model}.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())

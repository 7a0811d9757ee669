"""Overlap report: how much all-to-all time XLA hides under compute, standard vs FarSkip.

    python -m farskip_jax.analysis.overlap --config configs/deepseek_v2_lite.yaml \
        --batch 8 --seq 4096 --programs forward,train --target h100_sxm [--hardware mi300x|none] \
        --out runs/overlap [--verbose] [--contention 0.8] [--contention-sweep 1,0.9,0.8,0.7]
        [--attention fused|naive] [key=value config overrides ...]

For each connectivity preset (default: standard, farskip) and program (forward, train step) it
compiles the real model deviceless for an 8-GPU topology with the latency-hiding scheduler on, and
reports every all-to-all (layer, dispatch/combine, fwd/bwd,
MB, modelled duration, hidden time, the named scopes that ran inside it, the compute independent
of it), totals side by side (hidden fraction, structural bound, hidden/bound, modelled step time,
speedup) under two cost models: the two-stream model (cost_model.py, --hardware, default mi300x),
which prices kernels at roofline, each layer's attention core as one flash kernel per pass
(--attention fused, analysis/attention_cost.py) and compute under a collective in flight at the
hardware's contention (--contention), and gives the headline figures and the pictures, and XLA's own
deviceless model (printed after it for reference: it rates the routed experts' ragged_dot and the
naive attention scores tens of times too high; a WARNING says when the two disagree by more than
2x on compute). Writes report.json and one timeline picture per program (standard above farskip,
on the headline model's timeline) into --out. Every speedup is split into the part from hiding
communication and the part from compute that differs between the programs (analysis/speedup.py).

Scanned programs (runtime.scan_layers, the real configs' default) are analysed as compiled: their
layers sit in while loops, which analysis/loop_schedule.py unrolls as executed (each body's schedule
repeated trip-count times, the iterations linked by their carry, backward loops last layer first);
the report says which program it analysed ("program analysed: scanned ..." / "unrolled ...";
report.json `program_layout`, `layer_loops`).

Serving programs (prefill / decode on the paper's all-reduce layout, inference.layout=tp_ep) have no
all-to-all; their report (all-reduce hidden fraction, TTFT / time per output token, standard vs
FarSkip) is analysis/inference_report.py (`python -m farskip_jax.analysis.inference_report`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from typing import Optional, Sequence
import glob
import tempfile

from farskip_jax.analysis.cli_checks import check_out_folder, number_list
from farskip_jax.analysis.deviceless import (LHS_FLAGS, collective_durations, compile_deviceless, gpu_devices,
                                             preset_options)
from farskip_jax.analysis.report import (ALL_TO_ALLS, OverlapReport, analyze, format_collectives,
                                         format_side_by_side)
from farskip_jax.kernels.gmm import resolve_backend
from farskip_jax.analysis.cost_model import HARDWARE, simulate, with_contention
from farskip_jax.analysis.groups import foe_json, foe_summary, format_foe_summary
from farskip_jax.analysis.loop_schedule import layer_loops, load_unrolled_schedule
from farskip_jax.analysis.programs import analysis_mesh, forward_program, grouped_gemm_proxy, train_program
from farskip_jax.analysis.sensitivity import (bandwidth_sweep, contention_sweep, format_contention_sweep, format_sweep,
                                              implied_bandwidth)
from farskip_jax.analysis.speedup import split_lines, split_speedup
from farskip_jax.analysis.timeline import plot_layer_timelines
from farskip_jax.analysis.topology import LINKS, Topology
from farskip_jax.config import load_config, replace
from farskip_jax.connectivity.layer_sets import PRESETS as CONNECTIVITY
from farskip_jax.errors import ConfigError, FarSkipError

PROGRAMS = ("forward", "train")


def _parse_value(v: str):
    low = v.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(v)
    except ValueError:
        try:
            return float(v)
        except ValueError:
            return v


@dataclasses.dataclass
class ProgramResult:
    preset: str
    program: str
    report: OverlapReport
    modelled: Optional[OverlapReport]  # under the two-stream cost model (--hardware)
    schedule: object
    compile_s: float
    serial: Optional[OverlapReport] = None  # two-stream model with every all-to-all synchronous (no overlap)
    hlo_text: str = ""  # the compiled module (replica groups: analysis/groups.py)
    mesh: object = None
    modelled_schedule: object = None  # the schedule re-timed by the two-stream model (`modelled`'s timeline)
    hardware: Optional[str] = None
    topology: object = None  # analysis/topology.Topology the two-stream model priced collectives with
    layer_loops: tuple = ()  # loop_schedule.LayerLoop of a scanned program (its while loops over layers); () = unrolled
    contention: Optional[float] = None  # the two-stream model's compute speed under a collective in flight
    fused_attention: bool = True  # the two-stream model priced attention_core as flash kernels

    @property
    def layout(self) -> str:
        """Which program was analysed: 'scanned' (runtime.scan_layers: the layers' while loops, unrolled
        for the analysis by analysis/loop_schedule.py) or 'unrolled' (a Python loop over layers)."""
        return "scanned" if self.layer_loops else "unrolled"

    def describe_layout(self) -> str:
        if not self.layer_loops:
            return "unrolled (the layers as a Python loop: every layer in the entry computation)"
        loops = ", ".join(f"{lp.direction} layers {lp.layers.start}-{lp.layers.stop - 1} ({lp.trips} x {lp.period})"
                          for lp in self.layer_loops)
        return (f"scanned (runtime.scan_layers): {len(self.layer_loops)} while loops over layers [{loops}], read "
                "with each body's schedule repeated trip-count times (analysis/loop_schedule.py)")

    @property
    def headline(self) -> tuple[OverlapReport, object, str]:
        """(report, timed schedule, model name) the pictures and headline figures come from: the
        two-stream model when it ran (XLA's deviceless model misprices ragged_dot and the naive
        attention scores by tens of times, docs/overlap.md), else XLA's own."""
        if self.modelled is not None and self.modelled_schedule is not None:
            return self.modelled, self.modelled_schedule, f"two-stream {self.hardware or 'model'}"
        return self.report, self.schedule, "XLA"


def run_overlap(cfg, presets: Sequence[str] = ("standard", "farskip"), programs: Sequence[str] = PROGRAMS,
                batch: Optional[int] = None, seq: Optional[int] = None, target: str = "h100_sxm",
                num_devices: int = 8, flags: Optional[dict] = None, hardware: Optional[str] = None,
                log=None, gpus_per_node: Optional[int] = None, memory_gb: Optional[float] = None,
                links=None, grouped_gemm: bool = False, cfg_for=None, ep_options: Optional[dict] = None,
                probe_latency: bool = True, contention: Optional[float] = None,
                fused_attention: bool = True) -> list[ProgramResult]:
    """Compile and analyse every (preset, program); `log(msg)` receives progress lines.

    flags: compile options (default: the cuda_hopper preset + LHS_FLAGS).
    gpus_per_node: split the num_devices GPUs over hosts of this many (topology 1 x nodes x gpus).
    memory_gb: the target's device memory (LHS stops overlapping past its memory limit).
    links: a topology.Links (or a key of topology.LINKS): the two-stream model prices collectives by
      which members share a node (analysis/topology.py); default LINKS[hardware] on several nodes.
    grouped_gemm: trace ragged_dot as a grouped GEMM's cost proxy (programs.grouped_gemm_proxy).
    cfg_for(preset, cfg) -> cfg: per-preset config (e.g. FoE's runtime.num_groups); default sets the preset.
    ep_options: all_to_all backend fields, e.g. {"chunks": 2} (programs.abstract_model).
    probe_latency: XLA's all-to-all latencies by compiling each distinct shape alone (deviceless
      .collective_durations); False takes the start-to-done windows (XLA's report only; faster).
    contention: the two-stream model's compute speed while a collective is in flight (default: the
      hardware's, cost_model.HARDWARE); fused_attention: attention_core as flash kernels (else as compiled)."""
    bad = [p for p in programs if p not in PROGRAMS]
    if bad:
        raise ConfigError(f"programs {bad} are unknown; choose from {list(PROGRAMS)}")
    if (batch is not None and batch < 1) or (seq is not None and seq < 1):
        raise ConfigError(f"batch={batch}, seq={seq}: each must be >= 1 (None: the config's train.batch_size / seq_len)")
    if hardware and hardware not in HARDWARE:
        raise ConfigError(f"hardware {hardware!r} is unknown; choose one of {sorted(HARDWARE)} (None: XLA's model only)")
    log = log or (lambda m: None)
    hw = with_contention(HARDWARE[hardware], contention) if hardware else None
    if flags is None:
        flags = dict(preset_options("cuda_hopper"), **LHS_FLAGS)
    batch = batch or cfg.train.batch_size
    seq = seq or cfg.train.seq_len
    devices = gpu_devices(target, num_devices, gpus_per_node=gpus_per_node, memory_gb=memory_gb)
    multinode = len({d.process_index for d in devices}) > 1
    if isinstance(links, str):
        links = LINKS[links]
    if links is None and hardware and multinode:
        links = LINKS[hardware]
    cfg_for = cfg_for or (lambda p, c: replace(c, **{"farskip.preset": p}))
    if grouped_gemm:
        log("[overlap] ragged_dot traced as a grouped-GEMM cost proxy (useful FLOPs; analysis only)")
    elif cfg.moe.num_experts and resolve_backend(cfg.runtime.gmm, "cuda") == "ragged_dot":
        log(f"[overlap] NOTE: the routed experts run ragged_dot (runtime.gmm={cfg.runtime.gmm}). A deviceless compile has "
            "no cuDNN / hipBLASLt grouped GEMM, so XLA expands it to a dense dot over every local expert "
            "(E/EP x the expert FLOPs): hidden fractions stand, modelled step times are inflated and step "
            "speedups understated. runtime.gmm=tiled prices the experts at their useful FLOPs (docs/overlap.md).")
    results = []
    for preset in presets:
        c = cfg_for(preset, cfg)
        mesh = analysis_mesh(c, devices)
        topo = Topology.of_mesh(links, mesh) if links is not None else None
        for prog in programs:
            build = {"forward": forward_program, "train": train_program}[prog]
            t0 = time.time()
            log(f"[overlap] compiling {prog} ({preset}, batch {batch} x seq {seq}, {target} x{num_devices}"
                f"{f' over {len({d.process_index for d in devices})} nodes' if multinode else ''}, "
                f"mesh {dict(mesh.shape)}) ...")
            with grouped_gemm_proxy() if grouped_gemm else contextlib.nullcontext():
                fn, args = build(c, mesh, batch, seq, ep_options=ep_options)
                compiled, loops = compile_program(fn, args, flags)
            dt = time.time() - t0
            sched = compiled.schedule
            how = f"scanned, {len(loops)} layer loops unrolled: " if loops else ""
            log(f"[overlap]   compiled in {dt:.1f}s: {how}"
                f"{len(sched.ops)} ops, {len(sched.pairs)} async collectives; analysing ...")
            durs = (collective_durations(sched, devices, flags, target if target in HARDWARE else "h100_sxm")
                    if probe_latency else None)
            rep = analyze(sched, durs, label=preset)
            modelled = serial = sched_hw = None
            if hardware:
                ep = mesh.shape.get("expert", 1)
                # in_place_updates: a dynamic-update-slice moves its update (a scanned program writes each
                # layer's residuals / weight gradients into stacked buffers in place; the unrolled has none)
                kw = dict(topology=topo, in_place_updates=True, fused_attention=fused_attention)
                sched_hw, durs_hw = simulate(sched, hw, ep, **kw)
                modelled = analyze(sched_hw, durs_hw, label=f"{preset}@{hardware}")
                sched_s, durs_s = simulate(sched, hw, ep, serialize=ALL_TO_ALLS, **kw)
                serial = analyze(sched_s, durs_s, label=f"{preset}-no-overlap@{hardware}")
            results.append(ProgramResult(preset, prog, rep, modelled, sched, dt, serial,
                                         hlo_text=compiled.hlo_text, mesh=mesh, modelled_schedule=sched_hw,
                                         hardware=hardware, topology=topo, layer_loops=tuple(loops),
                                         contention=hw.contention if hw else None, fused_attention=fused_attention))
            log(f"[overlap]   done in {time.time() - t0:.1f}s")
    return results


def compile_program(fn, args, flags: dict):
    """(deviceless.CompiledProgram, [loop_schedule.LayerLoop]) of jitted fn(*args). A scanned program
    (while loops over layers) gets the schedule with those loops unrolled as executed
    (loop_schedule.load_unrolled_schedule(as_executed=True): the carry links the iterations, XLA's
    timestamps on one timeline); an unrolled one keeps hlo.load_schedule's entry schedule."""
    with tempfile.TemporaryDirectory(prefix="farskip_overlap_") as d:
        compiled = compile_deviceless(fn, *args, flags=flags, keep_dump=d)
        with open(sorted(glob.glob(os.path.join(d, "*.schedule.txt")), key=os.path.getmtime)[-1]) as f:
            text = f.read()
    loops = layer_loops(text)
    if loops:
        compiled = dataclasses.replace(compiled, schedule=load_unrolled_schedule(text, as_executed=True))
    return compiled, loops


def _middle_moe_layer(rep: OverlapReport) -> Optional[int]:
    layers = sorted({s.layer for s in rep.stats if s.layer is not None})
    return layers[len(layers) // 2] if layers else None


def no_overlap_step(rep: OverlapReport, serial: Optional[OverlapReport] = None) -> float:
    """Step time (us) of `rep`'s program with its all-to-alls synchronous (the paper's Megatron
    baseline): the two-stream model's serialised re-timing when given, else the step plus every
    all-to-all microsecond the schedule hid (XLA's model, whose timeline cannot be re-timed)."""
    return serial.step_time if serial is not None else rep.step_time + rep.totals("all")["hidden"]


def target_lines(reports: dict[str, OverlapReport], min_of_bound: float = 0.95, min_speedup: float = 1.11,
                 paper_hidden: float = 0.884, serial: Optional[OverlapReport] = None) -> list[str]:
    """PASS / FAIL verdicts of the overlap targets (farskip hides >= min_of_bound of its structural bound,
    speedup >= min_speedup) for one program: {preset: report} with 'standard' and 'farskip'.

    Next to the measured speedup: the ceiling (standard's step with every all-to-all microsecond
    hidden) and, clearly apart, farskip vs standard with no overlap at all (the paper's comparator;
    `serial` = standard re-timed with synchronous all-to-alls, else step + hidden time). Each speedup
    is split into hiding communication x compute difference (analysis/speedup.py), with a NOTE when
    the compute difference dominates."""
    fs, std = reports.get("farskip"), reports.get("standard")
    if fs is None:
        return []
    if not fs.totals("all")["count"]:  # nothing to hide: every verdict below would be vacuous
        ratio = f"; the step-time ratio farskip/standard {std.step_time / fs.step_time:.3f}x here is scheduling " \
                "and compute, not all-to-all overlap" if std is not None and fs.step_time else ""
        return [f"N/A farskip: the program holds no all-to-all, so there is nothing for FarSkip to hide and the "
                f"overlap targets do not apply{ratio}. {NO_ALL_TO_ALL_FIX}"]
    out = []
    for d in ("fwd", "bwd"):
        t = fs.totals(d)
        if not t["count"]:
            continue
        ok = t["of_bound"] >= min_of_bound
        out.append(f"{'PASS' if ok else 'FAIL'} farskip {d}: hidden {100 * t['hidden_frac']:.1f}% = "
                   f"{100 * t['of_bound']:.1f}% of the structural bound (target >= {100 * min_of_bound:.0f}%)")
        if t["bound_frac"] >= paper_hidden:
            ok = t["hidden_frac"] >= paper_hidden
            out.append(f"{'PASS' if ok else 'FAIL'} farskip {d}: hidden {100 * t['hidden_frac']:.1f}% vs the "
                       f"paper's {100 * paper_hidden:.1f}% (bound allows {100 * t['bound_frac']:.1f}%)")
    empty = [s for s in fs.stats if s.hidden <= 1e-9]
    fwd_d = [s for s in fs.stats if s.direction == "fwd" and s.role == "dispatch"]
    bwd_c = [s for s in fs.stats if s.direction == "bwd" and s.role == "combine"]
    allowed = set()
    if fwd_d:
        first_layer = min(s.layer for s in fwd_d if s.layer is not None) if any(s.layer is not None for s in fwd_d) else None
        allowed |= {id(s) for s in fwd_d if s.layer == first_layer}
    if bwd_c:
        last_layer = max((s.layer for s in bwd_c if s.layer is not None), default=None)
        allowed |= {id(s) for s in bwd_c if s.layer == last_layer}
    bad = [s for s in empty if id(s) not in allowed]
    out.append(f"{'PASS' if not bad else 'FAIL'} farskip: {len(bad)} all-to-alls with nothing inside besides the "
               f"first dispatch / last combine-gradient" + (f" ({', '.join(s.name for s in bad[:5])})" if bad else ""))
    if std is not None and fs.step_time:
        sp = std.step_time / fs.step_time
        ceil = std.ceiling_speedup()
        out.append(f"{'PASS' if sp >= min_speedup else 'FAIL'} modelled step speedup farskip/standard "
                   f"{sp:.3f}x (target >= {min_speedup:.2f}x; ceiling if every all-to-all us of standard were "
                   f"hidden: {ceil:.3f}x = {std.step_time / 1e3:.2f} / ({std.step_time / 1e3:.2f} - "
                   f"{std.totals('all')['exposed'] / 1e3:.2f}) ms)")
        out.extend(split_lines(split_speedup(std, fs), "farskip / standard"))
        base = no_overlap_step(std, serial)
        how = "all-to-alls synchronous" if serial is not None else "step + all-to-all time it hid"
        out.append(f"INFO vs standard WITHOUT overlap ({how}, the paper's Megatron baseline; not XLA's "
                   f"overlapped standard): {base / 1e3:.2f} ms -> farskip {base / fs.step_time:.3f}x")
        if serial is not None:
            out.extend(split_lines(split_speedup(serial, fs), "farskip / standard without overlap",
                                   ref="standard without overlap"))
    return out


NO_ALL_TO_ALL_FIX = ("The expert-parallel all-to-alls need experts split over devices: add runtime.dispatch=all_to_all "
                     "mesh.data=1 mesh.expert=8 (or a real-shape config such as configs/deepseek_v2_lite.yaml)")


def has_all_to_alls(cfg) -> bool:
    """Whether cfg's programs exchange tokens between devices: routed experts split over mesh.expert > 1
    with an all-to-all dispatch (the training layout; the serving layouts are analysis/inference_report.py)."""
    return bool(cfg.moe.num_experts) and cfg.mesh.expert > 1 and cfg.runtime.dispatch != "local"


def to_json(results: Sequence[ProgramResult]) -> dict:
    out = {}
    for r in results:
        entry = {"compile_s": r.compile_s, "step_time_us": r.report.step_time,
                 "scheduler_peak_memory_bytes": r.report.peak_memory,
                 "totals": {d: r.report.totals(d) for d in ("fwd", "bwd", "all")},
                 "collectives": [dataclasses.asdict(s) for s in r.report.stats]}
        if r.modelled is not None:
            entry["modelled"] = {"step_time_us": r.modelled.step_time, "ceiling_step_us": r.modelled.ceiling_step(),
                                 "totals": {d: r.modelled.totals(d) for d in ("fwd", "bwd", "all")},
                                 "compute_time_us": r.modelled.compute_time,
                                 "row_copy_us": r.modelled.row_copy_time,
                                 "other_collectives_us": r.modelled.other_collective_time,
                                 "other_collectives_waited_us": r.modelled.other_exposed,
                                 "contention": r.contention, "contention_us": r.modelled.contention_time,
                                 "attention": "fused" if r.fused_attention else "naive",
                                 "compute_by_scope_us": r.modelled.compute_by_scope,
                                 "collectives": [dataclasses.asdict(s) for s in r.modelled.stats]}
        std = next((x for x in results if x.program == r.program and x.preset == "standard"), None)
        if r.modelled is not None and std is not None and std is not r and std.modelled is not None:
            entry["modelled"]["speedup_vs_standard"] = dataclasses.asdict(split_speedup(std.modelled, r.modelled))
            if std.serial is not None:
                entry["modelled"]["speedup_vs_no_overlap"] = dataclasses.asdict(split_speedup(std.serial, r.modelled))
        if r.serial is not None:
            entry["modelled_no_overlap"] = {"step_time_us": r.serial.step_time}
        entry["ceiling_step_us"] = r.report.ceiling_step()
        entry["program_layout"] = r.layout
        entry["layer_loops"] = [dataclasses.asdict(lp) for lp in r.layer_loops]
        entry["headline_model"] = r.headline[2]
        if r.modelled is not None:
            entry["compute_disagreement"] = compute_disagreement(r.report, r.modelled)
        if r.mesh is not None and "group" in r.mesh.shape:  # Federation of Experts: collectives per group

            entry["foe"] = foe_json(r.hlo_text, r.mesh)
        out.setdefault(r.program, {})[r.preset] = entry
    return out


def compute_disagreement(xla: OverlapReport, modelled: OverlapReport) -> float:
    """How far XLA's deviceless model and the two-stream model disagree on the compute of one
    program: max(a/b, b/a) of their compute times (1.0 = agree)."""
    a, b = xla.compute_time, modelled.compute_time
    if a <= 0 or b <= 0:
        return 1.0
    return max(a / b, b / a)


def disagreement_lines(results: Sequence[ProgramResult], threshold: float = 2.0) -> list[str]:
    """A WARNING per program whose compute times under XLA's model and the two-stream model differ
    by more than `threshold`x, naming the scopes that differ most (e.g. expert_compute: ragged_dot's
    dense expansion; attention_core: the naive score GEMM)."""
    out = []
    for r in results:
        if r.modelled is None or r.modelled_schedule is None:
            continue
        ratio = compute_disagreement(r.report, r.modelled)
        if ratio <= threshold:
            continue
        xs, ms = r.report.compute_by_scope, r.modelled.compute_by_scope
        diff = sorted(((xs.get(k, 0.0) - ms.get(k, 0.0), k) for k in set(xs) | set(ms)), key=lambda t: -abs(t[0]))
        worst = ", ".join(f"{k} {xs.get(k, 0.0) / 1e3:.1f} vs {ms.get(k, 0.0) / 1e3:.1f} ms" for _, k in diff[:3])
        out.append(f"WARNING {r.program} ({r.preset}): XLA's deviceless cost model and the two-stream {r.hardware} "
                   f"model disagree on compute by {ratio:.1f}x ({r.report.compute_time / 1e3:.2f} vs "
                   f"{r.modelled.compute_time / 1e3:.2f} ms; most: {worst}). Headline figures and pictures use "
                   f"the two-stream model; XLA's figures are printed for reference (docs/overlap.md).")
    return out


def format_results(results: Sequence[ProgramResult], programs: Sequence[str], target: str = "h100_sxm",
                   num_devices: int = 8, verbose: bool = False, sweep_bw: Optional[str] = None,
                   sweep_contention: Sequence[float] = ()) -> str:
    """The report's text: per program the headline model first (the two-stream model when it ran),
    then XLA's deviceless model, FoE summaries and the bandwidth sweep; warnings where the two
    models disagree by more than 2x on compute."""
    lines: list[str] = []
    p = lines.append
    for prog in programs:
        sel = [r for r in results if r.program == prog]
        if not sel:
            continue
        hw = sel[0].hardware if sel[0].modelled is not None else None
        for r in sel:
            p(f"\n{prog} ({r.preset}): program analysed: {r.describe_layout()}")
        xla_block = [f"\n=== {prog}: XLA's deviceless cost model ({target} x{num_devices})"
                     + (" [reference: misprices ragged_dot and naive attention] ===" if hw else " ===")]
        if verbose:
            xla_block += [format_collectives(r.report) + "\n" for r in sel]
        xla_block.append(format_side_by_side([r.report for r in sel]))
        xla_block += target_lines({r.preset: r.report for r in sel})
        if hw:
            p(f"\n=== {prog}: two-stream cost model ({hw}) [headline] ===")
            p(cost_model_line(sel[0]))
            if verbose:
                lines.extend(format_collectives(r.modelled) + "\n" for r in sel)
            serial = next((r.serial for r in sel if r.preset == "standard"), None)
            p(format_side_by_side([r.modelled for r in sel] + ([serial] if serial is not None else [])))
            lines.extend(target_lines({r.preset: r.modelled for r in sel}, serial=serial))
            lines.extend(disagreement_lines(sel))
        lines.extend(xla_block)
        for r in sel:
            if r.mesh is not None and "group" in r.mesh.shape:  # Federation of Experts

                p(format_foe_summary(foe_summary(r.hlo_text, r.mesh), f"FoE {r.preset}"))
        if hw and sweep_bw:
            std = next((r for r in sel if r.preset == "standard"), None)
            fs = next((r for r in sel if r.preset == "farskip"), None)
            if std is not None and fs is not None:
                h = with_contention(HARDWARE[hw], std.contention)
                kw = dict(fused_attention=std.fused_attention)
                paper = implied_bandwidth(std.schedule, fs.schedule, h, 1.11, num_devices, **kw)
                bws = sorted({x * 1e9 for x in _bandwidths(sweep_bw)} | {h.a2a_bw} | set(paper))
                sweep = bandwidth_sweep(std.schedule, fs.schedule, h, bws, num_devices, **kw)
                marks = {h.a2a_bw / 1e9: f"<- {hw} default"}
                marks.update({bw / 1e9: "<- paper's 1.11x (farskip vs no-overlap baseline)" for bw in paper})
                p(f"\n=== {prog}: speedup vs all-to-all bandwidth (two-stream {hw}) ===")
                p(format_sweep(sweep, marks))
        if hw and sweep_contention:
            lines.extend(contention_block(sel, sweep_contention, num_devices))
    return "\n".join(lines)


def cost_model_line(r: ProgramResult) -> str:
    """The two-stream model's settings a result was timed with, in words (printed with the headline)."""
    hw = HARDWARE.get(r.hardware)
    c = r.contention if r.contention is not None else (hw.contention if hw is not None else 1.0)
    if hw is None:
        how = f"{r.hardware} is not a cost_model.HARDWARE entry"
    elif abs(c - hw.contention) < 1e-12:
        how = f"the default for {r.hardware}: cost_model.HARDWARE, --contention"
    else:
        how = f"overridden by --contention; default {hw.contention:.2f} for {r.hardware}"
    return (f"cost model: compute under a collective in flight at {c:.2f} of its speed (contention, {how}); "
            "attention_core "
            + ("priced as one flash kernel per layer and pass (analysis/attention_cost.py; --attention naive: as "
               "compiled)" if r.fused_attention else "priced as compiled (--attention naive)"))


def contention_block(sel: Sequence[ProgramResult], values: Sequence[float], num_devices: int) -> list[str]:
    """The program's standard and farskip schedules re-timed at each contention (sensitivity.
    contention_sweep), as text."""
    std = next((r for r in sel if r.preset == "standard"), None)
    fs = next((r for r in sel if r.preset == "farskip"), None)
    if std is None or fs is None or std.hardware is None:
        return []
    rows = contention_sweep(std.schedule, fs.schedule, HARDWARE[std.hardware], values, num_devices,
                            fused_attention=std.fused_attention, topology=std.topology)
    return [f"\n=== {sel[0].program}: speedup vs contention (two-stream {std.hardware}) ===",
            format_contention_sweep(rows, HARDWARE[std.hardware].contention)]


def write_timelines(results: Sequence[ProgramResult], programs: Sequence[str], out: str) -> list[str]:
    """timeline_<program>_<fwd|bwd>.png of the middle MoE layer, drawn on the headline model's
    timeline (ProgramResult.headline); returns the paths written."""
    paths = []
    for prog in programs:
        sel = [r for r in results if r.program == prog]
        if not sel:
            continue
        layer = _middle_moe_layer(sel[0].headline[0])
        if layer is None:
            continue
        for d in ("fwd", "bwd") if prog == "train" else ("fwd",):
            path = os.path.join(out, f"timeline_{prog}_{d}.png")
            items = [(f"{r.preset} ({r.headline[2]})", r.headline[1], r.headline[0]) for r in sel]
            plot_layer_timelines(items, layer, d, path)
            paths.append(path)
    return paths


def _contentions(text: Optional[str]) -> list[float]:
    """--contention-sweep's values, fractions in (0, 1]; ConfigError naming a bad one."""
    return number_list(text or None, "--contention-sweep", "fractions of compute speed in (0, 1]", high=1.0,
                       example="1,0.9,0.8")


def _bandwidths(text: Optional[str]) -> list[float]:
    """--sweep-bw's values (GB/s per GPU); ConfigError naming a bad one."""
    return number_list(text, "--sweep-bw", "all-to-all bandwidths in GB/s per GPU", example="25,50,100,200")


def check_args(a, presets: Sequence[str], progs: Sequence[str]) -> None:
    """ConfigError for a command line that cannot run as asked, before anything is compiled."""
    for flag, v in (("--batch", a.batch), ("--seq", a.seq)):
        if v is not None and v < 1:
            raise ConfigError(f"{flag} {v} must be >= 1 (leave it out for the config's "
                              f"train.{'batch_size' if flag == '--batch' else 'seq_len'})")
    if a.devices < 1:
        raise ConfigError(f"--devices {a.devices} must be >= 1")
    if a.gpus_per_node is not None and (a.gpus_per_node < 1 or a.devices % a.gpus_per_node):
        raise ConfigError(f"--gpus-per-node {a.gpus_per_node} must divide --devices {a.devices} (e.g. --devices 32 "
                          "--gpus-per-node 8: 4 nodes)")
    if a.memory_gb is not None and not a.memory_gb > 0:
        raise ConfigError(f"--memory-gb {a.memory_gb} must be > 0 (GB of device memory)")
    bad = [p for p in presets if p not in CONNECTIVITY]
    if bad or not presets:
        raise ConfigError(f"--presets: {f'unknown {bad}' if bad else 'no preset named'}; choose from "
                          f"{sorted(CONNECTIVITY)} (comma separated)")
    if not progs:
        raise ConfigError(f"--programs names no program; choose from {list(PROGRAMS)}")
    for kv in a.xla:
        if "=" not in kv or not kv.partition("=")[0].strip("- "):
            raise ConfigError(f"--xla {kv!r} must look like FLAG=VALUE, e.g. --xla "
                              "xla_gpu_enable_latency_hiding_scheduler=true")
    if a.sweep_bw is not None and not {"standard", "farskip"} <= set(presets):
        raise ConfigError("--sweep-bw compares farskip with standard: keep both in --presets")
    check_out_folder(a.out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m farskip_jax.analysis.overlap", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None, help="YAML config (default: built-in defaults)")
    ap.add_argument("--presets", default="standard,farskip")
    ap.add_argument("--programs", default="forward,train", help="forward, train or both (comma separated)")
    ap.add_argument("--batch", type=int, default=None, help="global batch (default train.batch_size)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default train.seq_len)")
    ap.add_argument("--target", default="h100_sxm", help="GPU target spec: h100_sxm, h200 or a .txtpb path")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--gpus-per-node", type=int, default=None,
                    help="split --devices over nodes of this many GPUs (e.g. --devices 32 --gpus-per-node 8: 4 "
                         "nodes); the two-stream model then prices collectives with analysis/topology.py")
    ap.add_argument("--memory-gb", type=float, default=None, help="override the target's device memory (GB)")
    ap.add_argument("--grouped-gemm", action="store_true",
                    help="trace ragged_dot as a grouped-GEMM cost proxy (useful FLOPs; analysis only)")
    ap.add_argument("--preset", default="cuda_hopper",
                    help="XLA flag preset of parallel/xla_flags.py compiled with (none, cuda_hopper, rocm_mi300)")
    ap.add_argument("--xla", action="append", default=[], metavar="FLAG=VALUE",
                    help="extra XLA debug option for the compile (repeatable)")
    ap.add_argument("--hardware", default="mi300x",
                    help="two-stream cost model the headline figures and pictures come from: mi300x (default), "
                         "mi325x, h100_sxm, h200; 'none' = XLA's deviceless model only")
    ap.add_argument("--sweep-bw", default=None, metavar="GBS,GBS,...",
                    help="with --hardware: speedups at these all-to-all bandwidths (GB/s per GPU), e.g. 25,50,100,200")
    ap.add_argument("--contention", type=float, default=None,
                    help="compute speed while a collective is in flight, as a fraction of its speed alone (0-1]; "
                         "default: the hardware's (cost_model.HARDWARE: 0.8 for all four GPUs), 1.0 = no contention")
    ap.add_argument("--contention-sweep", default=None, metavar="F,F,...",
                    help="with --hardware: re-time the compiled programs at these contentions, e.g. 1,0.9,0.8,0.7")
    ap.add_argument("--attention", default="fused", choices=("fused", "naive"),
                    help="two-stream model: attention_core as one flash kernel per layer and pass (fused, default: "
                         "analysis/attention_cost.py) or as compiled (naive: materialised [s, s] scores)")
    ap.add_argument("--out", default=None, help="folder for report.json and timeline pictures")
    ap.add_argument("--verbose", action="store_true", help="print every all-to-all")
    ap.add_argument("overrides", nargs="*", help="config overrides key=value")
    a = ap.parse_args(argv)

    try:
        cfg = load_config(a.config, a.overrides)
        flags = dict(preset_options(a.preset))
        flags.update(LHS_FLAGS)
        for kv in a.xla:
            k, _, v = kv.partition("=")
            flags[k.lstrip("-")] = _parse_value(v)
        progs = [p.strip() for p in a.programs.split(",") if p.strip()]
        presets = [p.strip() for p in a.presets.split(",") if p.strip()]
        check_args(a, presets, progs)
        _bandwidths(a.sweep_bw)  # every value a bandwidth, before anything compiles

        if a.hardware and a.hardware.lower() == "none":
            a.hardware = None
        if a.sweep_bw and not a.hardware:
            raise FarSkipError("--sweep-bw needs --hardware (the two-stream model it re-times)")
        if a.hardware and a.hardware not in HARDWARE:
            raise FarSkipError(f"--hardware {a.hardware!r} is unknown; choose one of {sorted(HARDWARE)}")
        bad = [p for p in progs if p not in PROGRAMS]
        if bad:
            raise FarSkipError(f"--programs: unknown {bad}; choose from {list(PROGRAMS)}")
        sweep_c = _contentions(a.contention_sweep)
        if (a.contention is not None or sweep_c) and not a.hardware:
            raise FarSkipError("--contention / --contention-sweep need --hardware (the two-stream model)")
        if a.contention is not None:
            with_contention(HARDWARE[a.hardware], a.contention)  # validates
        log = lambda m: print(m, file=sys.stderr, flush=True)
        if not has_all_to_alls(cfg):
            log(f"[overlap] NOTE: this config runs no expert-parallel all-to-all (moe.num_experts="
                f"{cfg.moe.num_experts}, mesh.expert={cfg.mesh.expert}, runtime.dispatch={cfg.runtime.dispatch}): the report "
                f"has nothing to hide. {NO_ALL_TO_ALL_FIX}")
        results = run_overlap(cfg, presets, progs, a.batch, a.seq, a.target,
                              a.devices, flags, a.hardware, log, gpus_per_node=a.gpus_per_node,
                              memory_gb=a.memory_gb, grouped_gemm=a.grouped_gemm, contention=a.contention,
                              fused_attention=a.attention == "fused")
    except FarSkipError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_results(results, progs, a.target, a.devices, verbose=a.verbose, sweep_bw=a.sweep_bw,
                         sweep_contention=sweep_c))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "report.json"), "w") as f:
            json.dump(to_json(results), f, indent=1)
        for path in write_timelines(results, progs, a.out):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

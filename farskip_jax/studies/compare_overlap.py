"""FarSkip against two-batch overlap (TBO) and FoE: one table per setting, every row from the same
compiled programs and the same cost model.

    JAX_PLATFORMS=cpu python -m farskip_jax.studies.compare_overlap --model dsv2_lite --ep 8 --tokens 1x1024,2x512,2x4096,8x4096
    JAX_PLATFORMS=cpu python -m farskip_jax.studies.compare_overlap --model dsv3_6l --ep 16 --tokens 1x1024,2x512,2x2048
        [--layers N] [--full-layers N] [--hardware mi325x] [--program train|forward] [--contention F] [--accum 1|inf]
        [--out benchmarks/results/compare] [--plot-only] [config overrides ...]

A setting is (model, EP size, per-GPU tokens list). For each per-GPU token shape `b x s` (b
sequences of s tokens per GPU; the global batch is b * EP) the train step (default) is compiled
deviceless for EP GPUs (8 per node; EP 16 / 32 span 2 / 4 hosts as studies/multinode_scaling.py
compiles them) with the cuda_hopper preset and the latency-hiding scheduler, layers scanned, the
routed experts traced as a grouped GEMM's cost proxy where the config's runtime.gmm resolves to ragged_dot
(a config's runtime.gmm=tiled runs its tiled walk), and re-timed by the two-stream cost model of
analysis/overlap.run_overlap (contention at the hardware's default unless --contention; attention
priced as flash kernels; several nodes: analysis/topology.py). Rows (each variant one compile):

  standard             standard connectivity, as XLA's latency-hiding scheduler overlaps it
  standard no overlap  the standard program re-timed with every all-to-all synchronous (the
                       overlap report's no-overlap baseline; no compile)
  standard + TBO       runtime.micro_batches=2: each layer's rows in two interleaved micro-batches whose
                       sub-blocks do not depend on each other (model/layer_loop.py)
  farskip              FarSkip-Collective connectivity
  farskip + TBO        both
  FoE / FoE + farskip  Federation of Experts with H = nodes groups (runtime.num_groups), standard /
                       FarSkip; "n/a: reason" where it does not compile for the setting (MLA
                       attention; one node, where H = 1 is the ordinary MoE)

Columns: modelled step time, exposed communication (step - compute at full speed: waits at the
collectives' dones plus compute slowed by collectives in flight), all-to-all time hidden, and the
speedup over standard split into hiding communication x compute that differs between the programs
(analysis/speedup.py). Compiled figures are kept in OUT/cache.json by key (a re-run re-tables
without compiling); the table goes to stdout and OUT/<model>_ep<EP>_<program>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from types import SimpleNamespace
from typing import Optional

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from farskip_jax.studies.harness import (MODEL_OVERRIDES, MODELS, ResultStore, fail, figure, log, md_header,
                                          md_row, model_config_path, results_dir, spread_range, tbo_verdicts,
                                          write_json, write_text)
from farskip_jax.errors import ConfigError
from farskip_jax.config import replace
from farskip_jax.analysis.cost_model import HARDWARE, optimizer_step, simulate, with_contention
from farskip_jax.analysis.deviceless import LHS_FLAGS, preset_options
from farskip_jax.analysis.overlap import run_overlap
from farskip_jax.analysis.report import ALL_TO_ALLS, analyze
import dataclasses
from farskip_jax.analysis.calibration import variants_of_constants
from farskip_jax.analysis.calibration_fit import load_fitted
from farskip_jax.analysis.cost_model import hardware_from_fit, optimizer_step, simulate
from farskip_jax.analysis.report import ALL_TO_ALLS
from farskip_jax.analysis.topology import Topology, links_from_fit
from farskip_jax.analysis.speedup import split_speedup
from farskip_jax.analysis.cost_model import HARDWARE, with_contention
from farskip_jax.config import load_config, replace
from farskip_jax.errors import ConfigError, FarSkipError

# the depth the existing tools extrapolate from (overlap_levers / multinode_scaling --layers 4 for
# DeepSeek-V2-Lite: layer 0 dense + 3 MoE); DeepSeek-V3-6L is compiled at its 6 layers
DEFAULT_LAYERS = {"dsv2_lite": 4}
# the cost model each model's existing report uses: the README's overlap command (MI300X) for
# DeepSeek-V2-Lite, the paper's Figure 5 nodes (MI325X, multinode_scaling) for DeepSeek-V3-6L
DEFAULT_HARDWARE = {"dsv2_lite": "mi300x", "dsv3_6l": "mi325x", "dsv3_6l_gqa": "mi325x"}
MEMORY_GB = {"mi300x": 192.0, "mi325x": 256.0, "h100_sxm": 80.0, "h200": 141.0}
DEFAULT_TOKENS = {"dsv2_lite": "1x1024,2x512,2x4096,8x4096", "dsv3_6l": "1x1024,2x512,2x2048",
                  "dsv3_6l_gqa": "1x1024,2x512,2x2048"}
VARIANTS = ("standard", "standard_tbo", "farskip", "farskip_tbo", "foe", "foe_farskip")
ROWS = ("standard", "no_overlap", "standard_tbo", "farskip", "farskip_tbo", "foe", "foe_farskip")
LABELS = {"standard": "standard (XLA schedule)", "no_overlap": "standard, no overlap",
          "standard_tbo": "standard + TBO", "farskip": "FarSkip", "farskip_tbo": "FarSkip + TBO",
          "foe": "FoE (H = nodes)", "foe_farskip": "FoE + FarSkip"}
# the micro-batches (two-batch overlap) each variant compiles with
MICRO_BATCHES = {"standard": 1, "standard_tbo": 2, "farskip": 1, "farskip_tbo": 2, "foe": 1, "foe_farskip": 1}


def parse_tokens(text: str) -> list[tuple[int, int]]:
    """'1x1024,8x4096' -> [(1, 1024), (8, 4096)]: sequences per GPU x sequence length; ConfigError
    naming a bad item."""

    out = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        b, sep, s = item.partition("x")
        if not sep or not b.isdigit() or not s.isdigit() or int(b) < 1 or int(s) < 1:
            raise ConfigError(f"--tokens: {item!r} is not SEQUENCES x LENGTH per GPU; write e.g. 1x1024,8x4096")
        out.append((int(b), int(s)))
    if not out:
        raise ConfigError("--tokens is empty; write e.g. 1x1024,8x4096 (sequences per GPU x sequence length)")
    return out


def variant_config(variant: str, cfg, groups: int):
    """The config `variant` compiles: farskip.preset, runtime.micro_batches (TBO) and, for FoE,
    runtime.num_groups = `groups`."""

    over = {"farskip.preset": "farskip" if "farskip" in variant else "standard",
            "runtime.micro_batches": MICRO_BATCHES[variant]}
    if variant.startswith("foe"):
        over["runtime.num_groups"] = groups
    return replace(cfg, **over)


def not_applicable(variant: str, cfg, per_gpu_batch: int, nodes: int) -> Optional[str]:
    """Why `variant` cannot be compiled for this setting (None: it can)."""
    if MICRO_BATCHES[variant] > 1 and per_gpu_batch % MICRO_BATCHES[variant]:
        return (f"n/a: {per_gpu_batch} sequence(s) per GPU; runtime.micro_batches splits each GPU's sequences, "
                f"so TBO needs a multiple of {MICRO_BATCHES[variant]}")
    if variant.startswith("foe"):
        if cfg.model.attention == "mla":
            return "n/a: FoE needs GQA attention (model/foe.check_foe); --model dsv3_6l_gqa compiles it"
        if nodes == 1:
            return "n/a: one node, FoE's H = nodes = 1 is the ordinary MoE (= standard / FarSkip)"
    return None


def figures(rep) -> dict:
    """What a table row needs of one report.OverlapReport (JSON-serialisable)."""
    return {"step_time": rep.step_time, "compute_time": rep.compute_time, "contention_time": rep.contention_time,
            "compute_by_scope": dict(rep.compute_by_scope), "other_collective_time": rep.other_collective_time,
            "a2a": rep.totals("all")}


def cost_model_of(r) -> dict:
    """The two-stream model a ProgramResult was timed with."""
    topo = r.topology
    return {"hardware": r.hardware, "contention": r.contention, "fused_attention": r.fused_attention,
            "calibrated": "2026-12-07",  # constants fitted to component measurements (docs/calibration.md)
            "nodes": len({d.process_index for d in r.mesh.devices.flat}),
            "topology": None if topo is None else repr(topo.links)}


def compile_variant(cfg, variant: str, program: str, batch: int, seq: int, ep: int, hardware: str,
                    contention: Optional[float], gpus_per_node: int = 8, target: str = "h200", log=None) -> dict:
    """Compile one variant deviceless for `ep` GPUs and time it with the two-stream model (run_overlap);
    returns its figures: the modelled report, the no-overlap re-timing, and what it was compiled as."""

    nodes = max(1, ep // gpus_per_node)
    flags = dict(preset_options("cuda_hopper"), **LHS_FLAGS)
    (r,) = run_overlap(cfg, (variant,), (program,), batch=batch, seq=seq, target=target, num_devices=ep,
                       flags=flags, hardware=hardware, log=log, gpus_per_node=min(gpus_per_node, ep),
                       memory_gb=MEMORY_GB.get(hardware), grouped_gemm=True,
                       cfg_for=lambda v, c: variant_config(v, c, nodes), probe_latency=False, contention=contention)
    c = variant_config(variant, cfg, nodes)
    # the same schedule re-timed in the steady state of gradient accumulation (gradient reductions and
    # the parameter update, once per step, priced at zero: multinode_scaling's --accum inf)
    hw = with_contention(HARDWARE[hardware], contention)
    kw = dict(topology=r.topology, in_place_updates=True, fused_attention=r.fused_attention,
              free=optimizer_step(r.schedule) if program == "train" else None)
    steady = [analyze(*simulate(r.schedule, hw, ep, serialize=ser, **kw)) for ser in ((), ALL_TO_ALLS)]
    spread = spread_steps(r, hardware, ep, program) if contention is None else {}
    return {"modelled": figures(r.modelled), "no_overlap": figures(r.serial), "cost_model": cost_model_of(r),
            "spread": spread,
            "steady": figures(steady[0]), "steady_no_overlap": figures(steady[1]),
            "micro_batches": c.runtime.micro_batches, "preset": c.farskip.preset, "num_groups": c.runtime.num_groups,
            "layout": r.layout, "compile_s": r.compile_s, "num_layers": c.model.num_layers,
            "xla_step_time": r.report.step_time, "scheduler_peak_memory_gib": r.report.peak_memory / 2**30,
            "memory_gb": MEMORY_GB.get(hardware)}


def spread_steps(r, hardware: str, ep: int, program: str) -> dict:
    """{constant-set: {modelled, no_overlap, steady, steady_no_overlap: step us}}: the compiled schedule
    re-timed with each fitted constant at the low and the high end of its spread (docs/calibration.md)."""


    fitted = load_fitted()
    out = {}
    for lab, end, hw_w, lk_w in variants_of_constants():
        if not end:
            continue
        hw = hardware_from_fit(hardware, fitted, hw_w)
        topo = None
        if r.topology is not None:
            lk = links_from_fit(hardware, fitted, lk_w)
            keep = {f: getattr(r.topology.links, f) for f in ("gpus_per_node", "nics_per_node", "intra_links")}
            topo = Topology(dataclasses.replace(lk, **keep), r.topology.node_of)
        fig = {}
        for part, free in (("modelled", None), ("steady", optimizer_step(r.schedule) if program == "train" else None)):
            for mode, ser in (("", ()), ("_no_overlap", ALL_TO_ALLS)):
                sched, _ = simulate(r.schedule, hw, ep, serialize=ser, topology=topo, in_place_updates=True,
                                    fused_attention=r.fused_attention, free=free)
                fig[("no_overlap" if part == "modelled" and mode else part + mode)] = sched.makespan
        out[f"{lab}:{end}"] = fig
    return out


def extrapolate(a: dict, la: int, b: dict, lb: int, layers: int) -> dict:
    """compile_variant figures at `layers` from two depth-cut compiles (la < lb layers): every
    number x_a + (x_b - x_a) (layers - la) / (lb - la), as inference_report.extrapolate (exact when
    the layers between la and lb are the model's repeating layer; the constant holds the embedding,
    dense layer, LM head and loss); all-to-all hidden fraction recomputed from the extrapolated
    hidden and total time."""
    f = (layers - la) / (lb - la)

    def lin(x, y):
        if isinstance(x, dict):
            return {k: lin(x.get(k, 0.0), y.get(k, 0.0)) for k in set(x) | set(y)}
        return x + (y - x) * f

    out = dict(b, num_layers=layers, extrapolated_from=[la, lb], compile_s=a["compile_s"] + b["compile_s"])
    if a.get("spread") and b.get("spread"):
        out["spread"] = lin(a["spread"], b["spread"])
    for part in ("modelled", "no_overlap"):
        out[part] = lin(a[part], b[part])
        t = out[part]["a2a"]
        t["hidden_frac"] = t["hidden"] / t["duration"] if t["duration"] else 1.0
        t["count"] = int(round(t["count"]))
    out["xla_step_time"] = lin(a["xla_step_time"], b["xla_step_time"])
    return out


def _rep(f: dict):
    return SimpleNamespace(step_time=f["step_time"], compute_time=f["compute_time"],
                           compute_by_scope=f["compute_by_scope"])


def rows_of(entries: dict, reasons: dict, steady: bool = False) -> list[dict]:
    """Table rows of one token shape: `entries` {variant: compile_variant(...)}, `reasons` {variant:
    'n/a: ...'}. Every speedup is over the standard entry's modelled step, split into hiding x compute.
    steady: the re-timing with gradient reductions and the update priced at zero (gradient accumulation)."""

    part, serial = ("steady", "steady_no_overlap") if steady else ("modelled", "no_overlap")
    std = entries["standard"]
    ref = _rep(std[part])
    rows = []
    for name in ROWS:
        if name == "no_overlap":
            f, meta = std[serial], std
        elif name in entries:
            f, meta = entries[name][part], entries[name]
        else:
            rows.append({"row": name, "label": LABELS[name], "na": reasons.get(name, "n/a: not compiled")})
            continue
        sp = split_speedup(ref, _rep(f))
        a2a = f["a2a"]
        rng = speedup_range(std, meta, name, steady, sp.total)
        rows.append({"row": name, "label": LABELS[name], "step_ms": f["step_time"] / 1e3,
                     "compute_ms": f["compute_time"] / 1e3, "exposed_ms": (f["step_time"] - f["compute_time"]) / 1e3,
                     "a2a_ms": a2a["duration"] / 1e3, "a2a_count": a2a["count"],
                     "a2a_exposed_ms": (a2a["duration"] if name == "no_overlap" else a2a["exposed"]) / 1e3,
                     "hidden_pct": 0.0 if name == "no_overlap" else 100 * a2a["hidden_frac"],
                     "speedup": sp.total, "hiding": sp.hiding, "compute": sp.compute,
                     "differs": [k for k, a, b in sp.scopes], "micro_batches": meta["micro_batches"],
                     "preset": meta["preset"], "cost_model": meta["cost_model"],
                     "peak_gib": meta.get("scheduler_peak_memory_gib", float("nan")), **rng,
                     "memory_limited": memory_limited(meta)})
    return rows


def speedup_range(std: dict, meta: dict, name: str, steady: bool, central: float) -> dict:
    """{range: [low, high], dominant: constant} of a row's speedup over standard across the fitted
    constants' spread (compile_variant's `spread`); {} without it."""
    a, b = std.get("spread"), meta.get("spread")
    if not a or not b:
        return {}
    part = "steady" if steady else "modelled"
    serial = "steady_no_overlap" if steady else "no_overlap"
    return spread_range({k: a[k][part] for k in a},
                        {k: b[k][serial] if name == "no_overlap" else b[k][part] for k in b}, central)


def memory_limited(entry: dict) -> bool:
    """Whether XLA's scheduler peak memory of a compile exceeds the target's memory: the latency-hiding
    scheduler then stops overlapping (its schedule is memory-bound, not what the hardware would run)."""
    peak = entry.get("scheduler_peak_memory_gib")
    mem = entry.get("memory_gb") or MEMORY_GB.get(entry.get("cost_model", {}).get("hardware"))
    return bool(peak and mem and peak * 2**30 > mem * 1e9)


def comm_share(entries: dict, steady: bool = False) -> float:
    """Standard's all-to-all time / its no-overlap step (the step's communication share)."""
    s = entries["standard"]["steady_no_overlap" if steady else "no_overlap"]
    return s["a2a"]["duration"] / s["step_time"]


def verdicts(rows: list[dict], share: float) -> list[str]:
    """Plain statements for one token shape: which of FarSkip / TBO is faster, and whether FarSkip +
    TBO is at least the better of the two."""
    by = {r["row"]: r for r in rows if "step_ms" in r}
    out = []
    over = [r["label"] for r in rows if r.get("memory_limited") and r["row"] != "no_overlap"]
    if over:
        out.append(f"MEMORY-LIMITED ({', '.join(over)}): XLA's scheduler peak memory exceeds the GPU's, so the "
                   "latency-hiding scheduler stops overlapping; these rows do not show what the hardware would run "
                   "(use fewer tokens per GPU, or runtime.remat)")
    fs, tbo, both = by.get("farskip"), by.get("standard_tbo"), by.get("farskip_tbo")
    ms = lambda r: r["step_ms"] if r else None  # noqa: E731
    out += tbo_verdicts(ms(fs), ms(tbo), ms(both), share, "communication {pct} of the no-overlap step")
    if fs and not tbo:
        out.append("TBO " + next(r["na"] for r in rows if r["row"] == "standard_tbo"))
    return out


def calibration_note(setting: dict) -> str:
    """Whether every row of the setting was timed with the calibrated constants (docs/calibration.md)."""
    rows = [r for t in setting["tokens"] for r in t["rows"] if "cost_model" in r]
    if rows and all(r["cost_model"].get("calibrated") for r in rows):
        return "Cost model: constants fitted to component measurements (docs/calibration.md)."
    return ("**Pre-calibration** rows (timed before the constants were fitted, 2026-12-07; docs/calibration.md): "
            "read them as the earlier model's.")


def table_md(setting: dict) -> str:
    """Markdown of one setting: a table per token shape."""
    out = []
    for t in setting["tokens"]:
        out += [f"#### {t['batch']} x {t['seq']} tokens per GPU (global batch {t['batch'] * setting['ep']} x "
                f"{t['seq']}); all-to-all {100 * t['comm_share']:.1f}% of the no-overlap step", "",
                *md_header(["row", "step ms", "exposed comm ms", "a2a exposed ms", "a2a hidden", "a2a count",
                            "vs standard", "range over the constants' spread (dominant)", "= hiding", "x compute",
                            "compute differs most", "sched. peak GiB"])]
        for r in t["rows"]:
            if "na" in r:
                out.append(md_row([r["label"], r["na"]] + [""] * 10))
                continue
            rng = f"{r['range'][0]:.3f}-{r['range'][1]:.3f}x ({r['dominant']})" if "range" in r else "-"
            out.append(f"| {r['label']} | {r['step_ms']:.2f} | {r['exposed_ms']:.2f} | {r['a2a_exposed_ms']:.2f} | "
                       f"{r['hidden_pct']:.1f}% | "
                       f"{r['a2a_count']} | {r['speedup']:.3f}x | {rng} | {r['hiding']:.3f}x | {r['compute']:.3f}x | "
                       f"{', '.join(r['differs'][:2]) or '-'} | {r['peak_gib']:.0f}"
                       f"{' (!)' if r['memory_limited'] else ''} |")
        out += [""] + [f"- {v}" for v in t["verdicts"]] + [""]
    return "\n".join(out)


def plot(setting: dict, path: str) -> None:
    """Step time per row (bars) for each token shape, speedup over standard printed on the bars."""
    colors = {"standard": "#8C8C8C", "no_overlap": "#333333", "standard_tbo": "#DD8452", "farskip": "#C44E52",
              "farskip_tbo": "#8C1C13", "foe": "#4C72B0", "foe_farskip": "#8172B3"}
    toks = setting["tokens"]
    with figure(path, 1, len(toks), figsize=(4.2 * len(toks) + 1, 4.2), squeeze=False) as (fig, axes):
        _plot_axes(setting, colors, fig, axes[0])


def _plot_axes(setting: dict, colors: dict, fig, axes) -> None:
    for ax, t in zip(axes, setting["tokens"]):
        rows = [r for r in t["rows"] if "step_ms" in r]
        xs = range(len(rows))
        ax.bar(xs, [r["step_ms"] for r in rows], color=[colors[r["row"]] for r in rows])
        for x, r in zip(xs, rows):
            ax.text(x, r["step_ms"], f"{r['speedup']:.3f}x", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(xs), [r["label"].replace(" (XLA schedule)", "").replace(", ", "\n").replace(" + ", "\n+ ")
                                 for r in rows], fontsize=7)
        ax.set_title(f"{t['batch']} x {t['seq']} per GPU (a2a {100 * t['comm_share']:.0f}% of no-overlap)", fontsize=9)
        ax.set_ylabel("modelled step time (ms)")
    fig.suptitle(f"{setting['model']} ({setting['num_layers']} layers) {setting['program']}, EP {setting['ep']} "
                 f"({setting['nodes']} node(s)), two-stream {setting['hardware']} model, contention "
                 f"{setting['contention']:.2f}"
                 + (", steady state of gradient accumulation" if setting.get("accum") == "inf" else "")
                 + " (modelled; label: speedup over standard)", fontsize=9)


def command_of(a) -> str:
    parts = [f"--model {a.model}", f"--ep {a.ep}", f"--tokens {a.tokens}"]
    if a.layers is not None:
        parts.append(f"--layers {a.layers}")
    if a.full_layers is not None:
        parts.append(f"--full-layers {a.full_layers}")
    if a.program != "train":
        parts.append(f"--program {a.program}")
    if a.hardware_given:
        parts.append(f"--hardware {a.hardware}")
    if a.contention is not None:
        parts.append(f"--contention {a.contention:g}")
    if a.accum != "1":
        parts.append(f"--accum {a.accum}")
    return "JAX_PLATFORMS=cpu python -m farskip_jax.studies.compare_overlap " + " ".join(parts + a.overrides)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="dsv2_lite", choices=sorted(MODELS))
    ap.add_argument("--ep", type=int, default=8, help="expert-parallel GPUs (8 per node: 16 / 32 span 2 / 4 nodes)")
    ap.add_argument("--tokens", default=None,
                    help="per-GPU token shapes SEQUENCES x LENGTH, comma separated (default: 1x1024,2x512,2x4096,"
                         "8x4096 for dsv2_lite; 1x1024,2x512,2x2048 for dsv3_6l, whose 8 x 4096 exceeds the GPU's "
                         "memory in XLA's schedule without remat)")
    ap.add_argument("--layers", type=int, default=None, help="model.num_layers (default: 4 for dsv2_lite, "
                                                             "the config's 6 for dsv3_6l)")
    ap.add_argument("--full-layers", type=int, default=None,
                    help="also compile at --layers - 2 and extrapolate every figure linearly to this depth "
                         "(e.g. 27 for DeepSeek-V2-Lite; inference_report.extrapolate's rule)")
    ap.add_argument("--program", default="train", choices=("train", "forward"))
    ap.add_argument("--hardware", default=None, help="two-stream cost model (default: mi300x for dsv2_lite, "
                                                     "mi325x for dsv3_6l)")
    ap.add_argument("--contention", type=float, default=None,
                    help="compute speed under a collective in flight (default: the hardware's, cost_model.HARDWARE)")
    ap.add_argument("--accum", default="1", choices=("1", "inf"),
                    help="1: one micro-batch per step, everything counted (the overlap report's model); inf: the "
                         "steady state of gradient accumulation, gradient reductions and the update priced at zero")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=results_dir("compare"))
    ap.add_argument("--plot-only", action="store_true", help="re-table from OUT/cache.json, compile nothing")
    ap.add_argument("overrides", nargs="*", help="config overrides key=value")
    a = ap.parse_args(argv)


    a.hardware_given = a.hardware is not None
    a.tokens = a.tokens or DEFAULT_TOKENS[a.model]
    a.hardware = a.hardware or DEFAULT_HARDWARE[a.model]
    try:
        if a.hardware not in HARDWARE:
            raise ConfigError(f"--hardware {a.hardware!r} is unknown; choose one of {sorted(HARDWARE)}")
        hw = with_contention(HARDWARE[a.hardware], a.contention)
        tokens = parse_tokens(a.tokens)
        variants = [v for v in a.variants.split(",") if v]
        bad = [v for v in variants if v not in VARIANTS]
        if bad or "standard" not in variants:
            raise ConfigError(f"--variants {a.variants!r}: give some of {list(VARIANTS)}, standard included")
        if a.ep < 1 or (a.ep > 8 and a.ep % 8):
            raise ConfigError(f"--ep {a.ep}: give 8 or fewer GPUs, or a multiple of 8 (whole nodes of 8)")
        layers = a.layers if a.layers is not None else DEFAULT_LAYERS.get(a.model)
        if a.full_layers is not None and (layers is None or layers - 2 < 2 or a.full_layers <= layers):
            raise ConfigError(f"--full-layers {a.full_layers}: needs --layers L >= 4 (compiled at L - 2 and L) and a "
                              f"full depth above L; got --layers {layers}")
        over = ["mesh.data=1", f"mesh.expert={a.ep}", "runtime.dispatch=all_to_all", "runtime.capacity_factor=1.0",
                f"model.max_seq_len={max([4096] + [s for _, s in tokens])}", "runtime.remat=none",
                "runtime.scan_layers=true"]
        over += [f"model.num_layers={layers}"] if layers else []
        cfg = load_config(model_config_path(a.model), over + MODEL_OVERRIDES.get(a.model, []) + a.overrides)
    except FarSkipError as e:
        return fail(str(e))

    os.makedirs(a.out, exist_ok=True)
    cache = ResultStore(os.path.join(a.out, "cache.json"))  # figures of every compiled variant by key
    nodes = max(1, a.ep // 8)
    ctag = f"c{hw.contention:g}"
    extra = "|".join(a.overrides)
    setting = {"model": a.model, "ep": a.ep, "nodes": nodes, "num_layers": a.full_layers or cfg.model.num_layers,
               "compiled_layers": [cfg.model.num_layers] + ([cfg.model.num_layers - 2] if a.full_layers else []),
               "program": a.program, "hardware": a.hardware, "contention": hw.contention,
               "accum": a.accum, "command": command_of(a), "date": time.strftime("%Y-%m-%d"), "tokens": []}
    t_start = time.time()
    for b, s in tokens:
        entries, reasons = {}, {}
        for v in variants:
            why = not_applicable(v, cfg, b, nodes)
            if why:
                reasons[v] = why
                continue
            depths = [cfg.model.num_layers] + ([cfg.model.num_layers - 2] if a.full_layers else [])
            got = {}
            for depth in depths:
                k = f"{a.model}|L{depth}|ep{a.ep}|b{b}x{s}|{a.program}|{v}|{a.hardware}|{ctag}|{extra}"
                if k not in cache or (a.accum == "inf" and "steady" not in cache[k]):
                    if a.plot_only:
                        reasons[v] = "n/a: not compiled yet (run without --plot-only)"
                        break
                    t0 = time.time()
                    try:
                        c = cfg if depth == cfg.model.num_layers else replace(cfg, **{"model.num_layers": depth})
                        cache[k] = compile_variant(c, v, a.program, b * a.ep, s, a.ep, a.hardware, a.contention,
                                                   log=log)
                    except FarSkipError as e:  # the variant refuses this setting: say so in its row
                        reasons[v] = f"n/a: {e}"
                        log(f"[compare] {k}: {e}")
                        break
                    cache.save()
                    step = cache[k]["modelled"]["step_time"] / 1e3
                    log(f"[compare] {k}: {time.time() - t0:.0f}s, step {step:.2f} ms")
                got[depth] = cache[k]
            if len(got) < len(depths):
                continue
            if a.full_layers:
                lb, la = depths
                entries[v] = extrapolate(got[la], la, got[lb], lb, a.full_layers)
            else:
                entries[v] = got[depths[0]]
        if "standard" not in entries:
            log(f"[compare] {b}x{s}: standard not compiled; skipped")
            continue
        rows = rows_of(entries, reasons, a.accum == "inf")
        share = comm_share(entries, a.accum == "inf")
        setting["tokens"].append({"batch": b, "seq": s, "comm_share": share, "rows": rows,
                                  "verdicts": verdicts(rows, share)})
    setting["wall_s"] = None if a.plot_only else time.time() - t_start
    name = f"{a.model}_ep{a.ep}_{a.program}" + (f"_L{a.full_layers}" if a.full_layers else "") \
        + ("_accum_inf" if a.accum == "inf" else "") + ("_" + "_".join(x.replace("=", "-") for x in a.overrides)
                                                 if a.overrides else "")
    depth = (f"{a.full_layers} layers, extrapolated from scanned {cfg.model.num_layers - 2}- and "
             f"{cfg.model.num_layers}-layer compiles" if a.full_layers else f"{cfg.model.num_layers} layers, scanned")
    md = [f"### {a.model} ({depth}) {a.program}, EP {a.ep} on {nodes} node(s): "
          f"modelled, two-stream {a.hardware} model, contention {hw.contention:.2f}"
          + (", steady state of gradient accumulation (gradient reductions and update at zero)" if a.accum == "inf"
             else ", every collective counted"), "",
          f"`{setting['command']}` ({setting['date']})", "", calibration_note(setting), "", table_md(setting)]
    text = "\n".join(md)
    print(text)
    write_text(os.path.join(a.out, name + ".md"), text + "\n")
    write_json(os.path.join(a.out, name + ".json"), setting)
    if setting["tokens"]:
        plot(setting, os.path.join(a.out, name + ".png"))
    log(f"[compare] wrote {os.path.join(a.out, name)}.{{md,json,png}} ({time.time() - t_start:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

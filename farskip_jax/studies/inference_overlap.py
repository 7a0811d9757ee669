"""FarSkip at inference, modelled: TTFT and time per output token on the paper's TP = EP all-reduce
layout, standard vs farskip, on 8 GPUs (one node) and 16 GPUs (two nodes).

    JAX_PLATFORMS=cpu python -m farskip_jax.studies.inference_overlap [--models dsv2_lite,dsv2,scout]
        [--gpus 8,16] [--programs prefill,decode] [--prompts 1024,...,16384] [--decode-batches 16,...,1024]
        [--context 2048] [--depth auto|full|cut] [--hardware h200] [--out benchmarks/results/inference]
        [--scan-layers config|true|false] [--contention 0.8] [--plot-only]

Every point compiles serving/programs.prefill_program (16 requests x prompt length, LM head on the last
slot) or decode_program (one token per request against a `--context` cache) deviceless for H200s
(analysis/inference_report.py: LHS on, all-reduce combiners and the dot merger off, routed experts at
a balanced grouped GEMM's cost) under standard and FarSkip connectivity, and re-times XLA's schedule
with the two-stream model: H200 roofline, NVLink 4 inside a node, 8 x 400 Gb/s NICs per node
(analysis/topology.py), compute under an all-reduce in flight at the hardware's contention
(cost_model.HARDWARE; --contention overrides). Layout: TP = EP = all GPUs where the heads split that many ways, else TP 8
inside each node with EP over all GPUs (Llama-4-Scout's 40 heads on 16 GPUs).

Depth: `auto` = DeepSeek-V2-Lite at full depth (27 layers), DeepSeek-V2 and Llama-4-Scout cut to
2 and 4 layers and extrapolated linearly to 60 / 48 (inference_report.extrapolate; the cut is stated
in every row). --scan-layers: the config's runtime.scan_layers (default; DeepSeek-V2-Lite and
Llama-4-Scout scan), or forced: scanned programs (serving/generate.py) are read with their loops
unrolled and priced as compiled and with their stacked-row copies free (analysis/loop_schedule.py,
the `rows in place` column). Compiled schedules are cached (--cache): a re-run only re-times. Results:
OUT/results.json (raw, per compiled depth), OUT/table.md, OUT/speedup.png.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from farskip_jax.studies.harness import (REPO, CompileCache, ResultStore, fail, figure, grid, log, md_header,
                                          results_dir, write_json, write_text)
from farskip_jax.analysis.cost_model import HARDWARE, with_contention
from farskip_jax.analysis import inference_report as ir
from farskip_jax.analysis.inference_report import ServingTiming, extrapolate
from farskip_jax.analysis.cost_model import HARDWARE
from farskip_jax.analysis.deviceless import gpu_devices
from farskip_jax.analysis.inference_report import plot_serving_timelines
from farskip_jax.config import load_config
from farskip_jax.errors import FarSkipError

# name: (config, label, depths to compile when cut)
MODELS = {"dsv2_lite": ("configs/deepseek_v2_lite.yaml", "DeepSeek-V2-Lite", (2, 4)),
          "dsv2": ("configs/deepseek_v2.yaml", "DeepSeek-V2", (2, 4)),
          "scout": ("configs/llama4_scout.yaml", "Llama-4-Scout", (2, 4))}
FULL_BY_DEFAULT = ("dsv2_lite",)
MODEL_CFGS: dict = {}  # name -> loaded config (main)
# the paper's inference figures (arXiv 2511.11505): vLLM TTFT at EP 8 / TP 8 with
# 16 concurrent requests, all-reduce overlap; SGLang DeepSeek-V3
PAPER = {"dsv2": {"ttft": (1.082, 1.168), "overlap": 0.976}, "scout": {"ttft": (1.122, 1.185), "overlap": 0.953},
         "sglang_dsv3": {"prefill": 1.34, "decode_2node": 1.25}}


def key(model, gpus, program, batch, tokens, ctx, layers, preset):
    return f"{model}|g{gpus}|{program}|b{batch}|t{tokens}|c{ctx}|L{layers}|{preset}"


def scores_of(base, mesh_shape: dict, program: str, batch: int, tokens: int) -> int:
    """Elements of one GPU's prefill attention scores (inference_report.score_elements)."""
    return batch * (base.model.num_heads // mesh_shape["tensor"]) * tokens * tokens if program == "prefill" else 0


def _contention(hardware: str, contention=None) -> float:
    """The contention a point is timed with: `contention`, else the hardware's (cost_model.HARDWARE)."""

    return with_contention(HARDWARE[hardware], contention).contention


def compile_point(base, model, gpus, gpn, program, batch, tokens, ctx, layers, preset, hardware, cache_dir, log,
                  compile_missing: bool = True, scan_layers=None, contention=None):
    """ServingTiming json of one compiled point (compiled, or re-timed from the schedule cache; None
    when it is not cached and compile_missing is False). scan_layers: None = the config's."""

    k = key(model, gpus, program, batch, tokens, ctx if program == "decode" else tokens,
            layers or base.model.num_layers, preset)  # = the results key
    scan = base.runtime.scan_layers if scan_layers is None else scan_layers
    cache, ckey = CompileCache(cache_dir), k + ("|scan" if scan else "")
    c = cache.get(ckey)
    if c is not None:
        pass
    elif not compile_missing:
        return None
    else:

        cfg = ir.serving_config(base, preset, gpus, gpn, layers, scan)
        devices = gpu_devices("h200", gpus, gpus_per_node=min(gpn, gpus), memory_gb=1e4)
        mesh = ir.serving_mesh(cfg, devices)
        t0 = time.time()
        prog = ir.compile_serving(cfg, mesh, program, batch, tokens if program == "prefill" else 1,
                                  tokens if program == "prefill" else ctx)
        c = {"schedule": prog.schedule, "node_of": ir.node_of(mesh), "compile_s": time.time() - t0,
             "mesh": dict(mesh.shape), "layers": cfg.model.num_layers, "scan_layers": bool(cfg.runtime.scan_layers),
             "expected_ar_bytes": ir.expected_ar_bytes(cfg, batch, tokens if program == "prefill" else 1)}
        cache.put(ckey, c)
        log(f"[inference] {k}: compiled in {c['compile_s']:.0f}s (mesh {c['mesh']})")
    t = ir.time_serving(c["schedule"], c["node_of"], hardware, program, scores_of(base, c["mesh"], program, batch, tokens),
                        contention)
    layer_ars = [p.bytes for p in c["schedule"].pairs
                 if p.collective == "all-reduce" and ir.role_of(p.start.op_name) in ir.LAYER_ROLES]
    return {**t.to_json(), "compile_s": c["compile_s"], "mesh": c["mesh"], "layers": c["layers"],
            "scan_layers": c.get("scan_layers", False),
            "nodes": len(set(c["node_of"])), "expected_ar_bytes": c["expected_ar_bytes"],
            "contention": _contention(hardware, contention),
            "layer_ar_bytes": sorted(set(layer_ars))}


def timing_at(results, model, gpus, program, batch, tokens, ctx, preset, full_layers):
    """(ServingTiming at full depth, how: 'full' or 'cut a/b'), or (None, None) when missing."""

    full = results.get(key(model, gpus, program, batch, tokens, ctx, full_layers, preset))
    if full:
        return ServingTiming.from_json(full), "full", full
    la, lb = MODELS[model][2]
    a = results.get(key(model, gpus, program, batch, tokens, ctx, la, preset))
    b = results.get(key(model, gpus, program, batch, tokens, ctx, lb, preset))
    if a and b:
        return (extrapolate(ServingTiming.from_json(a), la, ServingTiming.from_json(b), lb, full_layers),
                f"cut {la}/{lb}", b)
    return None, None, None


def rows_of(results, models, gpus_list, points, ctx, full_layers):

    rows = []
    for m in models:
        for g in gpus_list:
            for program, batch, tokens in points:
                c = ctx if program == "decode" else tokens
                std, how, raw = timing_at(results, m, g, program, batch, tokens, c, "standard", full_layers[m])
                fs, how_f, _ = timing_at(results, m, g, program, batch, tokens, c, "farskip", full_layers[m])
                if std is None or fs is None:
                    continue
                rows.append({
                    "model": m, "gpus": g, "nodes": raw["nodes"], "mesh": raw["mesh"], "program": program,
                    "batch": batch, "tokens": tokens, "context": ctx if program == "decode" else tokens,
                    "depth": (how if how == how_f else f"{how}/{how_f}") + (", scan" if raw.get("scan_layers") else ""),
                    "layers": full_layers[m], "scan_layers": bool(raw.get("scan_layers")),
                    "standard_inplace_ms": std.time_inplace_us / 1e3, "farskip_inplace_ms": fs.time_inplace_us / 1e3,
                    "speedup_inplace": std.time_inplace_us / fs.time_inplace_us,
                    "row_copy_ms": std.row_copy_us / 1e3,
                    "standard_ms": std.time_us / 1e3, "farskip_ms": fs.time_us / 1e3,
                    "serial_ms": std.serial_us / 1e3, "ceiling_ms": std.ceiling_us / 1e3,
                    "speedup": std.time_us / fs.time_us, "speedup_vs_serial": std.serial_us / fs.time_us,
                    "ceiling_speedup": std.time_us / std.ceiling_us,
                    "std_hidden": std.layer_hidden_frac, "fs_hidden": fs.layer_hidden_frac,
                    "std_hidden_all": std.hidden_frac, "fs_hidden_all": fs.hidden_frac,
                    "ar_share": std.ar_us / std.serial_us, "ar_ms": std.ar_us / 1e3,
                    "ar_per_layer_us": sum(std.by_role.get(r, {}).get("us", 0.0) for r in ir.LAYER_ROLES)
                    / max(sum(std.by_role.get(r, {}).get("count", 0) for r in ir.LAYER_ROLES), 1),
                    "layer_ar_bytes": raw["layer_ar_bytes"], "expected_ar_bytes": raw["expected_ar_bytes"],
                    "compute_ms": std.compute_us / 1e3,
                    "contention": raw.get("contention"),  # None: timed before contention was modelled
                })
    return rows


def table_md(rows) -> str:
    out = md_header(["model", "GPUs (nodes)", "mesh E x T", "program", "batch x tokens", "depth", "standard ms",
                     "farskip ms", "speedup", "vs sync AR", "ceiling", "AR share", "AR hidden std / farskip",
                     "MB per AR", "rows in place: std / farskip ms, speedup", "contention"])
    for r in rows:
        what = "TTFT" if r["program"] == "prefill" else f"TPOT (ctx {r['context']})"
        bt = f"{r['batch']} x {r['tokens']}" if r["program"] == "prefill" else f"{r['batch']} x 1"
        mb = ", ".join(f"{b / 2**20:.2f}" for b in r["layer_ar_bytes"])
        out.append(f"| {MODELS[r['model']][1]} | {r['gpus']} ({r['nodes']}) | {r['mesh']['expert']} x "
                   f"{r['mesh']['tensor']} | {what} | {bt} | {r['depth']} | {r['standard_ms']:.3f} | "
                   f"{r['farskip_ms']:.3f} | **{r['speedup']:.3f}x** | {r['speedup_vs_serial']:.3f}x | "
                   f"{r['ceiling_speedup']:.3f}x | {100 * r['ar_share']:.1f}% | {100 * r['std_hidden']:.1f}% / "
                   f"{100 * r['fs_hidden']:.1f}% | {mb} | {inplace_cell(r)} | "
                   f"{'none (before 2026-12-03)' if r.get('contention') is None else format(r['contention'], '.2f')} |")
    return "\n".join(out)


def inplace_cell(r) -> str:
    """Scanned programs: standard / farskip with the stacked-row copies free (the GEMMs reading the
    layer's rows in place) and that speedup; '-' for programs without such copies."""
    if not r.get("row_copy_ms"):
        return "-"
    return f"{r['standard_inplace_ms']:.3f} / {r['farskip_inplace_ms']:.3f}, {r['speedup_inplace']:.3f}x"


def plot(rows, path, hardware: str = "h200"):
    with figure(path, 1, 2, figsize=(12, 4.4), dpi=120) as (fig, axes):
        _plot_axes(rows, hardware, fig, axes)


def _plot_axes(rows, hardware: str, fig, axes) -> None:
    colors = {"dsv2_lite": "#4C72B0", "dsv2": "#C44E52", "scout": "#55A868"}
    for ax, program in zip(axes, ("prefill", "decode")):
        for m in colors:
            for g, ls in ((8, "-"), (16, "--")):
                pts = sorted((r["tokens"] if program == "prefill" else r["batch"], r["speedup"], r["ceiling_speedup"])
                             for r in rows if r["model"] == m and r["gpus"] == g and r["program"] == program)
                if not pts:
                    continue
                xs = [p[0] for p in pts]
                ax.plot(xs, [p[1] for p in pts], ls, marker="o", color=colors[m],
                        label=f"{MODELS[m][1]}, {g // 8} node{'s' if g > 8 else ''}")
                ax.plot(xs, [p[2] for p in pts], ls, color=colors[m], alpha=0.3, lw=1)
        if program == "prefill":
            for m, mk in (("dsv2", "v"), ("scout", "^")):
                lo, hi = PAPER[m]["ttft"]
                ax.errorbar([16384 * 1.25], [(lo + hi) / 2], yerr=[[(hi - lo) / 2], [(hi - lo) / 2]], fmt=mk,
                            color=colors[m], capsize=4, label=f"paper {MODELS[m][1]} TTFT (vLLM, 8 GPUs)")
            ax.set_xlabel("prompt length (16 requests)")
            ax.set_title("prefill: TTFT speedup farskip / standard", fontsize=10)
        else:
            ax.axhline(PAPER["sglang_dsv3"]["decode_2node"], color="black", ls=":", lw=1,
                       label="paper: SGLang DeepSeek-V3 2-node decode (up to)")
            ax.set_xlabel("decode batch (requests)")
            ax.set_title("decode: time-per-output-token speedup", fontsize=10)
        ax.set_xscale("log", base=2)
        ax.axhline(1.0, color="black", lw=0.5)
        ax.set_ylabel("speedup (faint: ceiling, every all-reduce hidden)")
        ax.legend(fontsize=7)
    fig.suptitle(f"FarSkip at inference, modelled: tp_ep layout, two-stream {hardware} model "
                 "(8 x 400 Gb/s NICs per node)", fontsize=10)


def paper_cell(model: str, gpus: int, program: str) -> str:
    if program == "prefill" and gpus == 8 and model in ("dsv2", "scout"):
        lo, hi = PAPER[model]["ttft"]
        return f"TTFT {lo:.3f}-{hi:.3f}x (vLLM), overlap {100 * PAPER[model]['overlap']:.1f}%"
    if program == "prefill":
        return f"(SGLang DeepSeek-V3 prefill up to {PAPER['sglang_dsv3']['prefill']:.2f}x)"
    if gpus == 16:
        return f"(SGLang DeepSeek-V3 2-node decode up to {PAPER['sglang_dsv3']['decode_2node']:.2f}x)"
    return "-"


def summary_md(rows) -> str:
    """Per model, GPUs and program: the range over the points of the speedups and hidden fractions."""
    out = md_header(["model", "GPUs (nodes)", "program", "points", "speedup vs XLA standard",
                     "vs synchronous all-reduces", "ceiling", "AR hidden: standard", "AR hidden: farskip", "paper"])
    groups: dict = {}
    for r in rows:
        groups.setdefault((list(MODELS).index(r["model"]), r["gpus"], r["program"]), []).append(r)

    def rng(rs, k, pct=False):
        lo, hi = min(r[k] for r in rs), max(r[k] for r in rs)
        f = (lambda v: f"{100 * v:.1f}%") if pct else (lambda v: f"{v:.3f}x")
        return f(lo) if abs(hi - lo) < 5e-4 else f"{f(lo)} - {f(hi)}"

    for (mi, g, prog), rs in sorted(groups.items()):
        m = list(MODELS)[mi]
        pts = ", ".join(str(r["tokens"] if prog == "prefill" else r["batch"]) for r in rs)
        what = f"prefill 16 x ({pts})" if prog == "prefill" else f"decode batch ({pts})"
        out.append(f"| {MODELS[m][1]} ({rs[0]['depth']}) | {g} ({rs[0]['nodes']}) | {what} | {len(rs)} | "
                   f"{rng(rs, 'speedup')} | {rng(rs, 'speedup_vs_serial')} | {rng(rs, 'ceiling_speedup')} | "
                   f"{rng(rs, 'std_hidden', True)} | {rng(rs, 'fs_hidden', True)} | {paper_cell(m, g, prog)} |")
    return "\n".join(out)


def weight_floor_md(rows, bases, gpn, hardware: str = "h200") -> list[str]:
    """Plausibility of the decode rows: the weight-bandwidth floor (parameter bytes per GPU / (HBM
    bandwidth x mem_eff)) next to the modelled time per output token at the smallest batch."""

    hw = HARDWARE[hardware]
    out = ["", "Decode plausibility: parameter bytes each GPU reads per step / (HBM bandwidth x "
           f"{hw.mem_eff}) = the weight-bandwidth floor, next to the modelled standard time per output token "
           "(scanned programs: as compiled, and with the stacked-row copies free).", "",
           *md_header(["model", "GPUs", "GB per GPU", "weight floor ms", "TPOT ms by batch (standard)"])]
    seen = sorted({(r["model"], r["gpus"]) for r in rows if r["program"] == "decode"})
    for m, g in seen:
        cfg = ir.serving_config(bases[m], "standard", g, gpn)
        mesh = ir.serving_mesh(cfg, gpu_devices("h200", g, gpus_per_node=min(gpn, g)))
        b = ir.weight_bytes_per_device(cfg, mesh)
        tp = ", ".join(f"{r['batch']}: {r['standard_ms']:.2f}"
                       + (f" ({r['standard_inplace_ms']:.2f} in place)" if r.get("row_copy_ms") else "")
                       for r in rows if r["model"] == m and r["gpus"] == g and r["program"] == "decode")
        out.append(f"| {MODELS[m][1]} | {g} | {b / 1e9:.2f} | {1e3 * b / (hw.hbm_bw * hw.mem_eff):.2f} | {tp} |")
    return out + [""]


def timelines(cache_dir, hardware, out, ctx, full_layers, contention=None) -> list[str]:
    """One layer's two streams, standard above farskip, for DeepSeek-V2-Lite (else the first model
    cached) at prefill 16 x 4096 and decode batch 64 on 8 GPUs, from the schedule cache."""

    written, cache = [], CompileCache(cache_dir)
    for program, batch, tokens in (("prefill", 16, 4096), ("decode", 64, 1)):
        for m in MODELS:
            for layers in (full_layers[m], MODELS[m][2][1]):
                for suffix in ("|scan", ""):  # a scanned program's schedule (loop unrolled), else the per-layer one
                    keys = [key(m, 8, program, batch, tokens, ctx if program == "decode" else tokens, layers, p) + suffix
                            for p in ("standard", "farskip")]
                    if all(os.path.exists(cache.path(k)) for k in keys):
                        break
                if all(os.path.exists(cache.path(k)) for k in keys):
                    items = []
                    for preset, k in zip(("standard", "farskip"), keys):
                        c = cache.get(k)
                        items.append((f"{MODELS[m][1]} {program} {preset}", c["schedule"], c["node_of"]))
                    path = os.path.join(out, f"timeline_{m}_{program}.png")
                    plot_serving_timelines(items, hardware, program, layers // 2, path,
                                           scores_of(MODEL_CFGS[m], c["mesh"], program, batch, tokens), contention)
                    written.append(path)
                    break
            else:
                continue
            break
    return written


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="dsv2_lite,dsv2,scout")
    ap.add_argument("--gpus", default="8,16")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--programs", default="prefill,decode")
    ap.add_argument("--prompts", default="1024,2048,4096,8192,16384")
    ap.add_argument("--prefill-batch", type=int, default=16)
    ap.add_argument("--decode-batches", default="16,64,256,1024")
    ap.add_argument("--context", type=int, default=2048, help="decode: KV-cache length")
    ap.add_argument("--depth", default="auto", choices=("auto", "full", "cut"))
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--contention", type=float, default=None,
                    help="compute speed while a collective is in flight, fraction (0, 1] (default: the hardware's, "
                         "cost_model.HARDWARE; 1.0 = no contention)")
    ap.add_argument("--scan-layers", choices=("config", "true", "false"), default="config",
                    help="stacked layers decoded as a scan (serving/generate.py) or per-layer weights unrolled")
    ap.add_argument("--out", default=results_dir("inference"))
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "farskip_inference_cache"))
    ap.add_argument("--plot-only", action="store_true", help="rewrite table.md / speedup.png from results.json")
    ap.add_argument("--retime-only", action="store_true",
                    help="re-time the cached schedules (e.g. with another --hardware); compile nothing")
    a = ap.parse_args()


    try:
        contention = _contention(a.hardware, a.contention)
    except (FarSkipError, KeyError) as e:
        return fail(f"--hardware {a.hardware!r} / --contention {a.contention}: {e}")
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.cache, exist_ok=True)
    results = ResultStore(os.path.join(a.out, "results.json"))
    models = [m for m in a.models.split(",") if m]
    gpus_list = [int(g) for g in a.gpus.split(",")]
    points = []
    if "prefill" in a.programs:
        points += [("prefill", a.prefill_batch, int(p)) for p in a.prompts.split(",")]
    if "decode" in a.programs:
        points += [("decode", int(b), 1) for b in a.decode_batches.split(",")]
    bases = {m: load_config(os.path.join(REPO, MODELS[m][0])) for m in MODELS}
    MODEL_CFGS.update(bases)
    full_layers = {m: bases[m].model.num_layers for m in MODELS}
    if not a.plot_only:
        for m in models:
            full = a.depth == "full" or (a.depth == "auto" and m in FULL_BY_DEFAULT)
            depths = [None] if full else list(MODELS[m][2])
            for pt in grid(g=gpus_list, point=points, layers=depths, preset=("standard", "farskip")):
                g, (program, batch, tokens), layers, preset = pt["g"], pt["point"], pt["layers"], pt["preset"]
                n_l = layers or full_layers[m]
                k = key(m, g, program, batch, tokens, a.context if program == "decode" else tokens,
                        n_l, preset)
                try:
                    e = compile_point(bases[m], m, g, a.gpus_per_node, program, batch, tokens, a.context,
                                      layers, preset, a.hardware, a.cache, log, not a.retime_only,
                                      None if a.scan_layers == "config" else a.scan_layers == "true",
                                      a.contention)
                    if e is None:
                        continue
                    results[k] = e
                except Exception as e:  # keep the sweep going; the row stays missing
                    log(f"[inference] {k}: FAILED {type(e).__name__}: {str(e)[:300]}")
                    continue
                results.save()
                e = results[k]
                log(f"[inference] {k}: {e['time_us'] / 1e3:.3f} ms, all-reduces {e['ar_us'] / 1e3:.3f} ms "
                    f"({100 * e['layer_hidden_frac']:.1f}% of the layer ones hidden)")
    rows = rows_of(results, list(MODELS), [8, 16], points, a.context, full_layers)
    write_json(os.path.join(a.out, "rows.json"), rows)
    md = ["# FarSkip at inference (modelled): TTFT and time per output token, standard vs farskip", "",
          f"Two-stream {a.hardware} model (contention {contention:.2f}: compute speed under an all-reduce in "
          "flight) re-timing deviceless compiles of the tp_ep serving programs "
          "(docs/inference.md). Speedup = standard / farskip as XLA schedules both; 'vs sync AR' = standard "
          "with every all-reduce synchronous (a serving engine's standard model) / farskip; ceiling = standard "
          "/ (standard with every all-reduce hidden); AR share = all-reduce time / standard with synchronous "
          "all-reduces; AR hidden = share of the layer all-reduces (attention + routed) hidden. Depth 'cut a/b' = "
          "compiled at a and b layers, extrapolated linearly to the full depth.", "",
          f"Command: `JAX_PLATFORMS=cpu python -m farskip_jax.studies.inference_overlap --context {a.context}`", "",
          "## Summary (range over the points)", "", summary_md(rows), "", "## Every point", "", table_md(rows), ""]
    md += weight_floor_md(rows, bases, a.gpus_per_node, a.hardware)
    write_text(os.path.join(a.out, "table.md"), "\n".join(md) + "\n")
    if rows:
        plot(rows, os.path.join(a.out, "speedup.png"), a.hardware)
    for path in timelines(a.cache, a.hardware, a.out, a.context, full_layers, a.contention):
        log(f"[inference] wrote {path}")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())

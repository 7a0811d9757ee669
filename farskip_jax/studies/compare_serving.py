"""FarSkip against two-batch overlap (TBO) and FoE at inference: TTFT (prefill) and time per output
token (decode), one table and one plot per setting, every row from serving programs compiled the same
way and timed by the same cost model (modelled).

    JAX_PLATFORMS=cpu python -m farskip_jax.studies.compare_serving --gpus 8      # one node
    JAX_PLATFORMS=cpu python -m farskip_jax.studies.compare_serving --gpus 16     # two nodes
        [--model dsv3_6l_gqa|dsv3_6l|dsv2_lite] [--programs prefill,decode] [--prompts 1024,4096,16384]
        [--prefill-batch 16] [--decode-batches 16,64,256,1024] [--context 2048] [--hardware h200]
        [--contention F] [--variants ...] [--out benchmarks/results/compare_serving] [--plot-only]

Each point is a prefill of `--prefill-batch` requests x prompt (LM head on the last slot: what the
first token costs) or a decode step of a batch of requests against a `--context` cache
(serving/programs.py), compiled deviceless for H200s with the latency-hiding scheduler
(analysis/inference_report.compile_serving: all-reduce combiners and the dot merger off, routed
experts at a balanced grouped GEMM's cost) and re-timed by the two-stream model (H200 roofline,
NVLink inside a node, 8 x 400 Gb/s NICs per node; compute under a collective in flight at the
hardware's contention). Layers unrolled (per-layer weights) in every row. Rows:

  standard             inference.layout=tp_ep (the paper's layout: TP attention = EP MoE over all GPUs,
                       tensor-parallel shared experts), standard connectivity, XLA's schedule
  standard, no overlap the same schedule with every all-reduce synchronous (vLLM / SGLang's standard)
  standard + TBO       runtime.micro_batches=2: two micro-batches whose sub-blocks do not depend on each
                       other, one's compute under the other's all-reduces (SGLang's two-batch overlap)
  FarSkip, FarSkip + TBO
  FoE, FoE + FarSkip   inference.layout=foe: Federation of Experts with H = GPUs groups, one per GPU
                       (its heads, experts and cache rows; serving/foe.py): no all-to-all, one
                       cross-group sum per layer. "n/a: reason" where H does not split the model
                       (heads, kv heads, experts, top-k; MLA)

Columns: modelled time, exposed communication (time - compute at full speed), all-reduce time exposed,
all-reduce hidden, collectives, speedup over standard = hiding x compute (analysis/speedup.py). The
verdicts say which of FarSkip / TBO / FoE is faster and whether FarSkip + TBO adds up. Compiled
schedules are cached in --cache (a re-run only re-times); results go to
OUT/<model>_g<GPUs>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from types import SimpleNamespace
from typing import Optional

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from farskip_jax.studies.harness import (MODEL_OVERRIDES, MODELS, CompileCache, ResultStore, fail, figure, grid,
                                          log, md_header, md_row, model_config_path, results_dir, spread_range,
                                          tbo_verdicts, write_json, write_text)
from farskip_jax.analysis import inference_report as ir
from farskip_jax.analysis.deviceless import gpu_devices
from farskip_jax.analysis.calibration import variants_of_constants
from farskip_jax.analysis.speedup import split_speedup
from farskip_jax.analysis.cost_model import HARDWARE, with_contention
from farskip_jax.config import load_config
from farskip_jax.errors import ConfigError, FarSkipError

VARIANTS = ("standard", "standard_tbo", "farskip", "farskip_tbo", "foe", "foe_farskip")
ROWS = ("standard", "no_overlap", "standard_tbo", "farskip", "farskip_tbo", "foe", "foe_farskip")
LABELS = {"standard": "standard (XLA schedule)", "no_overlap": "standard, no overlap",
          "standard_tbo": "standard + TBO (tp_ep)", "farskip": "FarSkip", "farskip_tbo": "FarSkip + TBO (tp_ep)",
          "foe": "FoE (H = GPUs)", "foe_farskip": "FoE + FarSkip"}
# what others measured: shown next to our rows, not compared number for number
PUBLISHED = [
    "SGLang two-batch overlap, DeepSeek-V3 on 96 H100 in the dp_ep layout (DP attention + DeepEP all-to-all, EP 32 "
    "prefill / EP 72 decode, FP8; LMSYS large-scale EP write-up, 2025-05-05): prefill +27-35% throughput; decode "
    "+25.5% at 256 tokens per GPU, -27% at 32 (not the tp_ep layout of these rows)",
    "FarSkip-Collective (arXiv 2511.11505; AMD ROCm blog): 18% TTFT speedup Llama-4-Scout (vLLM); 32.6% TTFT "
    "speedup (1.33x, v1: up to 1.34x) DeepSeek-V3 (SGLang, CUDA graphs disabled); the authors' SGLang path "
    "refuses TBO",
]


def variant_overrides(variant: str) -> dict:
    """serving_config keyword arguments of a variant (besides the connectivity preset)."""
    return {"micro_batches": 2 if variant.endswith("_tbo") else 1}


def preset_of(variant: str) -> str:
    return "farskip" if "farskip" in variant else "standard"


def foe_groups_for(cfg, gpus: int) -> tuple[Optional[int], Optional[str]]:
    """(H, None) when H = gpus groups split the model (one group per GPU), else (None, 'n/a: why')."""
    m, e = cfg.model, cfg.moe
    need = [("model.attention", m.attention == "gqa", "MLA attention shares one latent projection over all heads"),
            ("heads", m.num_heads % gpus == 0, f"{m.num_heads} heads"), ("kv heads", m.num_kv_heads % gpus == 0,
                                                                          f"{m.num_kv_heads} kv heads"),
            ("experts", e.num_experts % gpus == 0, f"{e.num_experts} experts"),
            ("top-k", e.top_k % gpus == 0, f"top-{e.top_k} (k / H picks per group)"),
            ("routing", e.n_group == 1, "group-limited routing")]
    bad = [why for _, ok, why in need if not ok]
    if bad:
        return None, f"n/a: H = {gpus} groups cannot split {', '.join(bad)}"
    return gpus, None


def not_applicable(variant: str, cfg, gpus: int, program: str, batch: int) -> Optional[str]:
    if variant.endswith("_tbo") and batch % 2:
        return f"n/a: TBO splits the {batch} requests in two"
    if variant.startswith("foe"):
        return foe_groups_for(cfg, gpus)[1]
    return None


def key(model, gpus, program, batch, tokens, ctx, variant, extra=""):
    return f"{model}|g{gpus}|{program}|b{batch}|t{tokens}|c{ctx}|{variant}|{extra}"


def compile_point(base, model, gpus, program, batch, tokens, ctx, variant, cache_dir, log=log, extra="") -> dict:
    """The compiled schedule of one point (cached in cache_dir) and what it was compiled as."""

    k = key(model, gpus, program, batch, tokens, ctx, variant, extra)
    cache = CompileCache(cache_dir)
    kept = cache.get(k)
    if kept is not None:
        return kept
    foe = foe_groups_for(base, gpus)[0] if variant.startswith("foe") else None
    cfg = ir.serving_config(base, preset_of(variant), gpus, 8, None, False, foe_groups=foe, **variant_overrides(variant))
    mesh = ir.serving_mesh(cfg, gpu_devices("h200", gpus, gpus_per_node=min(8, gpus), memory_gb=1e4))
    t0 = time.time()
    t = tokens if program == "prefill" else 1
    prog = ir.compile_serving(cfg, mesh, program, batch, t, tokens if program == "prefill" else ctx)
    c = {"schedule": prog.schedule, "node_of": ir.node_of(mesh), "compile_s": time.time() - t0,
         "mesh": dict(mesh.shape), "layers": cfg.model.num_layers, "layout": cfg.inference.layout,
         "micro_batches": cfg.runtime.micro_batches, "preset": cfg.farskip.preset, "num_groups": cfg.runtime.num_groups,
         "scores": ir.score_elements(cfg, mesh, batch, tokens, tokens) if program == "prefill" else 0}
    cache.put(k, c)
    log(f"[serving] {k}: compiled in {c['compile_s']:.0f}s (mesh {c['mesh']})")
    return c


def time_point(c: dict, program: str, hardware: str, contention: Optional[float]) -> dict:
    """The ServingTiming json of a compiled point, with what it was compiled as."""

    t = ir.time_serving(c["schedule"], c["node_of"], hardware, program, c["scores"] or None, contention)
    meta = {k: c[k] for k in ("compile_s", "mesh", "layers", "layout", "micro_batches", "preset", "num_groups")}
    return {**t.to_json(), **meta, "nodes": len(set(c["node_of"]))}


def time_spread(c: dict, program: str, hardware: str) -> dict:
    """{constant-set: {time_us, serial_us}} of a compiled point under each fitted constant at the low
    and high end of its spread (calibration.variants_of_constants; docs/calibration.md)."""

    out = {}
    for lab, end, hw_w, lk_w in variants_of_constants():
        if not end:
            continue
        t = ir.time_serving(c["schedule"], c["node_of"], hardware, program, c["scores"] or None, None,
                            which=(hw_w, lk_w))
        out[f"{lab}:{end}"] = {"time_us": t.time_us, "serial_us": t.serial_us}
    return out


def add_ranges(rows: list[dict], entries: dict, spread: dict) -> None:
    """Each timed row's speedup range over the constants' spread and the constant that moves it most
    (`spread` {variant: time_spread(...)}; rows without every variant's spread are left as they are)."""
    std = spread.get("standard")
    for r in rows:
        if "speedup" not in r or std is None:
            continue
        v = "standard" if r["row"] == "no_overlap" else r["row"]
        if v not in spread:
            continue
        part = "serial_us" if r["row"] == "no_overlap" else "time_us"
        r.update(spread_range({k: std[k]["time_us"] for k in std}, {k: t[part] for k, t in spread[v].items()},
                              r["speedup"]))


def _rep(t: dict, serial: bool = False):
    return SimpleNamespace(step_time=t["serial_us"] if serial else t["time_us"], compute_time=t["compute_us"],
                           compute_by_scope=t.get("compute_by_scope", {}))


def rows_of(entries: dict, reasons: dict) -> list[dict]:
    """Rows of one point: `entries` {variant: timing json}, `reasons` {variant: 'n/a: ...'}; speedups
    over the standard entry's modelled time, split into hiding x compute."""

    std = entries["standard"]
    ref = _rep(std)
    rows = []
    for name in ROWS:
        if name == "no_overlap":
            t, serial = std, True
        elif name in entries:
            t, serial = entries[name], False
        else:
            rows.append({"row": name, "label": LABELS[name], "na": reasons.get(name, "n/a: not compiled")})
            continue
        r = _rep(t, serial)
        sp = split_speedup(ref, r)
        ar_exposed = t["ar_us"] if serial else t["ar_exposed_us"]
        rows.append({"row": name, "label": LABELS[name], "time_ms": r.step_time / 1e3,
                     "compute_ms": t["compute_us"] / 1e3, "exposed_ms": (r.step_time - t["compute_us"]) / 1e3,
                     "ar_ms": t["ar_us"] / 1e3, "ar_exposed_ms": ar_exposed / 1e3,
                     "hidden_pct": 0.0 if serial else 100 * t["hidden_frac"], "ar_count": int(round(t["ar_count"])),
                     "other_ms": t["other_collective_us"] / 1e3,
                     "speedup": sp.total, "hiding": sp.hiding, "compute": sp.compute,
                     "differs": [k for k, a, b in sp.scopes], "micro_batches": t["micro_batches"],
                     "layout": t["layout"], "preset": t["preset"], "num_groups": t["num_groups"]})
    return rows


def comm_share(entries: dict) -> float:
    """Standard's all-reduce time / its no-overlap time."""
    s = entries["standard"]
    return s["ar_us"] / s["serial_us"]


def verdicts(rows: list[dict], share: float) -> list[str]:
    by = {r["row"]: r for r in rows if "time_ms" in r}
    out = []
    fs, tbo, both, foe = by.get("farskip"), by.get("standard_tbo"), by.get("farskip_tbo"), by.get("foe")
    ms = lambda r: r["time_ms"] if r else None  # noqa: E731
    out += tbo_verdicts(ms(fs), ms(tbo), ms(both), share, "all-reduces {pct} of the no-overlap time")
    if foe:
        best = min(by.values(), key=lambda r: r["time_ms"])
        fsf = by.get("foe_farskip")
        out.append(f"fastest row: {best['label']} {best['time_ms']:.2f} ms; FoE {foe['time_ms']:.2f} ms"
                   + (f", FoE + FarSkip {fsf['time_ms']:.2f} ms" if fsf else ""))
    return out


def point_title(p: dict) -> str:
    if p["program"] == "prefill":
        return f"prefill {p['batch']} x {p['tokens']} (TTFT)"
    return f"decode batch {p['batch']}, context {p['context']} (time per output token)"


def table_md(setting: dict) -> str:
    out = []
    for p in setting["points"]:
        out += [f"#### {point_title(p)}: all-reduces {100 * p['comm_share']:.1f}% of the no-overlap time", "",
                *md_header(["row", "ms", "exposed comm ms", "AR exposed ms", "AR hidden", "collectives (AR)",
                            "vs standard", "range over the constants' spread (dominant)", "= hiding", "x compute",
                            "compute differs most"])]
        for r in p["rows"]:
            if "na" in r:
                out.append(md_row([r["label"], r["na"]] + [""] * 9))
                continue
            rng = f"{r['range'][0]:.3f}-{r['range'][1]:.3f}x ({r['dominant']})" if "range" in r else "-"
            out.append(f"| {r['label']} | {r['time_ms']:.3f} | {r['exposed_ms']:.3f} | {r['ar_exposed_ms']:.3f} | "
                       f"{r['hidden_pct']:.1f}% | {r['ar_count']} | {r['speedup']:.3f}x | {rng} | {r['hiding']:.3f}x | "
                       f"{r['compute']:.3f}x | {', '.join(r['differs'][:2]) or '-'} |")
        out += [""] + [f"- {v}" for v in p["verdicts"]] + [""]
    return "\n".join(out)


def summary_md(setting: dict) -> str:
    """One line per point: every row's speedup over standard."""
    names = [n for n in ROWS if n != "standard"]
    out = md_header(["point", "AR share"] + [LABELS[n] for n in names])
    for p in setting["points"]:
        by = {r["row"]: r for r in p["rows"]}
        cells = [(f"{by[n]['speedup']:.3f}x" + (f" ({by[n]['range'][0]:.3f}-{by[n]['range'][1]:.3f}x)"
                                                 if "range" in by[n] else ""))
                 if "speedup" in by.get(n, {}) else "n/a" for n in names]
        out.append(md_row([point_title(p), f"{100 * p['comm_share']:.1f}%"] + cells))
    return "\n".join(out)


def plot(setting: dict, path: str) -> None:
    """Speedup over standard per row, prefill points (left) and decode points (right)."""
    colors = {"no_overlap": "#333333", "standard_tbo": "#DD8452", "farskip": "#C44E52", "farskip_tbo": "#8C1C13",
              "foe": "#4C72B0", "foe_farskip": "#8172B3"}
    programs = [g for g in ("prefill", "decode") if any(p["program"] == g for p in setting["points"])]
    with figure(path, 1, len(programs), figsize=(6.2 * len(programs), 4.4), squeeze=False) as (fig, axes):
        _plot_axes(setting, colors, programs, fig, axes[0])


def _plot_axes(setting: dict, colors: dict, programs: list, fig, axes) -> None:
    for ax, prog in zip(axes, programs):
        pts = [p for p in setting["points"] if p["program"] == prog]
        xs = [p["tokens"] if prog == "prefill" else p["batch"] for p in pts]
        for name, col in colors.items():
            ys = [next((r.get("speedup") for r in p["rows"] if r["row"] == name), None) for p in pts]
            if any(y is not None for y in ys):
                ax.plot([x for x, y in zip(xs, ys) if y is not None], [y for y in ys if y is not None], marker="o",
                        color=col, label=LABELS[name], ls="--" if name == "no_overlap" else "-")
        ax.axhline(1.0, color="#8C8C8C", lw=1, label=LABELS["standard"])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt length (%d requests)" % pts[0]["batch"] if prog == "prefill" else "decode batch (requests)")
        ax.set_ylabel("speedup over standard (modelled)")
        ax.set_title("prefill: TTFT" if prog == "prefill" else f"decode: time per output token (context "
                     f"{pts[0]['context']})", fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle(f"{setting['model']} ({setting['num_layers']} layers) serving on {setting['gpus']} GPUs "
                 f"({setting['nodes']} node(s)), two-stream {setting['hardware']} model, contention "
                 f"{setting['contention']:.2f} (modelled)", fontsize=9)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="dsv3_6l_gqa", choices=sorted(MODELS))
    ap.add_argument("--gpus", type=int, default=8, help="8 (one node) or 16 (two nodes of 8)")
    ap.add_argument("--programs", default="prefill,decode")
    ap.add_argument("--prompts", default="1024,4096,16384")
    ap.add_argument("--prefill-batch", type=int, default=16)
    ap.add_argument("--decode-batches", default="16,64,256,1024")
    ap.add_argument("--context", type=int, default=2048, help="decode: KV-cache length")
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--contention", type=float, default=None,
                    help="compute speed under a collective in flight (default: the hardware's, cost_model.HARDWARE)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=results_dir("compare_serving"))
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "farskip_compare_serving"))
    ap.add_argument("--plot-only", action="store_true", help="re-table OUT/<model>_g<GPUs>.json, compile nothing")
    ap.add_argument("overrides", nargs="*", help="config overrides key=value")
    a = ap.parse_args(argv)


    try:
        if a.hardware not in HARDWARE:
            raise ConfigError(f"--hardware {a.hardware!r} is unknown; choose one of {sorted(HARDWARE)}")
        hw = with_contention(HARDWARE[a.hardware], a.contention)
        if a.gpus < 1 or (a.gpus > 8 and a.gpus % 8):
            raise ConfigError(f"--gpus {a.gpus}: give 8 or fewer GPUs, or whole nodes of 8")
        variants = [v for v in a.variants.split(",") if v]
        if [v for v in variants if v not in VARIANTS] or "standard" not in variants:
            raise ConfigError(f"--variants {a.variants!r}: give some of {list(VARIANTS)}, standard included")
        points = []
        if "prefill" in a.programs:
            points += [(p["program"], p["batch"], p["tokens"]) for p in
                       grid(program=["prefill"], batch=[a.prefill_batch], tokens=[int(t) for t in a.prompts.split(",") if t])]
        if "decode" in a.programs:
            points += [(p["program"], p["batch"], p["tokens"]) for p in
                       grid(program=["decode"], batch=[int(b) for b in a.decode_batches.split(",") if b], tokens=[1])]
        if not points:
            raise ConfigError(f"--programs {a.programs!r}: give prefill and/or decode")
        top = max([a.context] + [t for g, _, t in points if g == "prefill"])
        base = load_config(model_config_path(a.model),
                           MODEL_OVERRIDES.get(a.model, []) + [f"model.max_seq_len={max(top, 4096)}"] + a.overrides)
    except FarSkipError as e:
        return fail(str(e))
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.cache, exist_ok=True)
    stem = os.path.join(a.out, f"{a.model}_g{a.gpus}")
    old = ResultStore(stem + ".json")
    timings = old.get("timings", {}) if old.get("contention") == hw.contention else {}
    spreads = old.get("spreads", {}) if old.get("contention") == hw.contention else {}
    extra = "|".join(a.overrides)
    cmd = (f"JAX_PLATFORMS=cpu python -m farskip_jax.studies.compare_serving --model {a.model} --gpus {a.gpus}"
           + (f" --contention {a.contention:g}" if a.contention is not None else "")
           + (f" --hardware {a.hardware}" if a.hardware != "h200" else "") + "".join(f" {o}" for o in a.overrides))
    setting = {"model": a.model, "gpus": a.gpus, "nodes": max(1, a.gpus // 8), "num_layers": base.model.num_layers,
               "hardware": a.hardware, "contention": hw.contention, "command": cmd, "date": time.strftime("%Y-%m-%d"),
               "points": [], "timings": timings, "spreads": spreads}
    t_start = time.time()
    for program, batch, tokens in points:
        ctx = a.context if program == "decode" else tokens
        entries, reasons = {}, {}
        for v in variants:
            why = not_applicable(v, base, a.gpus, program, batch)
            if why:
                reasons[v] = why
                continue
            k = key(a.model, a.gpus, program, batch, tokens, ctx, v, extra)
            if k not in timings:
                if a.plot_only:
                    reasons[v] = "n/a: not compiled yet (run without --plot-only)"
                    continue
                try:
                    c = compile_point(base, a.model, a.gpus, program, batch, tokens, ctx, v, a.cache, log, extra)
                    timings[k] = time_point(c, program, a.hardware, a.contention)
                except FarSkipError as e:
                    reasons[v] = f"n/a: {e}"
                    continue
                write_json(stem + ".json", setting)
                log(f"[serving] {k}: {timings[k]['time_us'] / 1e3:.3f} ms "
                    f"({100 * timings[k]['layer_hidden_frac']:.1f}% of the layer all-reduces hidden; "
                    f"{time.time() - t_start:.0f}s so far)")
            entries[v] = timings[k]
            if k not in spreads and not a.plot_only and a.hardware in ("mi300x", "mi325x", "h100_sxm", "h200"):
                c = compile_point(base, a.model, a.gpus, program, batch, tokens, ctx, v, a.cache, log, extra)
                spreads[k] = time_spread(c, program, a.hardware)
                write_json(stem + ".json", setting)
        if "standard" not in entries:
            log(f"[serving] {program} {batch} x {tokens}: no standard row; skipped")
            continue
        share = comm_share(entries)
        rows = rows_of(entries, reasons)
        if a.contention is None:  # the spread is of the fitted constants (an override fixes contention)
            add_ranges(rows, entries, {v: spreads[key(a.model, a.gpus, program, batch, tokens, ctx, v, extra)]
                                       for v in entries
                                       if key(a.model, a.gpus, program, batch, tokens, ctx, v, extra) in spreads})
        setting["points"].append({"program": program, "batch": batch, "tokens": tokens, "context": ctx,
                                  "comm_share": share, "rows": rows, "verdicts": verdicts(rows, share)})
    setting["wall_s"] = time.time() - t_start
    write_json(stem + ".json", setting)
    md = [f"### {a.model} ({base.model.num_layers} layers) serving on {a.gpus} GPUs ({setting['nodes']} node(s)), "
          f"{a.hardware} two-stream model, contention {hw.contention:.2f} (modelled, {setting['date']})", "",
          f"Command: `{cmd}`", "", "Speedup over standard (XLA's schedule of the tp_ep layout) per point, with its "
          "range over the fitted constants' spread (docs/calibration.md):", "",
          summary_md(setting), "", "Published, for reference (other systems and models):", ""]
    md += [f"- {p}" for p in PUBLISHED] + ["", table_md(setting)]
    write_text(stem + ".md", "\n".join(md) + "\n")
    if setting["points"]:
        plot(setting, stem + ".png")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())

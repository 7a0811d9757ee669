"""Calibration and hold-out validation of the cost model: one command, one table.

    JAX_PLATFORMS=cpu python -m farskip_jax.analysis.calibration            # fit, compile what is missing, re-time, table
    JAX_PLATFORMS=cpu python -m farskip_jax.analysis.calibration --table-only   # re-table from the committed results

1. Fit: the constants of the cost model from the published component measurements in
   calibration_data/components.json (analysis/calibration_fit.py) -> calibration_data/fitted.json.
2. Compile (once; cached as schedule files in OUT/schedules): the train steps of the hold-out rows'
   settings (analysis/calibration_programs.py), standard and FarSkip.
3. Re-time every program under the central constants and under each fitted constant at the low and
   high end of its spread (one at a time), standard with its all-to-alls overlapped as XLA scheduled
   them and synchronous (the paper's baseline), FarSkip overlapped; a step of gradient accumulation
   over n micro-batches is n x the steady-state micro-batch (gradient reductions and update free) +
   the once-per-step remainder. Depth-cut compiles are extrapolated linearly (compare_overlap's rule).
4. Table: every hold-out row (calibration_data/holdout.json, fixed before the first run) with the
   published figure, the central modelled figure, its range over the constants' spread and the
   constant that dominates it, the error on the speedup and on the gain, and whether it agrees
   (max(3 points, 30% of the published gain) for a speedup, 10 points for a hidden fraction).
   SGLang's TBO rows are serving programs of the dp_ep layout, timed by farskip_jax/studies/compare_dp_ep.py
   under the same constant sets (its committed results.json; DP_EP_RESULTS).
   -> OUT/results.json, OUT/table.md (docs/calibration.md quotes it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional
import dataclasses

from farskip_jax.analysis.calibration_fit import DATA_DIR, fit_constants, fitted_json, load_components, load_fitted
from farskip_jax.analysis.calibration_programs import PROGRAMS, ROOT, VARIANTS, compile_program_file, overrides_of
from farskip_jax.errors import ConfigError
from farskip_jax.analysis.cost_model import hardware_from_fit, optimizer_step, simulate, with_contention
from farskip_jax.analysis.report import ALL_TO_ALLS, analyze
from farskip_jax.analysis.schedule_store import load_schedule_file
from farskip_jax.analysis.topology import links_from_fit, resized, Topology
from farskip_jax.config import load_config
from farskip_jax.analysis.dp_ep_report import point_rows

OUT = os.path.join(ROOT, "benchmarks", "results", "calibration")
# the SGLang TBO rows: the dp_ep serving study's committed results (farskip_jax/studies/compare_dp_ep.py)
DP_EP_RESULTS = os.path.join(ROOT, "benchmarks", "results", "compare_dp_ep")
# constants varied for the spread: label -> (Hardware fields, Links fields), varied together when one
# source fitted them together
SPREAD = {
    "matmul_eff": (("matmul_eff",), ()),
    "mem_eff": (("mem_eff",), ()),
    "a2a_bw": (("a2a_bw",), ("intra_eff",)),
    "coll_bw": (("coll_bw",), ("coll_bw",)),
    "inter_eff": ((), ("inter_eff",)),
    "contention": (("contention", "contention_comm"), ()),
}
OWN_STREAM = ("all-reduce", "all-gather", "reduce-scatter")  # Megatron's DP gradient reduction: its own communicator


def holdout_rows(path: Optional[str] = None) -> dict:
    with open(path or os.path.join(DATA_DIR, "holdout.json")) as f:
        return json.load(f)


def variants_of_constants() -> list[tuple[str, str, dict, dict]]:
    """[(label, end, hardware which, links which)]: central first, then each SPREAD constant low / high."""
    out = [("central", "", {}, {})]
    for name, (hw_fields, link_fields) in SPREAD.items():
        for end in ("low", "high"):
            out.append((name, end, {f: end for f in hw_fields}, {f: end for f in link_fields}))
    return out


def score_flops(spec) -> float:
    """Forward FLOPs per attention score element of the spec's model: 2 (qk head dim + v head dim)."""
    m = load_config(os.path.join(ROOT, spec.config)).model
    if m.attention == "mla":
        return 2.0 * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
    return 4.0 * (m.head_dim or m.d_model // m.num_heads)


def retime(schedule, node_of, hardware: str, hw_which: dict, link_which: dict, flops_per_score: float,
           nics_per_node: Optional[int] = None, contention: Optional[float] = None) -> dict:
    """One compiled train step re-timed: steady / full (gradient reductions and update counted), each
    overlapped as scheduled and with every all-to-all synchronous; the all-to-all totals per direction."""
    fitted = load_fitted()
    hw = with_contention(hardware_from_fit(hardware, fitted, hw_which), contention)
    links = links_from_fit(hardware, fitted, link_which)

    per = max(node_of.count(x) for x in set(node_of))
    lk = resized(links, per)
    if nics_per_node is not None:
        lk = dataclasses.replace(lk, nics_per_node=nics_per_node)
    topo = Topology(lk, tuple(node_of))
    free = optimizer_step(schedule)
    out = {}
    for part, fr in (("steady", free), ("full", None)):
        for mode, ser in (("overlap", ()), ("serial", ALL_TO_ALLS)):
            s, d = simulate(schedule, hw, topology=topo, own_stream=OWN_STREAM, in_place_updates=True, free=fr,
                            serialize=ser, unfused_attention=flops_per_score)
            rep = analyze(s, d)
            fig = {"step_us": rep.step_time, "compute_us": rep.compute_time}
            for direction in ("fwd", "bwd"):
                t = rep.totals(direction)
                fig[f"a2a_{direction}_us"] = t["duration"]
                fig[f"a2a_{direction}_hidden_us"] = t["hidden"]
            out[f"{part}_{mode}"] = fig
    return out


def _lin(a, b, f):
    if isinstance(a, dict):
        return {k: _lin(a[k], b[k], f) for k in a}
    return a + (b - a) * f


def program_figures(spec, cache_dir: str, log=None, nic_sweep: tuple = ()) -> dict:
    """{constant-set key: {variant: retime figures}} of one program (extrapolated to full depth when
    compiled at two depths); keys: 'central', '<constant>:low|high', 'nics<N>' (central constants,
    N NICs per node), 'diag:no_contention' (central constants without any contention: a diagnostic
    of how much the contention costs, never a fit)."""
    fps = score_flops(spec)
    out: dict = {}
    sets = [(f"{lab}:{end}" if end else lab, hw_w, lk_w, None, None)
            for lab, end, hw_w, lk_w in variants_of_constants()]
    sets += [(f"nics{n}", {}, {}, n, None) for n in nic_sweep]
    sets.append(("diag:no_contention", {}, {}, None, 1.0))
    for variant in VARIANTS:
        per_depth = {}
        for layers in spec.layers:
            path = os.path.join(cache_dir, spec.key(variant, layers) + ".json.gz")
            sched, meta = load_schedule_file(path)
            if meta.get("overrides") != overrides_of(spec, layers, variant):
                raise ConfigError(f"{path} was compiled with {meta.get('overrides')}, not the program's "
                                  f"{overrides_of(spec, layers, variant)}: delete it and re-run to recompile")
            per_depth[layers] = {key: retime(sched, meta["node_of"], spec.hardware, hw_w, lk_w, fps, nics, c)
                                 for key, hw_w, lk_w, nics, c in sets}
            if log:
                log(f"[calibration] re-timed {spec.key(variant, layers)} under {len(sets)} constant sets")
        if len(spec.layers) == 2:
            la, lb = spec.layers
            f = (spec.full_layers - la) / (lb - la)
            figs = {k: _lin(per_depth[la][k], per_depth[lb][k], f) for k in per_depth[la]}
        else:
            figs = per_depth[spec.layers[0]]
        for k, v in figs.items():
            out.setdefault(k, {})[variant] = v
    return out


def step_us(fig: dict, mode: str, n_micro: float) -> float:
    """A step of n_micro micro-batches: n x steady + the once-per-step remainder (full - steady)."""
    st, full = fig[f"steady_{mode}"]["step_us"], fig[f"full_{mode}"]["step_us"]
    return n_micro * st + (full - st)


def row_value(row: dict, figs: dict, spec) -> float:
    """The modelled figure of a hold-out row under one constant set's figures {variant: ...}."""
    if row["kind"] == "speedup":
        n = row["global_sequences"] / (spec.ep * spec.batch_per_gpu)
        return step_us(figs["standard"], "serial", n) / step_us(figs["farskip"], "overlap", n)
    d = row["kind"].split("_")[1]
    f = figs["farskip"]["steady_overlap"]
    # at most 1: hidden time and all-to-all time are extrapolated apart (program_figures)
    return min(f[f"a2a_{d}_hidden_us"] / f[f"a2a_{d}_us"], 1.0) if f[f"a2a_{d}_us"] else 1.0


def tolerance(row: dict) -> float:
    return max(0.03, 0.30 * abs(row["published"] - 1.0)) if row["kind"] == "speedup" else 0.10


def dp_ep_entry(e: dict, row: dict, study: dict) -> dict:
    """A hold-out row modelled by the dp_ep serving study (row["dp_ep"]: its point and variant in
    benchmarks/results/compare_dp_ep/results.json): the variant's throughput over standard without
    overlap, central and over the constants' spread, with FarSkip and FarSkip + TBO beside it."""

    pt = study["points"][row["dp_ep"]["point"]]
    rows = point_rows(pt, study["depths"], study["layers"])
    r = rows[row["dp_ep"]["variant"]]
    gain = row["published"] - 1.0
    e.update(central=r["central"], low=r["low"], high=r["high"], dominant=r["dominant"],
             error=r["central"] - row["published"], agrees=abs(r["central"] - row["published"]) <= e["tolerance"] + 1e-12,
             gain_error=(r["central"] - 1.0) - gain, gain_ratio=(r["central"] - 1.0) / gain if gain else float("nan"),
             beside={k: rows[k]["central"] for k in ("farskip", "farskip_tbo") if k in rows},
             no_contention=r.get("no_contention"),
             a2a_share=rows["_standard"]["a2a_share"])
    return e


def evaluate(rows: list[dict], results: dict, dp_ep: Optional[dict] = None) -> list[dict]:
    """Table entries of the hold-out rows from results {program: program_figures(...)} and the dp_ep
    serving study's results (rows with a `dp_ep` point; None: they stay pending)."""
    out = []
    for row in rows:
        e = {k: row[k] for k in ("id", "kind", "published", "source", "setting")}
        e["tolerance"] = tolerance(row)
        if row.get("dp_ep") and dp_ep is not None and row["dp_ep"]["point"] in dp_ep["points"]:
            out.append(dp_ep_entry(e, row, dp_ep))
            continue
        if row.get("dp_ep"):
            e["pending"] = f"run farskip_jax/studies/compare_dp_ep.py (point {row['dp_ep']['point']})"
            out.append(e)
            continue
        if row.get("pending") or row.get("program") not in results:
            e["pending"] = row.get("pending") or "not run"
            out.append(e)
            continue
        spec = PROGRAMS[row["program"]]
        res = results[row["program"]]
        vals = {k: row_value(row, v, spec) for k, v in res.items() if not k.startswith(("nics", "diag"))}
        central = vals["central"]
        swings = {}
        for k, v in vals.items():
            if ":" in k:
                name = k.split(":")[0]
                swings.setdefault(name, []).append(v)
        dom = max(swings, key=lambda n: max(swings[n] + [central]) - min(swings[n] + [central]))
        e["no_contention"] = row_value(row, res["diag:no_contention"], spec) if "diag:no_contention" in res else None
        e.update(central=central, low=min(vals.values()), high=max(vals.values()), dominant=dom,
                 error=central - row["published"], agrees=abs(central - row["published"]) <= e["tolerance"] + 1e-12)
        if row["kind"] == "speedup":
            gain = row["published"] - 1.0
            e["gain_error"] = (central - 1.0) - gain
            e["gain_ratio"] = (central - 1.0) / gain if gain else float("nan")
            e["nics"] = {k: row_value(row, v, spec) for k, v in res.items() if k.startswith("nics")}
            n = row["global_sequences"] / (spec.ep * spec.batch_per_gpu)
            std = res["central"]["standard"]
            xla = [step_us(v["standard"], "overlap", n) / step_us(v["farskip"], "overlap", n)
                   for k, v in res.items() if not k.startswith(("nics", "diag"))]
            e["vs_xla_standard"] = step_us(std, "overlap", n) / step_us(res["central"]["farskip"], "overlap", n)
            e["vs_xla_range"] = [min(xla), max(xla)]
            e["a2a_share"] = (std["steady_serial"]["a2a_fwd_us"] + std["steady_serial"]["a2a_bwd_us"]) / \
                std["steady_serial"]["step_us"]
        out.append(e)
    return out


def _fmt(e: dict) -> str:
    if e["kind"] == "speedup":
        return lambda x: f"{x:.3f}x"
    return lambda x: f"{100 * x:.1f}%"


def table_md(entries: list[dict], reasons: Optional[dict] = None) -> str:
    """The hold-out table (markdown) of evaluate()'s entries; `reasons` {row id: why it misses}."""
    reasons = reasons or {}
    lines = ["| row | published | modelled (central) | range over the constants' spread | dominant constant | "
             "error (speedup / gain) | agrees (tolerance) | diagnostics (not fits) | why not |",
             "|---|---|---|---|---|---|---|---|---|"]
    for e in entries:
        f = _fmt(e)
        pub = f(e["published"])
        if "pending" in e:
            lines.append(f"| {e['id']} | {pub} | pending: {e['pending']} | | | | counted as no | | |")
            continue
        err = (f"{100 * e['error']:+.1f} pts / gain x{e['gain_ratio']:.2f}" if e["kind"] == "speedup"
               else f"{100 * e['error']:+.1f} pts")
        tol = f"±{100 * e['tolerance']:.1f} pts"
        diag = []
        if e.get("no_contention") is not None:
            diag.append(f"no contention {f(e['no_contention'])}")
        for k, v in sorted((e.get("nics") or {}).items()):
            diag.append(f"{k[4:]} NICs/node {f(v)}")
        if e.get("beside"):
            diag.append("beside it: " + ", ".join(f"{'FarSkip + TBO' if k == 'farskip_tbo' else 'FarSkip'} {v:.3f}x"
                                                 for k, v in e["beside"].items())
                        + f"; a2a {100 * e['a2a_share']:.1f}% of the no-overlap step")
        if "vs_xla_standard" in e:
            lo, hi = e.get("vs_xla_range", [e["vs_xla_standard"]] * 2)
            diag.append(f"vs XLA-overlapped standard {e['vs_xla_standard']:.3f}x ({lo:.3f}-{hi:.3f}x); a2a "
                        f"{100 * e['a2a_share']:.1f}% of the no-overlap micro-batch")
        lines.append(f"| {e['id']} | {pub} | {f(e['central'])} | {f(e['low'])} - {f(e['high'])} | {e['dominant']} | "
                     f"{err} | {'yes' if e['agrees'] else 'no'} ({tol}) | {'; '.join(diag)} | "
                     f"{reasons.get(e['id'], '') if not e['agrees'] else ''} |")
    n_eval = sum(1 for e in entries if "pending" not in e)
    n_ok = sum(1 for e in entries if e.get("agrees"))
    lines += ["", f"Agreement: {n_ok} of {n_eval} evaluated rows ({100 * n_ok / max(n_eval, 1):.0f}%); "
                  f"{n_ok} of {len(entries)} listed rows ({100 * n_ok / len(entries):.0f}%), pending rows counted as not "
                  "agreeing."]
    return "\n".join(lines)


def _num(k: str, v: float) -> str:
    if k in ("coll_bw", "a2a_bw"):
        return f"{v / 1e9:.1f} GB/s"
    if k == "coll_size_half":
        return f"{v / 2**20:.2f} MiB"
    if k.endswith("_us"):
        return f"{v:.1f} us"
    return f"{v:.3f}"


def constants_md(fitted: dict) -> str:
    """The constants table per hardware: value, spread, what it is fitted to, residuals (fitted.json)."""
    lines = ["| hardware | constant | value | spread (low - high) | fitted to (source, setting) | residuals |",
             "|---|---|---|---|---|---|"]
    for hw, consts in fitted.items():
        for k, f in consts.items():
            src = "; ".join(dict.fromkeys(t for _, _, t in f["sources"])) if f["sources"] else ""
            what = (f["note"] + (": " if f["note"] and src else "") + src) if f["note"] not in src else src
            if not f["fitted"]:
                what = "**not fitted** - " + what
            res = ", ".join(f"{100 * r:+.1f}%" for _, r, _ in f["sources"]) if f["sources"] else "-"
            lines.append(f"| {hw} | {k} | {_num(k, f['value'])} | {_num(k, f['low'])} - {_num(k, f['high'])} | "
                         f"{what.replace('|', '/')} | {res} |")
    return "\n".join(lines)


def run(out_dir: str = OUT, compile_missing: bool = True, log=None) -> dict:
    """Fit, compile what is missing, re-time every hold-out program; writes OUT/results.json."""
    fits = fit_constants(load_components())
    with open(os.path.join(DATA_DIR, "fitted.json"), "w") as f:
        json.dump(fitted_json(fits), f, indent=1)
    cache = os.path.join(out_dir, "schedules")
    hold = holdout_rows()
    rows = hold["rows"] + hold["extra_rows"]
    names = sorted({r["program"] for r in rows if r.get("program") and not r.get("pending")})
    nic_programs = {r["program"] for r in rows if r["id"].startswith("F5")}
    results = {}
    for name in names:
        spec = PROGRAMS[name]
        for v in VARIANTS:
            for layers in spec.layers:
                path = os.path.join(cache, spec.key(v, layers) + ".json.gz")
                if not os.path.exists(path):
                    if not compile_missing:
                        raise FileNotFoundError(path)
                    compile_program_file(spec, v, layers, cache, log)
        results[name] = program_figures(spec, cache, log, nic_sweep=(4, 2) if name in nic_programs else ())
    payload = {"date": time.strftime("%Y-%m-%d"), "programs": results}
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(payload, f, indent=1, sort_keys=True)
    return payload


def write_table(out_dir: str = OUT) -> str:
    """The hold-out table (and the extra rows) from OUT/results.json -> OUT/table.md; returns it."""
    with open(os.path.join(out_dir, "results.json")) as f:
        payload = json.load(f)
    hold = holdout_rows()
    rpath = os.path.join(DATA_DIR, "holdout_reasons.json")
    reasons = json.load(open(rpath))["reasons"] if os.path.exists(rpath) else {}
    dp_path = os.path.join(DP_EP_RESULTS, "results.json")
    dp_ep = json.load(open(dp_path)) if os.path.exists(dp_path) else None
    entries = evaluate(hold["rows"], payload["programs"], dp_ep)
    extra = evaluate([dict(r, kind="speedup", published=float("nan"), source="", setting=r["note"])
                      for r in hold["extra_rows"]], payload["programs"])
    with open(os.path.join(out_dir, "constants.md"), "w") as f:
        f.write(constants_md(load_fitted()) + "\n")
    md = [f"Modelled {payload['date']} (`JAX_PLATFORMS=cpu python -m farskip_jax.analysis.calibration`)", "",
          table_md(entries, reasons), ""]
    for e in extra:
        md.append(f"Extra row {e['id']} (not counted): modelled {e['central']:.3f}x ({e['low']:.3f} - {e['high']:.3f}x)")
    text = "\n".join(md)
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out_dir, "table.json"), "w") as f:
        json.dump({"rows": entries, "extra": extra}, f, indent=1)
    return text


DOC = os.path.join(ROOT, "docs", "calibration.md")


def update_doc(text: str, marker: str, path: str = DOC) -> bool:
    """Replace what stands between `<!-- marker:begin -->` and `<!-- marker:end -->` in `path` by
    `text`; False (nothing written) when the file or the markers are missing."""
    if not os.path.exists(path):
        return False
    with open(path) as f:
        doc = f.read()
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    if begin not in doc or end not in doc:
        return False
    head, rest = doc.split(begin, 1)
    _, tail = rest.split(end, 1)
    with open(path, "w") as f:
        f.write(head + begin + "\n" + text.strip() + "\n" + end + tail)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m farskip_jax.analysis.calibration", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=OUT, help="results folder (schedules/, results.json, table.md)")
    ap.add_argument("--table-only", action="store_true", help="re-table from OUT/results.json (no fit, no re-timing)")
    ap.add_argument("--no-compile", action="store_true", help="fail instead of compiling a missing program")
    a = ap.parse_args(argv)
    log = lambda m: print(m, file=sys.stderr, flush=True)
    try:
        if not a.table_only:
            run(a.out, compile_missing=not a.no_compile, log=log)
        text = write_table(a.out)
        print(text)
        if a.out == OUT:  # the committed results: docs/calibration.md quotes them
            update_doc(text, "holdout")
            with open(os.path.join(a.out, "constants.md")) as f:
                update_doc(f.read(), "constants")
    except FileNotFoundError as e:
        print(f"error: {e}: compile it (drop --no-compile) or re-table with --table-only", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Compile time and program size of a train step, layers unrolled (a Python loop) vs scanned
(runtime.scan_layers), side by side, deviceless for 8 compile-only H100s (no GPU needed).

    JAX_PLATFORMS=cpu python -m benchmarks.scan_compile [--config configs/deepseek_v2_lite.yaml]
        [--layers 4,27,61] [--modes loop,scan] [--batch 8] [--seq 2048] [--timeout 1200]
        [--out benchmarks/results/scan] [config overrides ...]

Each (layers, mode) is compiled in its own subprocess (fresh XLA and JAX caches, and a --timeout that
kills one that runs too long: the 61-layer loop on a small CPU), with the config's mesh (EP 8),
`model.num_layers` overridden, the all_to_all dispatch at capacity factor 1.0, the latency-hiding
scheduler on (analysis/deviceless.LHS_FLAGS) and the routed experts as the grouped-GEMM cost proxy
(analysis/programs.grouped_gemm_proxy), as the overlap report compiles it. Measured: trace + lower
seconds, XLA compile seconds, and the number of HLO instructions in the compiled, scheduled module
(`compiled.as_text()`: lines `%name = ...` over all computations; a while body counts once).
Results: OUT/compile.json (updated after every compile; an entry already there is reused unless
--force) and OUT/compile.md. Timings are CPU seconds on whatever host runs this: read the ratios.

    JAX_PLATFORMS=cpu python -m benchmarks.scan_compile --report --layers 4,27 --modes scan,loop [--timeout 3600]

instead runs the overlap report (analysis/overlap.py, standard and farskip) of the train step once per
(layers, mode), each in its own process: DeepSeek-V2-Lite config, batch 8 x seq 4096, 8 compile-only
H200s, two-stream MI300X model, grouped-GEMM proxy (REPORT_FLAGS). Results: OUT/overlap_report_L<n>_<mode>.json
(reused unless --force) and OUT/overlap_report.md, scanned and unrolled side by side (docs/scan.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

INSTR = re.compile(r"^\s*(ROOT\s+)?%[\w.\-]+ = ", re.M)


def measure(config: str, layers: int, mode: str, batch: int, seq: int, overrides: list[str]) -> dict:
    """Runs in the child process: one deviceless compile, its figures."""
    import jax

    from farskip_jax.analysis.deviceless import LHS_FLAGS, gpu_devices
    from farskip_jax.analysis.programs import analysis_mesh, grouped_gemm_proxy, train_program
    from farskip_jax.config import load_config

    cfg = load_config(config, ["runtime.dispatch=all_to_all", "runtime.capacity_factor=1.0", *overrides,
                               f"model.num_layers={layers}", f"runtime.scan_layers={str(mode == 'scan').lower()}"])
    mesh = analysis_mesh(cfg, gpu_devices("h100_sxm", 8))
    t0 = time.perf_counter()
    with grouped_gemm_proxy():
        fn, args = train_program(cfg, mesh, batch, seq)
        lowered = fn.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile(compiler_options=dict(LHS_FLAGS))
    t2 = time.perf_counter()
    text = compiled.as_text()
    while_ops = len(re.findall(r"^\s*%\S+ = .* while\(", text, re.M))
    return dict(layers=layers, mode=mode, lower_s=round(t1 - t0, 2), compile_s=round(t2 - t1, 2),
                instructions=len(INSTR.findall(text)), while_loops=while_ops, hlo_chars=len(text),
                jax=jax.__version__, batch=batch, seq=seq, config=config, overrides=overrides)


def computations(text: str) -> dict[str, list[str]]:
    """{computation name: its instruction lines in (scheduled) order} of an HLO module text."""
    out, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"^(?:ENTRY )?%([\w.\-]+) .*\{$", line)
        if m:
            cur = out.setdefault(m.group(1), [])
        elif line.startswith("}"):
            cur = None
        elif cur is not None and INSTR.match(line):
            cur.append(line)
    return out


def _scope(line: str) -> str:
    m = re.search(r'op_name="([^"]*)"', line)
    name = m.group(1) if m else ""
    bwd = "bwd" if "transpose(" in name else "fwd"
    for key in ("dispatch", "combine", "attention", "shared", "expert_compute", "router", "dense_mlp"):
        if f"/{key}" in name:
            return f"{bwd}:{key}"
    return f"{bwd}:other"


def while_body_overlap(text: str) -> list[dict]:
    """Raw facts of the scheduled while bodies: for every async all-to-all in a body, its scope
    (fwd/bwd : dispatch/combine), and the compute instructions XLA placed between its start and its
    done, counted per scope (attention, shared, expert_compute, router, ...)."""
    comps = computations(text)
    bodies = []
    for lines in comps.values():
        for ln in lines:
            m = re.search(r" while\(.*body=%([\w.\-]+)", ln)
            if m:
                bodies.append(m.group(1))
    out = []
    for b in bodies:
        lines = comps.get(b, [])
        name = lambda ln: re.match(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = ", ln).group(1)  # noqa: E731
        starts = {}
        pairs = []
        for pos, ln in enumerate(lines):
            if " all-to-all-start(" in ln:
                starts[name(ln)] = pos
            m = re.search(r" all-to-all-done\(%([\w.\-]+)\)", ln)
            if m and m.group(1) in starts:
                p0 = starts[m.group(1)]
                between: dict[str, int] = {}
                for x in lines[p0 + 1:pos]:
                    if any(k in x for k in (" fusion(", " custom-call(", " dot(", " convolution(")):
                        sc = _scope(x)
                        between[sc] = between.get(sc, 0) + 1
                pairs.append(dict(collective=_scope(lines[p0]), start=p0, done=pos, compute_between=between))
        totals: dict[str, int] = {}
        for x in lines:
            if any(k in x for k in (" fusion(", " custom-call(", " dot(", " convolution(")):
                sc = _scope(x)
                totals[sc] = totals.get(sc, 0) + 1
        out.append(dict(body=b, instructions=len(lines), compute_totals=totals, all_to_alls=pairs))
    return out


def overlap_facts(config: str, batch: int, seq: int, overrides: list[str]) -> dict:
    """Compile the scanned 4-layer train step for farskip and standard; while-body facts of each."""
    from farskip_jax.analysis.deviceless import LHS_FLAGS, gpu_devices
    from farskip_jax.analysis.programs import analysis_mesh, grouped_gemm_proxy, train_program
    from farskip_jax.config import load_config

    res = {}
    for preset in ("standard", "farskip"):
        cfg = load_config(config, ["runtime.dispatch=all_to_all", "runtime.capacity_factor=1.0", *overrides,
                                   "model.num_layers=4", "runtime.scan_layers=true", f"farskip.preset={preset}"])
        mesh = analysis_mesh(cfg, gpu_devices("h100_sxm", 8))
        with grouped_gemm_proxy():
            fn, args = train_program(cfg, mesh, batch, seq)
            lowered = fn.lower(*args)
        text = lowered.compile(compiler_options=dict(LHS_FLAGS)).as_text()
        if os.environ.get("SCAN_HLO_DIR"):  # keep the scheduled module for reading
            with open(os.path.join(os.environ["SCAN_HLO_DIR"], f"scan4_{preset}.hlo.txt"), "w") as f:
                f.write(text)
        res[preset] = while_body_overlap(text)
    return res


REPORT_FLAGS = ["--programs", "train", "--target", "h200", "--hardware", "mi300x", "--grouped-gemm", "--batch", "8",
                "--seq", "4096"]


def report_child(config: str, layers: int, layout: str, overrides: list[str], path: str) -> None:
    """Runs in the child process: the overlap report (analysis/overlap.py, standard and farskip) of the
    train step with the layers scanned or unrolled; its JSON (+ the printed report) written to path."""
    from farskip_jax.analysis.overlap import main as overlap_main

    out = path + ".dir"
    argv = ["--config", config, *REPORT_FLAGS, "--out", out, "runtime.dispatch=all_to_all", "runtime.capacity_factor=1.0",
            *overrides, f"model.num_layers={layers}", f"runtime.scan_layers={str(layout == 'scan').lower()}"]
    import contextlib
    import io

    buf = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(buf):
        rc = overlap_main(argv)
    with open(os.path.join(out, "report.json")) as f:
        rep = json.load(f)
    with open(path, "w") as f:
        json.dump(dict(layers=layers, layout=layout, rc=rc, wall_s=round(time.perf_counter() - t0, 1),
                       command="python -m farskip_jax.analysis.overlap " + " ".join(argv), report=rep,
                       text=buf.getvalue()), f, indent=1)


def report_rows(entry: dict) -> list[dict]:
    """Per connectivity: the two-stream (headline) and XLA figures of one report_child result."""
    rows = []
    train = entry["report"]["train"]
    std = train["standard"]
    for conn, r in train.items():
        for model, m, base in (("two-stream mi300x", r["modelled"], std["modelled"]), ("XLA (h200)", r, std)):
            t = m["totals"]
            rows.append(dict(layers=entry["layers"], layout=r["program_layout"], model=model, conn=conn,
                             fwd=100 * t["fwd"]["hidden_frac"], bwd=100 * t["bwd"]["hidden_frac"],
                             all=100 * t["all"]["hidden_frac"], bound=100 * t["all"]["bound_frac"],
                             n=t["all"]["count"], exposed_ms=t["all"]["exposed"] / 1e3,
                             step_ms=m["step_time_us"] / 1e3, speedup=base["step_time_us"] / m["step_time_us"],
                             compile_s=r["compile_s"]))
    return rows


def report_table(entries: list[dict]) -> str:
    rows = [r for e in entries for r in report_rows(e)]
    out = ["| layers | program | model | conn | all-to-alls | fwd hidden | bwd hidden | all hidden | structural bound "
           "| exposed a2a ms | exposed / step | step ms | fs / std (same program) | compile s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    def order(r):
        return r["layers"], r["model"] != "two-stream mi300x", r["layout"], r["conn"] != "standard"

    for r in sorted(rows, key=order):
        out.append(f"| {r['layers']} | {r['layout']} | {r['model']} | {r['conn']} | {r['n']} | {r['fwd']:.1f}% | "
                   f"{r['bwd']:.1f}% | {r['all']:.1f}% | {r['bound']:.1f}% | {r['exposed_ms']:.2f} | "
                   f"{100 * r['exposed_ms'] / r['step_ms']:.2f}% | "
                   f"{r['step_ms']:.2f} | "
                   f"{r['speedup']:.3f}x | {r['compile_s']:.0f} |")
    return "\n".join(out) + "\n"


def report_main(a, overrides: list[str]) -> int:
    """--report: scanned vs unrolled overlap reports side by side, one child process per (layers, layout)."""
    os.makedirs(a.out, exist_ok=True)
    entries = []
    for n in [int(x) for x in a.layers.split(",")]:
        for layout in a.modes.split(","):
            path = os.path.join(a.out, f"overlap_report_L{n}_{layout}.json")
            if not (os.path.isfile(path) and not a.force):
                cmd = [sys.executable, __file__, "--report-child", f"{n}/{layout}", path, "--config", a.config,
                       *overrides]
                t0 = time.perf_counter()
                try:
                    p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout,
                                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
                    ok = p.returncode == 0
                    err = "\n".join(p.stderr.strip().splitlines()[-5:])
                except subprocess.TimeoutExpired:
                    ok, err = False, f"timeout > {a.timeout:.0f} s"
                how = "done" if ok else "FAILED " + err
                print(f"{n}/{layout}: {how} in {time.perf_counter() - t0:.0f} s", flush=True)
                if not ok:
                    continue
            with open(path) as f:
                entries.append(json.load(f))
    md = report_table(entries)
    cmds = sorted({e["command"] for e in entries})
    with open(os.path.join(a.out, "overlap_report.md"), "w") as f:
        f.write("Overlap report of the train step, scanned vs unrolled layers (benchmarks/scan_compile.py --report). "
                "Commands:\n\n" + "".join(f"    {c}\n" for c in cmds) + "\n" + md)
    print(md)
    return 0


def table(results: dict, layers: list[int]) -> str:
    rows = ["| layers | loop compile s | scan compile s | compile loop/scan | loop instructions | scan instructions "
            "| instructions loop/scan | lower s (loop / scan) |", "|---|---|---|---|---|---|---|---|"]
    for n in layers:
        lo, sc = results.get(f"{n}/loop"), results.get(f"{n}/scan")

        def f(r, k):
            if r is None:
                return "-"
            return str(r[k]) if "error" not in r else r["error"]

        ratio = lambda k: (f"{lo[k] / sc[k]:.2f}x" if lo and sc and "error" not in lo and "error" not in sc  # noqa: E731
                           and sc[k] else "-")
        rows.append(f"| {n} | {f(lo, 'compile_s')} | {f(sc, 'compile_s')} | {ratio('compile_s')} | "
                    f"{f(lo, 'instructions')} | {f(sc, 'instructions')} | {ratio('instructions')} | "
                    f"{f(lo, 'lower_s')} / {f(sc, 'lower_s')} |")
    return "\n".join(rows) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/deepseek_v2_lite.yaml")
    ap.add_argument("--layers", default="4,27,61")
    ap.add_argument("--modes", default="loop,scan")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per compile before it is killed")
    ap.add_argument("--out", default="benchmarks/results/scan")
    ap.add_argument("--force", action="store_true", help="recompile entries already in compile.json")
    ap.add_argument("--overlap", action="store_true",
                    help="instead: the while-body schedule facts of the scanned 4-layer program, farskip vs standard "
                         "(OUT/overlap_while_body.json)")
    ap.add_argument("--report", action="store_true",
                    help="instead: the overlap report (analysis/overlap.py) of the train step for --modes scan,loop "
                         "at --layers, side by side (OUT/overlap_report_L<n>_<mode>.json, OUT/overlap_report.md); "
                         "batch 8 x seq 4096, H200 target, two-stream MI300X model, grouped-GEMM proxy")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--report-child", nargs=2, help=argparse.SUPPRESS)
    a, overrides = ap.parse_known_args(argv)
    if a.report_child:
        layers, mode = a.report_child[0].split("/")
        report_child(a.config, int(layers), mode, overrides, a.report_child[1])
        return 0
    if a.report:
        return report_main(a, overrides)
    if a.overlap:
        os.makedirs(a.out, exist_ok=True)
        facts = overlap_facts(a.config, a.batch, a.seq, overrides)
        with open(os.path.join(a.out, "overlap_while_body.json"), "w") as f:
            json.dump(facts, f, indent=2)
        for preset, bodies in facts.items():
            for b in bodies:
                print(f"{preset} body {b['body']} ({b['instructions']} instructions; compute {b['compute_totals']})")
                for p in b["all_to_alls"]:
                    print(f"   {p['collective']:<14} start@{p['start']:<5} done@{p['done']:<5} between: {p['compute_between']}")
        return 0
    if a.child:
        layers, mode = a.child.split("/")
        print(json.dumps(measure(a.config, int(layers), mode, a.batch, a.seq, overrides)))
        return 0
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "compile.json")
    results = json.load(open(path)) if os.path.isfile(path) else {}
    layers = [int(x) for x in a.layers.split(",")]
    for n in layers:
        for mode in a.modes.split(","):
            key = f"{n}/{mode}"
            if key in results and "error" not in results[key] and not a.force:
                print(f"{key}: cached {results[key]}", flush=True)
                continue
            cmd = [sys.executable, __file__, "--child", key, "--config", a.config, "--batch", str(a.batch),
                   "--seq", str(a.seq), *overrides]
            t0 = time.perf_counter()
            env = dict(os.environ, JAX_PLATFORMS="cpu")
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, env=env)
                if p.returncode:
                    res = dict(layers=n, mode=mode, error=f"failed (rc {p.returncode})",
                               stderr=p.stderr.strip().splitlines()[-3:])
                else:
                    res = json.loads(p.stdout.strip().splitlines()[-1])
            except subprocess.TimeoutExpired:
                res = dict(layers=n, mode=mode, error=f"timeout > {a.timeout:.0f} s")
            res["wall_s"] = round(time.perf_counter() - t0, 1)
            results[key] = res
            print(f"{key}: {res}", flush=True)
            with open(path, "w") as f:
                json.dump(results, f, indent=2)
    md = table(results, layers)
    with open(os.path.join(a.out, "compile.md"), "w") as f:
        f.write(f"Train step of `{a.config}` (overrides {overrides or 'none'}), batch {a.batch} x seq {a.seq}, "
                "deviceless for 8 x H100 (EP 8), latency-hiding scheduler on.\n\n" + md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

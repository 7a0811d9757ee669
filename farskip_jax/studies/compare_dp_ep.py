"""TBO, FarSkip and FarSkip + TBO in SGLang's large-scale EP layout (inference.layout=dp_ep: data-parallel
attention, the MoE by expert-parallel all-to-alls), DeepSeek-V3 shapes on H100 nodes (modelled).

    JAX_PLATFORMS=cpu python -m farskip_jax.studies.compare_dp_ep                 # compile what is missing, time, table
    JAX_PLATFORMS=cpu python -m farskip_jax.studies.compare_dp_ep --table-only    # re-table from OUT/results.json

Points (SGLang's LMSYS large-scale EP write-up, 2025-05-05): prefill at EP 16 and EP 32 with 2 prompts
of 4096 tokens per GPU (8192 tokens per GPU: the most its no-TBO run fits); decode at EP 72 (288
experts: 256 + 32 redundant, EPLB's pool) with 32 / 64 / 128 / 256 requests per GPU, one token each
against a 2000-token context. Variants: standard, standard + TBO (runtime.micro_batches=2), FarSkip,
FarSkip + TBO. Each is the dsv3_6l config (configs/deepseek_v3_6l.yaml) compiled deviceless at two
depths (2 and 3 layers: layer 0 dense, then one or two MoE layers) and extrapolated linearly to DeepSeek-V3's 61 layers
(analysis/dp_ep_report.py has the programs and the timing). The baseline of every speedup is SGLang's
"without TBO": standard with every all-to-all synchronous.

MLA's cache: the model caches decompressed keys / values (81,920 B per token and layer) where SGLang
caches the latent (576 bf16 values = 1,152 B). The decode programs therefore compile a cache of
--context x 1152 / 81920 slots (28 for 2000 tokens): the bytes a latent cache of --context tokens
moves; the absorbed attention's FLOPs over the latent are not in the program (docs/serving_dp_ep.md
sizes what that leaves out).

Compiled schedules are cached in --cache (not in git); OUT/results.json keeps every point's timings
at both depths under the central constants and each fitted constant at the low / high end of its
spread (analysis/calibration.py reads the SGLang hold-out rows from it); OUT/table.md is the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # deviceless compiles: no accelerator wanted, set before JAX loads
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from farskip_jax.analysis.calibration import variants_of_constants  # noqa: E402
from farskip_jax.analysis.dp_ep_report import compile_dp_ep, dp_ep_config, point_rows, time_dp_ep  # noqa: E402
from farskip_jax.config import load_config  # noqa: E402
from farskip_jax.studies import harness  # noqa: E402

OUT = harness.results_dir("compare_dp_ep")
VARIANTS = ("standard", "standard_tbo", "farskip", "farskip_tbo")
LABELS = {"no_overlap": "standard, no overlap (SGLang without TBO)", "standard": "standard (XLA schedule)",
          "standard_tbo": "standard + TBO", "farskip": "FarSkip", "farskip_tbo": "FarSkip + TBO"}
LATENT_BYTES, DECOMPRESSED_BYTES = 1152, 81920  # MLA cache bytes per token and layer: SGLang's / ours


def point_key(program: str, ep: int, rows: int, tokens: int, variant: str, layers: int) -> str:
    return f"{program}_ep{ep}_r{rows}_t{tokens}_{variant}_l{layers}"


def compile_point(base, cache: harness.CompileCache, program, ep, rows, tokens, context, variant, layers):
    """The compiled dp_ep program of one point, variant and depth (kept in `cache`)."""

    def compile_fn():
        cfg = dp_ep_config(base, "farskip" if variant.startswith("farskip") else "standard", ep, layers,
                           2 if variant.endswith("_tbo") else 1, num_experts=288 if ep == 72 else None)
        c = compile_dp_ep(cfg, program, rows, tokens, context)
        harness.log(f"[dp_ep] {point_key(program, ep, rows, tokens, variant, layers)}: compiled in {c.compile_s:.0f}s")
        return c

    return cache.get_or_compile(point_key(program, ep, rows, tokens, variant, layers), compile_fn)


def timings(c) -> dict:
    """{constant set: DpEpTiming fields} of a compiled point: central, each SPREAD constant low / high,
    and the diagnostic without contention."""
    out = {}
    for lab, end, hw_w, lk_w in variants_of_constants():
        out[f"{lab}:{end}" if end else lab] = dataclasses.asdict(time_dp_ep(c, which=(hw_w, lk_w)))
    out["diag:no_contention"] = dataclasses.asdict(time_dp_ep(c, contention=1.0))  # what contention costs
    return out


def points(a) -> list[tuple]:
    """[(name, program, ep, rows per GPU, tokens, context compiled)], the hold-out rows' points first
    (analysis/calibration_data/holdout.json: prefill at EP 32, decode at 256 and 32 tokens per GPU)."""
    ctx = max(1, round(a.context * LATENT_BYTES / DECOMPRESSED_BYTES))
    pre = {ep: (f"prefill_ep{ep}", "prefill", ep, 2, 4096, 4096) for ep in a.prefill_ep}
    dec = {b: (f"decode_ep{a.decode_ep}_b{b}", "decode", a.decode_ep, b, 1, ctx) for b in a.decode_rows}
    first = [p for p in (pre.pop(32, None), dec.pop(256, None), dec.pop(32, None)) if p]
    return first + sorted(dec.values(), key=lambda p: p[3]) + list(pre.values())


def run(a, path: str) -> dict:
    """Compile what is missing, time every point; results.json is rewritten after each point."""
    base = load_config(harness.model_config_path("dsv3_6l"))
    cache = harness.CompileCache(a.cache)
    res = {"date": time.strftime("%Y-%m-%d"), "depths": a.depths, "layers": a.layers, "context": a.context,
           "points": {}}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for name, program, ep, rows, tokens, ctx in points(a):
        pt = {"program": program, "ep": ep, "rows_per_gpu": rows, "tokens": tokens, "context_compiled": ctx,
              "variants": {}}
        for v in VARIANTS:
            pt["variants"][v] = {str(d): timings(compile_point(base, cache, program, ep, rows, tokens, ctx, v, d))
                                 for d in a.depths}
        res["points"][name] = pt
        with open(path, "w") as f:
            json.dump(res, f, indent=1, sort_keys=True)
    return res


def table_md(res: dict) -> str:
    """The markdown table of a results.json: every point's speedups over standard without overlap."""
    d, n = res["depths"], res["layers"]
    lines = [f"Modelled {res['date']} (`JAX_PLATFORMS=cpu python -m farskip_jax.studies.compare_dp_ep`): DeepSeek-V3 "
             f"shapes in the dp_ep layout on H100 nodes (8 per node, 8 x 400 Gb/s NICs), compiled at {d[0]} and "
             f"{d[1]} layers and extrapolated to {n}; throughput over standard without overlap (SGLang without "
             "TBO), central fitted constants (range over their spread; the constant that moves it most).", "",
             "| point | no-overlap step | all-to-all share | " + " | ".join(LABELS[r] for r in LABELS if r != "no_overlap")
             + " |", "|---" * (3 + len(VARIANTS)) + "|"]
    for name, pt in res["points"].items():
        rows = point_rows(pt, d, n)
        what = (f"prefill EP {pt['ep']}, {pt['rows_per_gpu']} x {pt['tokens']} tokens/GPU" if pt["program"] == "prefill"
                else f"decode EP {pt['ep']}, {pt['rows_per_gpu']} tokens/GPU, context {res['context']}")
        cells = [f"{rows[v]['central']:.3f}x ({rows[v]['low']:.3f}-{rows[v]['high']:.3f}; {rows[v]['dominant']})"
                 + (f"; {rows[v]['no_contention']:.3f}x without contention" if "no_contention" in rows[v] else "")
                 for v in VARIANTS]
        s = rows["_standard"]
        lines.append(f"| {what} | {s['time_ms']:.2f} ms | {100 * s['a2a_share']:.1f}% | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m farskip_jax.studies.compare_dp_ep", description=__doc__.split("\n")[0])
    ap.add_argument("--prefill-ep", type=lambda s: [int(x) for x in s.split(",")], default=[16, 32])
    ap.add_argument("--decode-ep", type=int, default=72)
    ap.add_argument("--decode-rows", type=lambda s: [int(x) for x in s.split(",")], default=[32, 64, 128, 256])
    ap.add_argument("--context", type=int, default=2000, help="decode context (tokens of a latent MLA cache)")
    ap.add_argument("--depths", type=lambda s: [int(x) for x in s.split(",")], default=[2, 3])
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--cache", default=os.path.join(harness.REPO, "runs", "compare_dp_ep_schedules"))
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--table-only", action="store_true")
    a = ap.parse_args(argv)
    path = os.path.join(a.out, "results.json")
    if a.table_only:
        if not os.path.exists(path):
            return harness.fail(f"{path} is missing: run without --table-only first")
        with open(path) as f:
            res = json.load(f)
    else:
        res = run(a, path)
    text = table_md(res)
    harness.write_text(os.path.join(a.out, "table.md"), text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Plan `farskip.layers: auto` without training, and the compiled overlap the choice buys.

    python -m farskip_jax.analysis.conversion_plan --config configs/distill_tiny.yaml --budget 0.01
    python -m farskip_jax.analysis.conversion_plan ... --overlap-report runtime.gmm=tiled   # + the compiled report
    out = compiled_overlap(cfg, layers)     # {standard | chosen | all: hidden_frac, bound_frac, ...}

The plan is fcsd/planner.py's (the untrained sweep on the teacher, the choice for a val-loss budget),
made as FCSD makes it at its start; `--overlap-report` compiles the forward program deviceless for 8
GPUs (analysis/overlap.py) for standard, the choice and every layer converted.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Optional, Sequence

from farskip_jax.analysis.overlap import run_overlap
from farskip_jax.config import Config, apply_overrides, config_from_dict, load_config, replace, to_dict
from farskip_jax.data.tokenizer import check_vocab, load_tokenizer
from farskip_jax.errors import ConfigError, FarSkipError
from farskip_jax.eval.metrics import cast_state, val_batches
from farskip_jax.fcsd.planner import (DEFAULT_RETENTION, apply_choice, plan_conversion, request_of, run_retention,
                                      write_plan)
from farskip_jax.fcsd.source import load_source
from farskip_jax.model.layers import dtype_of
from farskip_jax.parallel.build import model_mesh


def compiled_overlap(cfg: Config, layers, *, preset: str = "farskip", batch: Optional[int] = None,
                     seq: Optional[int] = None, num_devices: int = 8, hardware: str = "mi300x",
                     log=None) -> dict:
    """The overlap report (analysis/overlap.run_overlap, deviceless GPU compiles; needs the
    jax-cuda12 plugin) of the forward program for standard, the chosen `layers` and every layer
    converted: {label: dict(hidden_frac, bound_frac, exposed_us, duration_us, step_us)} from the
    two-stream `hardware` model (the report's headline). cfg's mesh must hold an expert axis (e.g.
    mesh.expert=8 mesh.data=1 runtime.dispatch=all_to_all)."""
    chosen = sorted(int(i) for i in layers)

    def cfg_for(label: str, c: Config) -> Config:
        if label == "standard":
            return replace(c, **{"farskip.preset": "standard", "farskip.layers": "all"})
        return replace(c, **{"farskip.preset": preset, "farskip.layers": "all" if label == "all" else chosen})

    out = {}
    for r in run_overlap(cfg, presets=("standard", "chosen", "all"), programs=("forward",), batch=batch, seq=seq,
                         num_devices=num_devices, hardware=hardware, log=log, cfg_for=cfg_for):
        rep = r.modelled if r.modelled is not None else r.report
        t = rep.totals("fwd")
        out[r.preset] = dict(hidden_frac=float(t["hidden_frac"]), bound_frac=float(t["bound_frac"]), exposed_us=float(t["exposed"]),
                             duration_us=float(t["duration"]), step_us=float(rep.step_time),
                             model=f"two-stream {hardware}" if r.modelled is not None else "XLA")
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m farskip_jax.analysis.conversion_plan",
        description="Plan farskip.layers: auto without training: the untrained sweep on the teacher (the "
                    "weights of init_from_hf / distill.init_from_run, read as train.py's distillation reads them), "
                    "the choice for a val-loss budget and the overlap it buys. The same plan FCSD makes at its start.")
    p.add_argument("--config", help="a distillation config (train.mode: distill), e.g. configs/distill_hf.yaml")
    p.add_argument("--budget", type=float, help="distill.auto_budget: allowed relative val-loss gap after FCSD")
    p.add_argument("--retention", type=float, help="distill.auto_retention (default %g)" % DEFAULT_RETENTION)
    p.add_argument("--retention-from", metavar="RUN", help="use the retention measured by this finished FCSD run")
    p.add_argument("--search", choices=("ends", "greedy"), help="distill.auto_search")
    p.add_argument("--out", help="folder for farskip_auto.json / farskip_auto.md")
    p.add_argument("--overlap-report", metavar="OVERRIDES", nargs="?", const="",
                   help="also compile the forward program deviceless for 8 GPUs (analysis/overlap.py, jax-cuda12 "
                        "plugin) for standard, the choice and every layer; OVERRIDES: comma list of config overrides "
                        "for that compile (mesh.expert=8,mesh.data=1,runtime.dispatch=all_to_all are always set)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. init_from_hf=/models/x data.tokenizer=/models/x")
    a = p.parse_args(argv)
    ov = list(a.overrides) + ["farskip.layers=auto"]
    if a.budget is not None:
        ov.append(f"distill.auto_budget={a.budget}")
    if a.retention_from:
        if a.retention is not None:
            raise ConfigError("pass --retention or --retention-from, not both")
        r = run_retention(a.retention_from)
        print(f"retention measured by {a.retention_from}: untrained {100 * r['untrained']:+.2f}% -> "
              f"{100 * r['after']:+.2f}% at step {r['step']} = {r['retention']:.3f}", flush=True)
        a.retention = max(r["retention"], 1e-6)
    if a.retention is not None:
        ov.append(f"distill.auto_retention={a.retention}")
    if a.search:
        ov.append(f"distill.auto_search={a.search}")
    cfg = load_config(a.config, ["train.mode=distill"] + ov)
    mesh = model_mesh(cfg)
    cfg, graphdef, src = load_source(cfg, mesh)
    tok = load_tokenizer(cfg.data.tokenizer)
    check_vocab(tok, cfg.model.vocab_size, f"the model to convert ({cfg.init_from_hf or cfg.distill.init_from_run})")
    batches = val_batches(cfg, cfg.train.eval_batches, mesh=mesh, tokenizer=tok)
    teacher = cast_state(src, dtype_of(cfg.distill.teacher_dtype))
    plan = plan_conversion(graphdef, src, cfg, batches, teacher=teacher)
    print("\n".join([""] + plan.lines()), flush=True)
    print(f"\nequivalent explicit setting: farskip.layers={list(plan.layers)}", flush=True)
    compiled = None
    if a.overlap_report is not None:
        ocfg = replace(apply_choice(cfg, plan.layers), **{"mesh.expert": 8, "mesh.data": 1, "runtime.dispatch": "all_to_all"})
        ocfg = config_from_dict(apply_overrides(to_dict(ocfg), [x for x in a.overlap_report.split(",") if x]))
        compiled = compiled_overlap(ocfg, plan.layers, preset=plan.preset, log=lambda m: print(m, flush=True))
        print("\ncompiled overlap report, forward program (analysis/overlap.py, deviceless, 8 GPUs, "
              f"{next(iter(compiled.values()))['model']} model):", flush=True)
        for label, r in compiled.items():
            print(f"  {label:<8s} hidden {100 * r['hidden_frac']:.1f}% of {r['duration_us']:.1f} us all-to-all "
                  f"(bound {100 * r['bound_frac']:.1f}%), step {r['step_us']:.1f} us", flush=True)
    if a.out:
        for path in write_plan(plan, a.out, request_of(cfg)):
            print(f"wrote {path}")
        if compiled is not None:
            with open(os.path.join(a.out, "overlap_report.json"), "w") as f:
                json.dump(dict(layers=list(plan.layers), forward=compiled), f, indent=1)
            print(f"wrote {os.path.join(a.out, 'overlap_report.json')}")
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except FarSkipError as e:
        raise SystemExit(f"error: {e}")

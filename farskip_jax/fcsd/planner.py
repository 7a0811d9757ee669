"""Budgeted conversion (`farskip.layers: auto`): choose which layers FCSD converts so that the
predicted val-loss gap after FCSD stays within `distill.auto_budget`, and say what overlap it buys.

The prediction (docs/fcsd.md "Budgeted conversion", with its evidence and limits):

    untrained gap g(S) = val_loss(S converted, no training) / teacher_loss - 1    (measured here, on the teacher)
    predicted gap after FCSD = retention x max(g(S), 0)                             (retention: distill.auto_retention)

`retention` defaults to DEFAULT_RETENTION, the largest ratio (gap after FCSD / untrained gap) measured
at a 5% FCSD token budget on the project's teachers, all-layer and partial conversions
(`benchmarks/fcsd_evidence.py` reads them from benchmarks/results/fcsd); larger FCSD budgets measured lower
ratios, so the default is conservative there. Candidate sets (`distill.auto_search`): `ends` = first N and last N for N = 1..L; `greedy`
adds, one layer at a time, the layer whose addition costs least (untrained), stopping when even the
cheapest addition is over the budget. The rule: among candidates whose prediction is within the
budget, take the one that frees the most all-to-alls (`overlap_estimate`), then the lowest untrained
gap, then the fewest layers. No candidate that frees an all-to-all fits: ConfigError (before
anything is written).

    plan = plan_conversion(graphdef, src, cfg, batches, teacher=teacher)     # sweep + choice
    cfg = apply_choice(cfg, plan.layers)                                     # an explicit layer list
    python -m farskip_jax.fcsd.planner --config configs/distill_tiny.yaml --budget 0.01   # plan only
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Optional, Sequence

from farskip_jax.config import (Config, FarSkipConfig, ModelConfig, apply_overrides, config_from_dict, replace,
                                to_dict)
from farskip_jax.errors import ConfigError

# gap after FCSD / untrained gap: the largest measured at a 5% FCSD budget (benchmarks/fcsd_evidence.py; checked by
# tests/test_layers_auto.py): the set auto chose on the DeepSeek-V2-style hard teacher at lr 1e-4,
# +2.70% -> +2.11% (report slice). Over all-layer conversions alone the largest is 0.41 (16-layer d64, lr 3e-3)
DEFAULT_RETENTION = 0.78
PLAN_JSON, PLAN_MD = "farskip_auto.json", "farskip_auto.md"
# forward all-to-all time hidden, full-depth DeepSeek-V2-Lite, EP 8, 8 x H200 target, two-stream MI300X
# model (docs/overlap.md): standard 43.2%, farskip (every layer) 96.8%
OVERLAP_DOC_FWD = {"standard": 0.432, "farskip": 0.968}


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One candidate set measured without training: name (first:N | last:N | greedy:N), layers."""
    name: str
    layers: tuple[int, ...]
    val_loss: float
    teacher_loss: float
    kl: float
    top1: float
    freed: int = 0  # forward all-to-alls this set frees (overlap_estimate)

    @property
    def gap(self) -> float:
        return self.val_loss / self.teacher_loss - 1.0


@dataclasses.dataclass
class Plan:
    budget: float
    retention: float
    search: str
    preset: str
    candidates: list  # [Candidate], in sweep order
    choice: Candidate
    overlap: dict  # overlap_estimate of the choice
    overlap_all: dict  # ... of converting every layer (for comparison)
    batches: Optional[int] = None  # validation batches the sweep measured (the run's train.eval_batches)

    @property
    def layers(self) -> tuple[int, ...]:
        return self.choice.layers

    def predicted(self, c: Candidate) -> float:
        return self.retention * max(c.gap, 0.0)

    def to_json(self) -> dict:
        return dict(budget=self.budget, retention=self.retention, search=self.search, preset=self.preset,
                    layers=list(self.layers), choice=self.choice.name, batches=self.batches,
                    predicted_gap=self.predicted(self.choice), overlap=self.overlap, overlap_all=self.overlap_all,
                    rule="largest freed all-to-all count among candidates with retention x untrained gap <= budget; "
                         "ties: lower untrained gap, fewer layers",
                    candidates=[dict(dataclasses.asdict(c), layers=list(c.layers), gap=c.gap,
                                     predicted=self.predicted(c), fits=self.predicted(c) <= self.budget)
                                for c in self.candidates])

    @classmethod
    def from_json(cls, d: dict) -> "Plan":
        cands = [Candidate(c["name"], tuple(c["layers"]), c["val_loss"], c["teacher_loss"], c["kl"], c["top1"],
                           c["freed"]) for c in d["candidates"]]
        choice = next(c for c in cands if c.name == d["choice"])
        return cls(d["budget"], d["retention"], d["search"], d["preset"], cands, choice, d["overlap"], d["overlap_all"],
                   d.get("batches"))

    def lines(self) -> list[str]:
        """The sweep table, the choice and its overlap (markdown; also the progress log)."""
        out = [f"farskip.layers: auto, budget {100 * self.budget:g}% val-loss gap after FCSD, predicted as "
               f"retention {self.retention:g} x the untrained gap (preset {self.preset}, candidates: {self.search}; "
               f"gaps on the first {self.batches or '?'} validation batches, the ones the run evaluates)", "",
               "| candidate | layers | untrained gap | KL | top-1 | predicted after FCSD | fits | freed all-to-alls |",
               "|---|---|---|---|---|---|---|---|"]
        for c in self.candidates:
            out.append(f"| {c.name} | {list(c.layers)} | {100 * c.gap:+.2f}% | {c.kl:.4f} | {100 * c.top1:.1f}% | "
                       f"{100 * self.predicted(c):+.2f}% | {'yes' if self.predicted(c) <= self.budget else 'no'} | "
                       f"{c.freed} |")
        o, oa = self.overlap, self.overlap_all
        out += ["", f"choice: **{self.choice.name}** = layers {list(self.layers)} (untrained {100 * self.choice.gap:+.2f}%, "
                    f"predicted {100 * self.predicted(self.choice):+.2f}% after FCSD)",
                f"overlap it buys (estimate, counted from the layer set): {o['freed']} of {o['total']} forward "
                f"all-to-alls ({100 * o['share']:.0f}%) no longer gate the next compute ({o['converted_moe']} of "
                f"{o['moe_layers']} MoE layers converted; every layer converted: {oa['freed']} of {oa['total']}, "
                f"{100 * oa['share']:.0f}%)",
                f"estimated forward all-to-all time hidden: {100 * o['hidden_fwd_est']:.0f}% (standard "
                f"{100 * OVERLAP_DOC_FWD['standard']:.1f}%, every layer {self.preset} "
                f"{100 * OVERLAP_DOC_FWD['farskip']:.1f}%: docs/overlap.md's full-depth DeepSeek-V2-Lite figures, "
                f"interpolated by freed all-to-alls {o['freed']} / {o['freed_all']}; an estimate, not a compiled report)"]
        return out


# --------------------------------------------------------------------------------------------------
# what a layer set buys
# --------------------------------------------------------------------------------------------------


def overlap_estimate(model: ModelConfig, fs: FarSkipConfig) -> dict:
    """Forward all-to-alls whose wait the connectivity `fs` (an explicit set) removes, by DESIGN.md
    section 1: the dispatch of MoE layer j no longer waits for attention j when its MoE input is
    `outdated`; the combine of MoE layer j no longer gates attention j+1 when that reads `partial` or
    `outdated`. The last layer's combine always gates the final norm. An ESTIMATE from the layer set,
    not a compiled schedule (analysis/overlap.py measures that).

    hidden_fwd_est: the forward all-to-all time hidden, interpolated between docs/overlap.md's
    standard and every-layer-farskip figures (OVERLAP_DOC_FWD) by freed / freed with every layer
    converted (the same preset)."""
    n = model.num_layers
    moe = [i for i in range(n) if model.is_moe_layer(i)]

    def count(f: FarSkipConfig) -> tuple[int, list]:
        kinds = [f.layer_inputs(i, n) for i in range(n)]
        return (sum(kinds[j][1] == "outdated" for j in moe)
                + sum(j + 1 < n and kinds[j + 1][0] != "full" for j in moe)), kinds

    freed, kinds = count(fs)
    freed_all, _ = count(dataclasses.replace(fs, layers="all"))
    total = 2 * len(moe)
    std, far = OVERLAP_DOC_FWD["standard"], OVERLAP_DOC_FWD["farskip"]
    return dict(freed=int(freed), total=total, share=freed / total if total else 0.0, freed_all=int(freed_all),
                moe_layers=len(moe), converted_moe=sum(kinds[j] != ("full", "full") for j in moe),
                hidden_fwd_est=std + (freed / freed_all if freed_all else 0.0) * (far - std))


def _fs_with(fs0: FarSkipConfig, preset: str, layers) -> FarSkipConfig:
    return FarSkipConfig(preset=preset, attn_input=fs0.attn_input, moe_input=fs0.moe_input,
                         layers=tuple(sorted(layers)), skip_distance=fs0.skip_distance)


# --------------------------------------------------------------------------------------------------
# the rule
# --------------------------------------------------------------------------------------------------


def choose(candidates: Sequence[Candidate], budget: float, retention: float) -> Candidate:
    """The candidate with the most freed all-to-alls among those with retention x max(gap, 0) <= budget;
    ties: lower untrained gap, then fewer layers, then sweep order. ConfigError when none that frees
    anything fits (naming the cheapest and the budget it would need)."""
    useful = [c for c in candidates if c.freed > 0]
    if not useful:
        raise ConfigError("farskip.layers: auto found no candidate set that frees an all-to-all (a model without "
                          "MoE layers?); set farskip.layers explicitly")
    fits = [c for c in useful if retention * max(c.gap, 0.0) <= budget]
    if not fits:
        cheap = min(useful, key=lambda c: c.gap)
        need = retention * max(cheap.gap, 0.0)
        raise ConfigError(
            f"distill.auto_budget={budget:g}: no candidate set fits; the cheapest, {cheap.name} (layers "
            f"{list(cheap.layers)}), is predicted at {100 * need:+.2f}% after FCSD (untrained {100 * cheap.gap:+.2f}% x "
            f"distill.auto_retention {retention:g}). Raise distill.auto_budget to at least {need:.4g}, set "
            "distill.auto_retention lower if FCSD runs on this model measured less (python -m farskip_jax.fcsd.planner "
            "--retention-from RUN), or set farskip.layers explicitly")
    order = {id(c): k for k, c in enumerate(candidates)}
    return min(fits, key=lambda c: (-c.freed, c.gap, len(c.layers), order[id(c)]))


def plan_conversion(graphdef, st: dict, cfg: Config, batches: list, *, teacher: Optional[dict] = None,
                    stream=sys.stdout) -> Plan:
    """Measure the candidate sets of cfg.farskip (layers: auto) without training and choose one.

    st: the weights to convert; teacher: the standard-connectivity teacher state (default st; distill
    passes its teacher_dtype copy so the sweep's teacher loss is step 0's)."""
    from farskip_jax.eval.sweep import evaluate_set, sweep_preset

    fs0 = cfg.farskip
    if fs0.layers != "auto":
        raise ConfigError(f"plan_conversion plans farskip.layers: auto, got layers={fs0.layers!r}")
    L = cfg.model.num_layers
    preset = sweep_preset(fs0)
    d = cfg.distill
    budget = d.auto_budget
    retention = d.auto_retention if d.auto_retention is not None else DEFAULT_RETENTION
    cands: list[Candidate] = []
    seen: dict[tuple, Candidate] = {}

    def overlap_of(layers) -> dict:
        return overlap_estimate(cfg.model, _fs_with(fs0, preset, layers))

    def measure(name: str, layers) -> Candidate:
        key = tuple(sorted(layers))
        if key in seen:  # e.g. first:L = last:L: measured once, listed under its first name
            return seen[key]
        r = evaluate_set(graphdef, st, cfg, batches, key, preset=preset, teacher=teacher)
        c = Candidate(name, key, r["val_loss"], r["teacher_loss"], r["kl"], r["top1"], overlap_of(key)["freed"])
        seen[key] = c
        cands.append(c)
        if stream is not None:
            print(f"[auto] {name:<10s} layers {list(key)}: untrained gap {100 * c.gap:+.2f}% | KL {c.kl:.5f} | "
                  f"top-1 {100 * c.top1:.2f}% | predicted after FCSD {100 * retention * max(c.gap, 0):+.2f}%",
                  file=stream, flush=True)
        return c

    for n in range(1, L + 1):
        measure(f"last:{n}", range(L - n, L))
    for n in range(1, L + 1):
        measure(f"first:{n}", range(n))
    if d.auto_search == "greedy":
        chosen: list[int] = []
        while len(chosen) < L:
            trials = [measure(f"+{i}", chosen + [i]) for i in range(L) if i not in chosen]
            best = min(trials, key=lambda c: (c.gap, c.layers))
            chosen = list(best.layers)
            if best.name.startswith("+"):  # name the chain's members greedy:N (a set met before keeps its name)
                named = dataclasses.replace(best, name=f"greedy:{len(chosen)}")
                cands[cands.index(best)] = seen[best.layers] = named
            if retention * max(best.gap, 0.0) > budget:
                break  # even the cheapest addition is over the budget: larger greedy sets are not tried
        cands[:] = [c for c in cands if not c.name.startswith("+")]  # trial sets off the chain are not candidates

    choice = choose(cands, budget, retention)
    return Plan(budget, retention, d.auto_search, preset, cands, choice, overlap_of(choice.layers),
                overlap_of(range(L)), len(batches))


def apply_choice(cfg: Config, layers) -> Config:
    """cfg with farskip.layers = the explicit sorted list `layers` and the auto_* keys cleared (the
    resolved config: what the model runs, what config.yaml keeps)."""
    return replace(cfg, **{"farskip.layers": sorted(int(i) for i in layers), "distill.auto_budget": None,
                           "distill.auto_retention": None, "distill.auto_search": "ends"})


def request_of(cfg: Config) -> dict:
    """The keys a stored choice was made for (a resumed run reuses its choice when they are unchanged)."""
    fs, d = cfg.farskip, cfg.distill
    return dict(auto_budget=d.auto_budget, auto_retention=d.auto_retention, auto_search=d.auto_search,
                preset=fs.preset, attn_input=fs.attn_input, moe_input=fs.moe_input, skip_distance=fs.skip_distance)


def write_plan(plan: Plan, folder: str, request: Optional[dict] = None) -> list[str]:
    """<folder>/farskip_auto.json (the plan, and the request it answers) and farskip_auto.md."""
    os.makedirs(folder, exist_ok=True)
    paths = []
    for name, text in ((PLAN_JSON, json.dumps(dict(plan.to_json(), request=request), indent=1)),
                       (PLAN_MD, "\n".join(["# farskip.layers: auto", ""] + plan.lines()) + "\n")):
        path = os.path.join(folder, name)
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)
        paths.append(path)
    return paths


def read_plan(folder: str) -> Optional[dict]:
    """The farskip_auto.json of a run folder, or None."""
    path = os.path.join(folder, PLAN_JSON)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is unreadable ({e}); delete it (the choice is planned again) or set "
                          "train.overwrite=true") from None


def compiled_overlap(cfg: Config, layers, *, preset: str = "farskip", batch: Optional[int] = None,
                     seq: Optional[int] = None, num_devices: int = 8, hardware: str = "mi300x",
                     log=None) -> dict:
    """The overlap report (analysis/overlap.run_overlap, deviceless GPU compiles; needs the
    jax-cuda12 plugin) of the forward program for standard, the chosen `layers` and every layer
    converted: {label: dict(hidden_frac, bound_frac, exposed_us, duration_us, step_us)} from the
    two-stream `hardware` model (the report's headline). cfg's mesh must hold an expert axis (e.g.
    mesh.expert=8 mesh.data=1 runtime.dispatch=all_to_all)."""
    from farskip_jax.analysis.overlap import run_overlap

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


# --------------------------------------------------------------------------------------------------
# the evidence for DEFAULT_RETENTION, and a run's own retention
# --------------------------------------------------------------------------------------------------


def run_retention(run_dir: str) -> dict:
    """Retention measured by a finished FCSD run: its step-0 (converted, untrained) gap and its best
    evaluation's gap on the early-stopping batches (metrics.jsonl, early_stopping.json)."""
    from farskip_jax.train.logger import read_metrics

    evals = read_metrics(run_dir, "eval")
    if not evals or evals[0]["step"] != 0:
        raise ConfigError(f"{run_dir} has no step-0 evaluation in metrics.jsonl; pass the run folder of an FCSD run "
                          "(train.mode: distill)")
    es_path = os.path.join(run_dir, "early_stopping.json")
    best_step = None
    if os.path.isfile(es_path):
        with open(es_path) as f:
            best_step = json.load(f).get("best_step")
    best = next((e for e in evals if e["step"] == best_step), None) or min(evals, key=lambda e: e["val_loss"])
    g0 = evals[0]["val_loss"] / evals[0]["teacher_loss"] - 1
    g1 = best["val_loss"] / best["teacher_loss"] - 1
    if g0 <= 0:
        raise ConfigError(f"{run_dir}: the converted model at step 0 is not worse than the teacher ({100 * g0:+.2f}%); "
                          "no retention to measure")
    return dict(run=run_dir, untrained=g0, after=g1, step=best["step"], retention=max(g1, 0.0) / g0)


# --------------------------------------------------------------------------------------------------
# CLI: plan without training
# --------------------------------------------------------------------------------------------------


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m farskip_jax.fcsd.planner",
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
    from farskip_jax.config import load_config
    from farskip_jax.data.tokenizer import check_vocab, load_tokenizer
    from farskip_jax.eval.metrics import cast_state, val_batches
    from farskip_jax.model.layers import dtype_of
    from farskip_jax.parallel.build import model_mesh
    from farskip_jax.fcsd.source import load_source

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
    from farskip_jax.errors import FarSkipError

    try:
        raise SystemExit(main())
    except FarSkipError as e:
        raise SystemExit(f"error: {e}")

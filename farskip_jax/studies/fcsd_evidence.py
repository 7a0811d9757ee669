"""The measured (untrained gap, gap after FCSD) pairs behind fcsd/planner.py's DEFAULT_RETENTION.

    python -m farskip_jax.studies.fcsd_evidence [ROOT]      # ROOT: benchmarks/results/fcsd by default

Prints one row per plain-FCSD run recorded under ROOT (fcsd_experiment.py's results*.json, the
conversion-method runs' results.json, hard/auto/run_auto.py's auto_runs*.json) and the retention
(after / untrained) per budget: min / median / max.
"""

from __future__ import annotations

import glob
import json
import os
import sys

from farskip_jax.studies.harness import results_dir


def _nominal(frac: float) -> float:
    """A run's FCSD token share rounded up to the budgets the experiments used."""
    for b in (0.05, 0.1, 0.2, 0.4):
        if frac <= b + 1e-6:
            return b
    return round(frac, 2)


def measured_pairs(root: str = results_dir("fcsd")) -> list[dict]:
    """(untrained gap, gap after FCSD, FCSD token share) of every plain-FCSD run recorded under `root`
    (studies/fcsd_experiment.py's results*.json, studies/fcsd_methods.py's results.json: all
    layers converted; hard/auto/run_auto.py's auto_runs*.json: the sets farskip.layers=auto chose).
    Left out: conversion methods (anneal, progressive) and top-k logits, which are not the default
    recipe. Each pair: dict(source, budget, untrained, after, retention, layers: "all" | "partial")."""
    out = []
    for path in sorted(glob.glob(os.path.join(root, "**", "auto_runs*.json"), recursive=True)):
        with open(path) as f:
            rows = json.load(f)
        seen = set()
        for r in rows:  # a budget whose choice repeats an earlier budget's reuses its run: one pair
            key = (r["teacher"], tuple(r["layers"]), r.get("tag", ""))
            if key in seen:
                continue
            seen.add(key)
            out.append(dict(source=f"{os.path.relpath(path, root)}:{r['teacher']}:{r['choice']}", budget=r["token_share"],
                            untrained=r["untrained_gap"], after=r["gap"], layers="partial"))
    for path in sorted(glob.glob(os.path.join(root, "**", "results*.json"), recursive=True)):
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, ValueError):
            continue
        rel = os.path.relpath(path, root)
        if isinstance(d, dict) and "table" in d and "teacher_tokens" in d:  # fcsd_experiment.py
            if "top-k all" not in d.get("recipe", "top-k all"):
                continue
            t, conv, after = (row[1] for row in d["table"][:3])
            out.append(dict(source=rel, budget=_nominal(d["fcsd_tokens"] / d["teacher_tokens"]),
                            untrained=conv / t - 1, after=after / t - 1, layers="all"))
        elif isinstance(d, dict) and "rows" in d and "converted" in d:  # fcsd_methods.py
            c = d["converted"]
            for r in d["rows"]:
                if any(k in o for o in r.get("overrides", []) for k in ("anneal", "progressive", "top_k")):
                    continue
                out.append(dict(source=f"{rel}:{r['method']}", budget=r["budget"],
                                untrained=c["val_loss"] / c["teacher_loss"] - 1, after=r["gap"], layers="all"))
    for p in out:
        p["retention"] = p["after"] / p["untrained"] if p["untrained"] > 0 else float("nan")
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    pairs = measured_pairs(*argv[:1])
    print("| source | converted | FCSD budget | untrained gap | after FCSD | retention |\n|---|---|---|---|---|---|")
    for q in pairs:
        print(f"| {q['source']} | {q['layers']} | {100 * q['budget']:g}% | {100 * q['untrained']:+.2f}% | "
              f"{100 * q['after']:+.2f}% | {q['retention']:.3f} |")
    for b in sorted({q["budget"] for q in pairs}):
        for kind in ("all", "partial", None):
            rs = [q["retention"] for q in pairs if q["budget"] == b and kind in (None, q["layers"])]
            if rs:
                print(f"budget {100 * b:g}%, {kind or 'every'} set(s): {len(rs)} runs, retention min {min(rs):.3f} / "
                      f"median {sorted(rs)[len(rs) // 2]:.3f} / max {max(rs):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Bar chart of a recipe sweep at one budget: loss gap and top-1 per
method from a results json of studies/fcsd_methods.py, the baseline seeds' range shaded (the noise).

    python -m farskip_jax.studies.fcsd_recipe_plot \\
        benchmarks/results/fcsd/hard/qwen3_recipe/results_5pct.json benchmarks/results/fcsd/hard/qwen3_recipe/recipe_5pct.png \\
        --title 'Qwen3-MoE-style teacher, 5% FCSD' --budget 0.05
"""

import argparse
import json
import os

from farskip_jax.studies.harness import figure


def main():
    p = argparse.ArgumentParser()
    p.add_argument("results")
    p.add_argument("out")
    p.add_argument("--title", default="")
    p.add_argument("--budget", type=float, default=0.05)
    p.add_argument("--noise", default="baseline,r_seed1,r_seed2", help="the runs that differ only by train.seed")
    a = p.parse_args()
    with open(a.results) as f:
        rows = [r for r in json.load(f)["rows"] if abs(r["budget"] - a.budget) < 1e-9]
    noise = [r for r in rows if r["method"] in a.noise.split(",")]
    names = [r["method"] + (" (" + " ".join(o.split("=")[0].split(".")[-1] + "=" + o.split("=", 1)[1] for o in r["overrides"]) + ")" if r["overrides"] else "")
             for r in rows]
    with figure(a.out, 1, 2, figsize=(11, 0.32 * len(rows) + 1.8), sharey=True) as (fig, ax):
        for i, (key, lab) in enumerate([("gap", "val loss gap to teacher (%)"), ("top1", "top-1 agreement (%)")]):
            v = [100 * r[key] for r in rows]
            if noise:
                lo, hi = min(100 * r[key] for r in noise), max(100 * r[key] for r in noise)
                ax[i].axvspan(lo, hi, color="grey", alpha=0.3, label=f"baseline seeds ({len(noise)}): {lo:.2f}-{hi:.2f}")
            ax[i].barh(range(len(rows)), v, color=["C0" if r in noise else "C1" for r in rows])
            for y, x in enumerate(v):
                ax[i].text(x, y, f" {x:.2f}", va="center", fontsize=7)
            ax[i].set(xlabel=lab)
            ax[i].grid(alpha=0.3, axis="x")
            ax[i].legend(fontsize=7, loc="lower right")
        ax[0].set_xscale("log")
        ax[0].set_yticks(range(len(rows)), names, fontsize=7)
        ax[0].invert_yaxis()
        ax[1].set_xlim(min(100 * r["top1"] for r in rows) - 3, max(100 * r["top1"] for r in rows) + 3)
        fig.suptitle(f"{a.title}\nfrom {os.path.relpath(a.results)} (command in the results .md); "
                     f"plot: {os.path.relpath(__file__)}", fontsize=8)


if __name__ == "__main__":
    main()

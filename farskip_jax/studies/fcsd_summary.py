"""Summarise the FCSD recipe variants of one teacher: a table, and plots of loss gap / top-1 against
the learning rate and against the token budget.

    python -m farskip_jax.studies.fcsd_summary runs/fcsd_16l_long [--out summary]

Reads every results*.json that `fcsd_experiment.py` wrote into the folder (one per --fcsd-dir
variant; they share the teacher and the report slice), and writes <out>.md (one row per variant:
recipe, tokens, val loss gap to the teacher, top-1, top-1 where the teacher is confident, KL) and
<out>.png: gap and top-1 against the learning rate (one line per budget and batch size) and against
the budget (one line per batch size and lr with several budgets), targets drawn. Those curves use the
plain recipe only (forward KL, T = 1, no CE / hidden-state terms, all logits, data-order seed 0); the
other variants (column "recipe differs") are in the table.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

from farskip_jax.studies.harness import figure


PLAIN = {"kl": "forward", "T": "1", "ce_weight": "0", "hidden_weight": "0", "top-k": "all", "data-order seed": "0"}


def recipe_parts(recipe: str) -> dict:
    """The recipe line's settings that PLAIN names (older lines lack some: those read as the default)."""
    parts = dict(PLAIN)
    m = re.match(r"(\w+) KL", recipe)
    if m:
        parts["kl"] = m.group(1)
    for key in ("T", "ce_weight", "hidden_weight", "top-k", "data-order seed"):
        m = re.search(re.escape(key) + r"[= ]([^,( ]+)", recipe)
        if m:
            parts[key] = m.group(1)
    return parts


def load(folder: str) -> list[dict]:
    rows = []
    for path in sorted(glob.glob(os.path.join(folder, "results*.json"))):
        with open(path) as f:
            r = json.load(f)
        teacher, _, after = r["table"]
        m = re.search(r"lr ([0-9.e-]+) .*batch (\d+) x (\d+)", r["recipe"])
        if not m:
            raise SystemExit(f"{path}: recipe {r['recipe']!r} does not name lr and batch")
        rows.append(dict(file=os.path.basename(path), recipe=r["recipe"], lr=float(m.group(1)),
                         batch=int(m.group(2)), tokens=r["fcsd_tokens"], budget=r["fcsd_tokens"] / r["teacher_tokens"],
                         gap=after[1] / teacher[1] - 1, top1=after[2], top1_conf=after[3], kl=after[4],
                         differs=", ".join(f"{k} {v}" for k, v in recipe_parts(r["recipe"]).items() if PLAIN[k] != v)))
    if not rows:
        raise SystemExit(f"no results*.json in {folder}: run studies/fcsd_experiment.py --out {folder} first")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder")
    ap.add_argument("--out", default="summary", help="file stem under the folder")
    a = ap.parse_args(argv)
    rows = sorted(load(a.folder), key=lambda r: (r["budget"], r["batch"], r["lr"], r["differs"]))
    lines = ["| variant | budget | batch | lr | recipe differs | val loss vs teacher | top-1 | top-1 where confident "
             "| KL |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['file']} | {r['budget']:.0%} | {r['batch']} x 128 | {r['lr']:g} | {r['differs'] or '-'} | "
                     f"{r['gap']:+.2%} | {r['top1']:.2%} | {r['top1_conf']:.2%} | {r['kl']:.4f} |")
    md = os.path.join(a.folder, a.out + ".md")
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))

    plain = [r for r in rows if not r["differs"]]
    by_budget = {}
    for r in plain:
        by_budget.setdefault((r["batch"], r["lr"]), []).append(r)
    by_budget = {k: v for k, v in by_budget.items() if len({r["budget"] for r in v}) > 1}
    png = os.path.join(a.folder, a.out + ".png")
    with figure(png, 2 if by_budget else 1, 2, figsize=(10, 8 if by_budget else 4), squeeze=False) as (fig, axes):
        (ax1, ax2) = axes[0]

        def plot(ax_gap, ax_top1, label, pts):  # pts: (x, gap %, top-1 %)
            pts = sorted(pts)
            ax_gap.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
            ax_top1.plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=label)
            for ax in (ax_gap, ax_top1):
                ax.set_xscale("log")

        for budget in sorted({r["budget"] for r in plain}):
            for batch in sorted({r["batch"] for r in plain if r["budget"] == budget}):
                rs = [r for r in plain if r["budget"] == budget and r["batch"] == batch]
                plot(ax1, ax2, f"{budget:.0%} budget, batch {batch}", [(r["lr"], r["gap"] * 100, r["top1"] * 100) for r in rs])
        for ax in (ax1, ax2):
            ax.set_xlabel("FCSD learning rate")
        if by_budget:
            ax3, ax4 = axes[1]
            for (batch, lr), rs in sorted(by_budget.items()):
                plot(ax3, ax4, f"batch {batch}, lr {lr:g}",
                     [(r["budget"] * 100, r["gap"] * 100, r["top1"] * 100) for r in rs])
            for ax in (ax3, ax4):
                ax.set_xlabel("FCSD tokens (% of the teacher's pretraining tokens)")
            ax3.legend(fontsize=8)
        for ax in axes[:, 0]:
            ax.axhline(1.0, color="k", ls="--", lw=0.8, label="target: within 1%")
            ax.set_title("val loss above the teacher (%)")
        for ax in axes[:, 1]:
            ax.axhline(95.0, color="k", ls="--", lw=0.8, label="target: 95%")
            ax.set_title("top-1 agreement with the teacher (%)")
        for ax in axes.flat:
            ax.grid(alpha=0.3)
        ax1.legend(fontsize=8)
    print(f"wrote {md} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

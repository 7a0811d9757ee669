"""Summarise the FCSD recipe variants of one teacher: a table and a plot of loss gap vs learning rate.

    python benchmarks/fcsd_summary.py runs/fcsd_16l_long [--out summary]

Reads every results*.json that `fcsd_experiment.py` wrote into the folder (one per --fcsd-dir
variant; they share the teacher and the report slice), and writes <out>.md (one row per variant:
recipe, tokens, val loss gap to the teacher, top-1, top-1 where the teacher is confident, KL) and
<out>.png (gap and top-1 against the learning rate, one line per batch size, the 1% target drawn).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys


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
                         gap=after[1] / teacher[1] - 1, top1=after[2], top1_conf=after[3], kl=after[4]))
    if not rows:
        raise SystemExit(f"no results*.json in {folder}: run benchmarks/fcsd_experiment.py --out {folder} first")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder")
    ap.add_argument("--out", default="summary", help="file stem under the folder")
    a = ap.parse_args(argv)
    rows = sorted(load(a.folder), key=lambda r: (r["budget"], r["batch"], r["lr"]))
    lines = ["| variant | budget | batch | lr | val loss vs teacher | top-1 | top-1 where confident | KL |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['file']} | {r['budget']:.0%} | {r['batch']} x 128 | {r['lr']:g} | {r['gap']:+.2%} | "
                     f"{r['top1']:.2%} | {r['top1_conf']:.2%} | {r['kl']:.4f} |")
    md = os.path.join(a.folder, a.out + ".md")
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for budget in sorted({r["budget"] for r in rows}):
        for batch in sorted({r["batch"] for r in rows if r["budget"] == budget}):
            pts = sorted((r["lr"], r["gap"] * 100, r["top1"] * 100) for r in rows
                         if r["budget"] == budget and r["batch"] == batch)
            label = f"{budget:.0%} budget, batch {batch}"
            ax1.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
            ax2.plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=label)
    ax1.axhline(1.0, color="k", ls="--", lw=0.8, label="target: within 1%")
    ax2.axhline(95.0, color="k", ls="--", lw=0.8, label="target: 95%")
    for ax, title in ((ax1, "val loss above the teacher (%)"), (ax2, "top-1 agreement with the teacher (%)")):
        ax.set_xscale("log")
        ax.set_xlabel("FCSD learning rate")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    fig.tight_layout()
    png = os.path.join(a.folder, a.out + ".png")
    fig.savefig(png, dpi=110)
    print(f"wrote {md} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

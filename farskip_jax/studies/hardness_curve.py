"""How hard a teacher is to convert, along its own pretraining: for every kept checkpoint of
a standard-connectivity run, the val-loss gap and top-1 agreement of the same weights under FarSkip
connectivity (no training), for the `farskip`, `attn_only` and `mlp_only` presets, all layers.

    python -m farskip_jax.studies.hardness_curve --teacher runs/hard/byte_long/teacher --out runs/hard/byte_long/hardness \\
        --report-starts 8,100

Evaluates on the report slice of studies/fcsd_methods.py (batches of --batch-size rows of the
teacher's seq_len from the validation split, --eval-batches each from every --report-starts), so the
last point equals that script's "converted before training" row. Writes hardness.json, hardness.md and
hardness.png (gap and top-1 against the teacher's pretraining tokens; the teacher's own val loss on a
second axis). Points already in hardness.json for the same report slice are reused.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import time

from farskip_jax.studies.harness import figure

os.environ.setdefault("JAX_PLATFORMS", "cpu")
from farskip_jax.config import FarSkipConfig
from farskip_jax.loading.load import load_run, read_run_config
from farskip_jax.eval.metrics import evaluate_pair, make_compare_fn, val_batches
from farskip_jax.loading.checkpoint import Checkpointer

PRESETS = ("farskip", "attn_only", "mlp_only")


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", required=True, help="a pretraining run folder (standard connectivity)")
    p.add_argument("--out", required=True)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--eval-batches", type=int, default=16, help="batches per report slice")
    p.add_argument("--report-starts", default="8", help="comma list of validation batch indices where slices start")
    p.add_argument("--steps", default="", help="comma list of checkpoint steps (default: every kept one)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)

    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "hardness.json")
    starts = [int(x) for x in a.report_starts.split(",") if x]
    slice_key = dict(starts=starts, batch_size=a.batch_size, eval_batches=a.eval_batches)
    points = {}
    if os.path.isfile(path):
        with open(path) as f:
            old = json.load(f)
        if old.get("slice") == slice_key:  # points of another report slice are measured again
            points = {int(p["step"]): p for p in old["points"]}
    cfg0 = read_run_config(a.teacher)
    if not os.path.isdir(os.path.join(a.teacher, "checkpoints")):
        raise SystemExit(f"--teacher {a.teacher}: no checkpoints/ folder (give a pretraining run folder)")
    ck = Checkpointer(os.path.abspath(a.teacher), keep=10 ** 6)
    steps = [int(s) for s in a.steps.split(",") if s] or sorted(ck.complete_steps())
    ck.close()
    allb = val_batches(cfg0, max(starts) + a.eval_batches, batch_size=a.batch_size)
    report = [b for s in starts for b in allb[s:s + a.eval_batches]]
    tps = cfg0.train.batch_size * cfg0.train.seq_len
    fns = {}
    for step in steps:
        if step in points:
            continue
        t0 = time.time()
        _, gd, st = load_run(a.teacher, step)
        row = dict(step=step, tokens=step * tps)
        for preset in PRESETS:
            fs = dataclasses.replace(FarSkipConfig(), preset=preset, layers="all")
            if preset not in fns:
                fns[preset] = make_compare_fn(gd, fs)
            r = evaluate_pair(fns[preset], st, st, report)
            row.update(teacher_loss=r.teacher_loss, **{f"{preset}_gap": r.val_loss / r.teacher_loss - 1,
                                                      f"{preset}_top1": r.top1, f"{preset}_kl": r.kl})
        row["report_tokens"] = r.tokens
        points[step] = row
        print(f"step {step:6d} ({row['tokens'] / 1e6:6.1f}M tokens): teacher {row['teacher_loss']:.4f}; converted "
              + ", ".join(f"{p} {100 * row[p + '_gap']:+.1f}% / {100 * row[p + '_top1']:.1f}%" for p in PRESETS)
              + f" ({time.time() - t0:.0f} s)", flush=True)
        with open(path, "w") as f:
            json.dump(dict(teacher=a.teacher, slice=slice_key, points=[points[k] for k in sorted(points)]), f, indent=1)
    rows = [points[k] for k in sorted(points)]
    cmd = "python -m farskip_jax.studies.hardness_curve " + shlex.join(sys.argv[1:] if argv is None else argv)
    L = [f"# Conversion cost along pretraining: {a.teacher}", "",
         f"All layers converted, no training; report slice of {rows[-1]['report_tokens']:,} validation tokens "
         f"(batches of {a.batch_size} x {cfg0.train.seq_len} from {starts}). Gap = converted / teacher val loss - 1.", "",
         "| step | tokens | teacher val loss | " + " | ".join(f"{p} gap / top-1" for p in PRESETS) + " |",
         "|---|---|---|" + "---|" * len(PRESETS)]
    for r in rows:
        L.append(f"| {r['step']} | {r['tokens'] / 1e6:.1f}M | {r['teacher_loss']:.4f} | "
                 + " | ".join(f"{100 * r[p + '_gap']:+.1f}% / {100 * r[p + '_top1']:.1f}%" for p in PRESETS) + " |")
    L += ["", f"Command: `{cmd}`"]
    with open(os.path.join(a.out, "hardness.md"), "w") as f:
        f.write("\n".join(L) + "\n")
    plot(rows, os.path.join(a.out, "hardness.png"), a.teacher)
    print("\n".join(L))
    return 0


def plot(rows: list, path: str, title: str) -> None:
    x = [r["tokens"] / 1e6 for r in rows]
    with figure(path, 1, 2, figsize=(11, 4.2)) as (fig, ax):
        for i, p in enumerate(PRESETS):
            ax[0].plot(x, [100 * r[p + "_gap"] for r in rows], "o-", color=f"C{i}", label=p)
            ax[1].plot(x, [100 * r[p + "_top1"] for r in rows], "o-", color=f"C{i}", label=p)
        tw = ax[0].twinx()
        tw.plot(x, [r["teacher_loss"] for r in rows], "k:", label="teacher val loss")
        tw.set_ylabel("teacher val loss (nats/token)")
        ax[0].axhline(100, color="red", ls="--", lw=0.8, label="+100% (a hard teacher)")
        ax[0].set(xlabel="teacher pretraining tokens (M)", ylabel="converted val loss gap (%)")
        ax[1].set(xlabel="teacher pretraining tokens (M)", ylabel="top-1 agreement with the teacher (%)")
        for a_ in ax:
            a_.grid(alpha=0.3)
            a_.legend(fontsize=8, loc="upper left")
        tw.legend(fontsize=8, loc="lower right")
        fig.suptitle(f"Conversion cost without training along pretraining: {title}", fontsize=9)


if __name__ == "__main__":
    sys.exit(main())

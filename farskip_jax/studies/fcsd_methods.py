"""FCSD recipes side by side on one teacher, with one plot.

For every method and every budget (a fraction of the teacher's pretraining tokens) this runs FCSD of
ALL layers from the teacher's run folder (fcsd/distill.py, configs/distill_tiny.yaml with the
teacher's data and tokenizer, plus the method's overrides, the schedule sized to the budget), early-stopping on the first --select-batches
validation batches, and then evaluates the best student on the next --eval-batches (a disjoint
report slice): loss gap to the teacher and top-1 agreement. Also measured on the same slice: the
converted model before any training. Finished runs are reused (their report.json), so adding a
method or a budget re-runs only what is new.

    python -m farskip_jax.studies.fcsd_methods --teacher runs/hard/dsv2/teacher --out runs/hard/dsv2/methods \\
        --budgets 0.05,0.1,0.2 --methods baseline
    python -m farskip_jax.studies.fcsd_methods ... --method lr1e-3=train.lr=1e-3 --method rkl=distill.kl=both

Methods (--methods picks from METHODS below; --method NAME=OVERRIDE[,OVERRIDE...] adds one):
    baseline     the recipe as given (all layers FarSkip from the first step)
(Connectivity annealing and progressive conversion ran here until 9ffd334: docs/fcsd.md.)
Outputs under --out: <method>_<budget>/ run folders with report.json, results.json, results.md and
methods.png (loss gap and top-1 against FCSD tokens, one line per method).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

from farskip_jax.studies.harness import REPO, figure

os.environ.setdefault("JAX_PLATFORMS", "cpu")
from farskip_jax.config import load_config
from farskip_jax.loading.load import load_run
from farskip_jax.eval.metrics import make_compare_fn, evaluate_pair, val_batches
from farskip_jax.fcsd.distill import distill
from farskip_jax.train.logger import read_metrics

# name -> overrides of the distill config; budget-relative lengths use the placeholders {tokens} (the
# run's token budget), {half}, {tenth} and {stage} (budget / (2 x layers)), so a schedule scales with it
METHODS = {
    "baseline": [],
}


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", required=True, help="the teacher's run folder (standard connectivity)")
    p.add_argument("--out", required=True)
    p.add_argument("--budgets", default="0.05", help="comma list of fractions of the teacher's pretraining tokens")
    p.add_argument("--methods", default="baseline", help=f"comma list of {sorted(METHODS)}")
    p.add_argument("--method", action="append", default=[], metavar="NAME=OVR[,OVR...]", help="an extra method")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--evals", type=int, default=8, help="early-stopping evaluations per run")
    p.add_argument("--select-batches", type=int, default=8)
    p.add_argument("--eval-batches", type=int, default=16, help="batches per report slice")
    p.add_argument("--report-starts", default="",
                   help="comma list of validation batch indices where report slices start (default: right after "
                        "the early-stopping slice); e.g. 8,100 on runs/hard/corpus.jsonl also reports the Python "
                        "docs, whose validation documents follow Shakespeare's")
    p.add_argument("--title", default=None)
    p.add_argument("--table-only", action="store_true",
                   help="run nothing: tabulate and plot the finished runs of these methods and budgets")
    p.add_argument("overrides", nargs="*", help="extra overrides for every run")
    return p.parse_args(argv)


def method_table(a) -> dict:
    table = {}
    for name in [m for m in a.methods.split(",") if m]:
        if name not in METHODS:
            raise SystemExit(f"--methods: unknown {name!r}; choose from {sorted(METHODS)} or add one with --method")
        table[name] = METHODS[name]
    for spec in a.method:
        name, _, ovr = spec.partition("=")
        if not name or not ovr:
            raise SystemExit(f"--method {spec!r}: give NAME=OVERRIDE[,OVERRIDE...]")
        table[name] = ovr.split(",")
    return table


def run_config(a, tcfg, run_dir: str, budget: int, ovr: list):

    # a method may set its own batch (train.batch_size=N): the schedule is sized to the same token budget
    # (fewer steps) and the early-stopping slice stays the same rows (val batches are file order)
    bs = a.batch_size
    for o in ovr:
        if o.startswith("train.batch_size="):
            bs = int(o.partition("=")[2])
    if (a.select_batches * a.batch_size) % bs:
        raise SystemExit(f"train.batch_size={bs}: --select-batches x --batch-size ({a.select_batches} x "
                         f"{a.batch_size}) rows must split into whole batches of {bs}")
    tps = bs * tcfg.train.seq_len
    steps = max(1, budget // tps)
    fill = dict(tokens=budget, half=budget // 2, tenth=budget // 10, stage=budget // (2 * tcfg.model.num_layers))
    d = tcfg.data  # FCSD reads the teacher's own text and tokenizer (distill_tiny.yaml's are the stdlib's bytes)
    data = [f"data.source={d.source}", f"data.paths=[{','.join(d.paths)}]", f"data.tokenizer={d.tokenizer}",
            f"data.val_fraction={d.val_fraction}", f"data.text_field={d.text_field}"]
    return load_config(os.path.join(REPO, "configs/distill_tiny.yaml"), data + [
        f"train.seq_len={tcfg.train.seq_len}", "train.tensorboard=false", "mesh.data=1",
        f"train.batch_size={bs}", f"train.eval_batches={a.select_batches * a.batch_size // bs}",
        f"distill.init_from_run={a.teacher}", f"train.run_dir={run_dir}", "train.overwrite=true",
        f"train.steps={steps}", f"distill.max_tokens={budget}", f"train.lr={a.lr}",
        f"train.min_lr_ratio={a.min_lr_ratio}", f"train.warmup_steps={max(1, steps // 20)}",
        f"distill.eval_every={max(1, steps // a.evals)}", "distill.patience=1000", "train.log_every=25",
        *a.overrides, *[o.format(**fill) for o in ovr]])


def main(argv=None) -> int:
    a = parse(argv)

    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    methods = method_table(a)
    budgets = [float(b) for b in a.budgets.split(",") if b]
    tcfg, t_gd, t_st = load_run(a.teacher, "latest")
    pre = tcfg.train.steps * tcfg.train.batch_size * tcfg.train.seq_len
    starts = [int(x) for x in a.report_starts.split(",") if x] or [a.select_batches]
    if min(starts) < a.select_batches:
        raise SystemExit(f"--report-starts {starts}: a report slice must start at or after --select-batches "
                         f"{a.select_batches} (the early-stopping slice)")
    allb = val_batches(tcfg, max(starts) + a.eval_batches, batch_size=a.batch_size)
    report = [b for s in starts for b in allb[s:s + a.eval_batches]]
    t0 = time.time()

    conv_file = os.path.join(out, "converted.json")
    if os.path.isfile(conv_file):
        with open(conv_file) as f:
            conv = json.load(f)
    else:
        probe = run_config(a, tcfg, os.path.join(out, "probe"), int(budgets[0] * pre), [])
        r = evaluate_pair(make_compare_fn(t_gd, probe.farskip), t_st, t_st, report)
        conv = dict(val_loss=r.val_loss, teacher_loss=r.teacher_loss, top1=r.top1, kl=r.kl, tokens=r.tokens)
        with open(conv_file, "w") as f:
            json.dump(conv, f, indent=1)
    tl = conv["teacher_loss"]
    print(f"teacher {tl:.4f}; converted before training {conv['val_loss']:.4f} ({100 * (conv['val_loss'] / tl - 1):+.1f}%), "
          f"top-1 {100 * conv['top1']:.1f}% (report slice, {conv['tokens']:,} tokens)", flush=True)

    rows = []
    for name, ovr in methods.items():
        for b in budgets:
            budget = int(b * pre)
            rd = os.path.join(out, f"{name}_{b:g}")
            rep_file = os.path.join(rd, "report.json")
            if os.path.isfile(rep_file):
                with open(rep_file) as f:
                    rows.append(json.load(f))
                continue
            if a.table_only:
                print(f"(no finished run {rd}: left out)", flush=True)
                continue
            cfg = run_config(a, tcfg, rd, budget, ovr)
            print(f"== {name} at {100 * b:g}% ({budget:,} tokens, {cfg.train.steps} steps)", flush=True)
            t1 = time.time()
            res = distill(cfg)
            _, gd, best = load_run(rd, "best")
            r = evaluate_pair(make_compare_fn(gd, cfg.farskip), best, t_st, report)
            evals = read_metrics(rd, "eval")
            row = dict(method=name, budget=b, tokens=budget, best_step=res.best_step,
                       best_tokens=res.best_step * cfg.train.batch_size * cfg.train.seq_len, status=res.status,
                       val_loss=r.val_loss, teacher_loss=r.teacher_loss, gap=r.val_loss / r.teacher_loss - 1,
                       top1=r.top1, kl=r.kl, overrides=[o for o in ovr], minutes=(time.time() - t1) / 60,
                       curve=[dict(tokens=e["step"] * cfg.train.batch_size * cfg.train.seq_len,
                                   gap=e["val_loss"] / e["teacher_loss"] - 1, top1=e["top1"]) for e in evals])
            with open(rep_file, "w") as f:
                json.dump(row, f, indent=1)
            rows.append(row)
            print(f"   {name} {100 * b:g}%: gap {100 * row['gap']:+.2f}% top-1 {100 * row['top1']:.2f}% "
                  f"({row['minutes']:.1f} min)", flush=True)

    L = [f"# FCSD methods on {a.teacher} ({time.strftime('%Y-%m-%d', time.gmtime())})", "",
         f"teacher: {tcfg.model.num_layers} layers, d_model {tcfg.model.d_model}, attention {tcfg.model.attention}, "
         f"{tcfg.moe.num_experts} experts top-{tcfg.moe.top_k} + {tcfg.moe.num_shared_experts} shared, vocab "
         f"{tcfg.model.vocab_size}; pretrained {pre:,} tokens. Report slice: {conv['tokens']:,} validation tokens "
         f"(batches of {a.batch_size} x {tcfg.train.seq_len} starting at {starts}, {a.eval_batches} each; early "
         f"stopping on the first {a.select_batches}).",
         f"Recipe: forward KL unless a method says otherwise, lr {a.lr:g} cosine to x{a.min_lr_ratio:g}, batch "
         f"{a.batch_size} x {tcfg.train.seq_len}; extra overrides {a.overrides or 'none'}.", "",
         f"Converted before training: val loss {conv['val_loss']:.4f} vs teacher {tl:.4f} "
         f"(**{100 * (conv['val_loss'] / tl - 1):+.1f}%**), top-1 {100 * conv['top1']:.1f}%.", "",
         "| method | budget | val loss gap | top-1 | KL | best at | overrides |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        L.append(f"| {r['method']} | {100 * r['budget']:g}% | {100 * r['gap']:+.2f}% | {100 * r['top1']:.2f}% | "
                 f"{r['kl']:.4f} | {100 * r['best_tokens'] / pre:.1f}% | {' '.join(r['overrides']) or '-'} |")
    cmd = "python -m farskip_jax.studies.fcsd_methods " + shlex.join(sys.argv[1:] if argv is None else argv)
    L += ["", f"Command: `{cmd}` ({(time.time() - t0) / 60:.0f} min for the new runs)"]
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(L) + "\n")
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(dict(converted=conv, pretrain_tokens=pre, rows=rows), f, indent=1)
    plot(rows, conv, pre, os.path.join(out, "methods.png"), a.title or f"FCSD of all layers: {a.teacher}")
    print("\n".join(L), flush=True)
    return 0


def plot(rows: list, conv: dict, pre: int, path: str, title: str) -> None:
    with figure(path, 1, 2, figsize=(11, 4.2)) as (fig, ax):
        g0, t0 = 100 * (conv["val_loss"] / conv["teacher_loss"] - 1), 100 * conv["top1"]
        for i, name in enumerate(dict.fromkeys(r["method"] for r in rows)):
            mine = sorted((r for r in rows if r["method"] == name), key=lambda r: r["budget"])
            c = f"C{i}"
            x = [0] + [100 * r["budget"] for r in mine]
            ax[0].plot(x, [g0] + [100 * r["gap"] for r in mine], "o-", color=c, label=name)
            ax[1].plot(x, [t0] + [100 * r["top1"] for r in mine], "o-", color=c, label=name)
            longest = mine[-1]["curve"]  # the in-run curve of the largest budget, early-stopping slice
            ax[0].plot([100 * e["tokens"] / pre for e in longest], [100 * e["gap"] for e in longest], ":", color=c, lw=0.8)
            ax[1].plot([100 * e["tokens"] / pre for e in longest], [100 * e["top1"] for e in longest], ":", color=c, lw=0.8)
        ax[0].axhline(1, color="red", ls="--", lw=0.8, label="+1% (goal)")
        ax[0].set_yscale("symlog", linthresh=1)
        ax[1].axhline(95, color="red", ls="--", lw=0.8, label="95% (goal)")
        ax[0].set(xlabel="FCSD tokens (% of teacher pretraining)", ylabel="val loss gap to teacher (%)")
        ax[1].set(xlabel="FCSD tokens (% of teacher pretraining)", ylabel="top-1 agreement (%)")
        for x in ax:
            x.grid(alpha=0.3)
            x.legend(fontsize=8)
        fig.suptitle(title + "\n(points: best student per budget, report slice; dotted: in-run curve of the largest "
                     "budget, early-stopping slice)", fontsize=9)


if __name__ == "__main__":
    sys.exit(main())

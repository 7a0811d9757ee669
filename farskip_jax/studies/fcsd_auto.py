"""farskip.layers: auto on the hard teachers (docs/fcsd.md "Budgeted conversion"): for each teacher,
FCSD at a token budget (default 5% of its pretraining) with `farskip.layers=auto` at each quality
budget, the recipe of studies/fcsd_methods.py (its run_config: lr 1e-3 cosine to 1e-4, batch
8 x 256, early stopping on the first 8 validation batches), then the best student and the untrained
chosen set on fcsd_methods' report slice (--report-starts 8,100: 16 batches each, Shakespeare and the
Python docs). A quality budget whose choice equals an earlier budget's reuses that run (the same
config: FCSD is deterministic). Finished runs are reused (report.json).

    python -m farskip_jax.studies.fcsd_auto --teachers qwen3,dsv2 --budgets 0.01,0.02

Writes runs/hard/<teacher>/auto/<budget>/ (run folders, each with farskip_auto.json / .md) and
auto_runs.json, results.md and <teacher>_plan.md (the plan table of the first budget's run) to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from farskip_jax.studies.harness import REPO, results_dir  # noqa: E402
from farskip_jax.studies.fcsd_methods import run_config
from farskip_jax.fcsd.planner import read_plan
from farskip_jax.loading.load import load_run
from farskip_jax.eval.metrics import evaluate_pair, make_compare_fn, val_batches
from farskip_jax.fcsd.distill import distill
from farskip_jax.fcsd.planner import Plan, choose


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teachers", default="qwen3,dsv2", help="names under runs/hard/ (each has teacher/)")
    p.add_argument("--budgets", default="0.01,0.02", help="distill.auto_budget values")
    p.add_argument("--tokens", type=float, default=0.05, help="FCSD tokens as a fraction of the teacher's pretraining")
    p.add_argument("--search", default="ends", choices=("ends", "greedy"))
    p.add_argument("--tag", default="", help="a recipe variant: run folders <budget>_<tag>, results_<tag>.md")
    p.add_argument("--out", default=results_dir(os.path.join("fcsd", "hard", "auto")),
                   help="where auto_runs.json, results.md and <teacher>_plan.md go")
    p.add_argument("overrides", nargs="*", help="extra distill overrides for every run, e.g. train.lr=1e-4")
    a = p.parse_args(argv)
    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    os.chdir(REPO)


    ns = argparse.Namespace(batch_size=8, lr=1e-3, min_lr_ratio=0.1, evals=8, select_batches=8,
                            overrides=list(a.overrides))
    sfx = f"_{a.tag}" if a.tag else ""
    starts, n_rep = [8, 100], 16
    rows, t0 = [], time.time()
    for name in [t for t in a.teachers.split(",") if t]:
        teacher = f"runs/hard/{name}/teacher"
        ns.teacher = teacher
        tcfg, t_gd, t_st = load_run(teacher, "latest")
        pre = tcfg.train.steps * tcfg.train.batch_size * tcfg.train.seq_len
        allb = val_batches(tcfg, max(starts) + n_rep, batch_size=ns.batch_size)
        report = [b for s in starts for b in allb[s:s + n_rep]]
        done: dict = {}  # chosen layers -> row of the run that trained them
        for budget in [float(b) for b in a.budgets.split(",") if b]:
            rd = f"runs/hard/{name}/auto/{budget:g}{sfx}"
            rep_file = os.path.join(rd, "report.json")
            if os.path.isfile(rep_file):
                with open(rep_file) as f:
                    row = json.load(f)
                rows.append(row)
                done.setdefault(tuple(row["layers"]), row)
                continue
            ovr = ["farskip.layers=auto", f"distill.auto_budget={budget}", f"distill.auto_search={a.search}"]
            cfg = run_config(ns, tcfg, rd, int(a.tokens * pre), ovr)
            if done:  # the candidates do not depend on the budget: choose from the first run's sweep

                first = read_plan(next(iter(done.values()))["run_dir"])
                plan = Plan.from_json(first)
                layers = choose(plan.candidates, budget, plan.retention).layers
                if layers in done:
                    row = dict(done[layers], budget=budget, reused_from=done[layers]["budget"], minutes=0.0)
                    os.makedirs(rd, exist_ok=True)
                    with open(rep_file, "w") as f:
                        json.dump(row, f, indent=1)
                    rows.append(row)
                    print(f"== {name} budget {100 * budget:g}%: same set {list(layers)} as {100 * row['reused_from']:g}%",
                          flush=True)
                    continue
            print(f"== {name}: FCSD at {100 * a.tokens:g}% tokens, farskip.layers=auto, budget {100 * budget:g}%",
                  flush=True)
            t1 = time.time()
            res = distill(cfg)
            rcfg, gd, best = load_run(rd, "best")  # the run's resolved config: an explicit layer list
            layers = tuple(rcfg.farskip.layers)
            stored = read_plan(rd)
            fn = make_compare_fn(gd, rcfg.farskip)
            r = evaluate_pair(fn, best, t_st, report)
            r0 = evaluate_pair(fn, t_st, t_st, report)  # the chosen set, untrained, on the report slice
            chosen = next(c for c in stored["candidates"] if c["name"] == stored["choice"])
            row = dict(teacher=name, budget=budget, tag=a.tag, overrides=list(a.overrides), tokens=int(a.tokens * pre), token_share=a.tokens, layers=list(layers),
                       choice=stored["choice"], run_dir=rd, status=res.status, best_step=res.best_step,
                       retention=stored["retention"], plan_gap=chosen["gap"], predicted=stored["predicted_gap"],
                       untrained_gap=r0.val_loss / r0.teacher_loss - 1, untrained_top1=r0.top1,
                       gap=r.val_loss / r.teacher_loss - 1, top1=r.top1, kl=r.kl, overlap=stored["overlap"],
                       minutes=(time.time() - t1) / 60)
            with open(rep_file, "w") as f:
                json.dump(row, f, indent=1)
            rows.append(row)
            done.setdefault(layers, row)
            if not sfx:
                shutil.copyfile(os.path.join(rd, "farskip_auto.md"), os.path.join(out, f"{name}_plan.md"))
            print(f"   {name} {100 * budget:g}%: layers {list(layers)}: gap {100 * row['gap']:+.2f}% "
                  f"(predicted {100 * row['predicted']:+.2f}%), top-1 {100 * row['top1']:.2f}% ({row['minutes']:.1f} min)",
                  flush=True)

    L = [f"# farskip.layers: auto on the hard teachers ({time.strftime('%Y-%m-%d', time.gmtime())})", "",
         f"FCSD with {100 * a.tokens:g}% of each teacher's pretraining tokens (studies/fcsd_methods.py's recipe"
         + (f", overrides {' '.join(a.overrides)}" if a.overrides else "") + "), "
         "farskip.layers=auto at each quality budget. Plan gaps: the sweep on the early-stopping batches (the first 8 "
         "validation batches); report: fcsd_methods' report slice (validation batches 8-23 and 100-115).", "",
         "| teacher | budget | choice | layers | plan: untrained gap | predicted after FCSD | report: untrained gap | "
         "after FCSD | top-1 | measured retention | freed all-to-alls | est. fwd hidden |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ret = r["gap"] / r["untrained_gap"] if r["untrained_gap"] > 0 else float("nan")
        o = r["overlap"]
        L.append(f"| {r['teacher']} | {100 * r['budget']:g}% | {r['choice']}"
                 + (f" (= {100 * r['reused_from']:g}% run)" if "reused_from" in r else "")
                 + f" | {r['layers']} | {100 * r['plan_gap']:+.2f}% | {100 * r['predicted']:+.2f}% | "
                 f"{100 * r['untrained_gap']:+.2f}% | **{100 * r['gap']:+.2f}%** | {100 * r['top1']:.2f}% | {ret:.2f} | "
                 f"{o['freed']} of {o['total']} | {100 * o['hidden_fwd_est']:.0f}% |")
    cmd = "python -m farskip_jax.studies.fcsd_auto " + shlex.join(sys.argv[1:] if argv is None else argv)
    L += ["", f"Command: `{cmd}` ({(time.time() - t0) / 60:.0f} min for the new runs)"]
    with open(os.path.join(out, f"results{sfx}.md"), "w") as f:
        f.write("\n".join(L) + "\n")
    with open(os.path.join(out, f"auto_runs{sfx}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\n".join(L), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

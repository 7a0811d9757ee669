"""Recorded FCSD experiment (issue 6), rerunnable on CPU:

1. pretrain a small MoE teacher with standard connectivity on the embedded corpus (the trainer);
2. conversion sweep without training: first-N vs last-N layers converted to FarSkip (CSV + plot);
3. convert ALL layers and self-distill (FCSD, forward KL to the frozen teacher) with at most
   `--budget` (default 5%) of the teacher's pretraining tokens, early stopping on validation KL;
4. a table: validation loss of the teacher, of the converted model before training and after FCSD,
   top-1 agreement with the teacher, tokens used; targets: loss within 1% of the teacher's and
   top-1 agreement >= 95%.

    python benchmarks/fcsd_experiment.py                       # ~20-30 min on 2 shared CPU cores
    python benchmarks/fcsd_experiment.py --teacher-steps 200 --out runs/fcsd_quick

Outputs under --out: teacher/ and fcsd/ run folders, sweep.csv, sweep.png, fcsd.png, results.md.
Re-running reuses a finished teacher run (the trainer resumes/returns at once).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a CPU experiment; JAX_PLATFORMS=cuda to run it on a GPU


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/fcsd_experiment")
    p.add_argument("--teacher-steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--distill-batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--budget", type=float, default=0.05, help="FCSD tokens as a fraction of pretraining tokens")
    p.add_argument("--distill-lr", type=float, default=2e-3)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--reuse-fcsd", action="store_true", help="reuse a finished FCSD run under --out (table only)")
    p.add_argument("overrides", nargs="*", help="extra overrides for both runs, e.g. model.num_layers=6")
    a = p.parse_args(argv)

    from farskip_jax.config import load_config
    from farskip_jax.eval.loading import load_run
    from farskip_jax.eval.metrics import evaluate_pair, make_compare_fn, val_batches
    from farskip_jax.eval.sweep import conversion_sweep, plot_sweep, write_csv
    from farskip_jax.train.distill import distill
    from farskip_jax.train.logger import read_metrics
    from farskip_jax.train.trainer import train

    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    common = [f"train.seq_len={a.seq_len}", "train.tensorboard=false", "mesh.data=1", *a.overrides]

    # 1. teacher ------------------------------------------------------------------------------
    tcfg = load_config(os.path.join(ROOT, "configs/tiny.yaml"), common + [
        f"train.batch_size={a.batch_size}", f"train.eval_batches={a.eval_batches}",
        f"train.steps={a.teacher_steps}", f"train.run_dir={out}/teacher", "train.eval_every=0",
        f"train.checkpoint_every={a.teacher_steps}", "train.log_every=50"])
    print(f"== 1. pretraining the teacher: {a.teacher_steps} steps x {a.batch_size * a.seq_len} tokens", flush=True)
    tres = train(tcfg)
    teacher_tokens = a.teacher_steps * a.batch_size * a.seq_len

    # 2. conversion sweep without training ------------------------------------------------------
    print("== 2. first-N vs last-N conversion without training", flush=True)
    cfg, graphdef, st = load_run(tres.run_dir, "latest")
    batches = val_batches(cfg, a.eval_batches)
    rows = conversion_sweep(graphdef, st, cfg, batches, preset="farskip")
    write_csv(rows, os.path.join(out, "sweep.csv"))
    plot_sweep(rows, os.path.join(out, "sweep.png"), title=f"FarSkip conversion without training ({cfg.model.num_layers} layers)")

    # 3. FCSD of all layers ---------------------------------------------------------------------
    budget = int(a.budget * teacher_tokens)
    steps = budget // (a.distill_batch_size * a.seq_len)
    print(f"== 3. FCSD, all layers, budget {budget:,} tokens = {steps} steps", flush=True)
    dcfg = load_config(os.path.join(ROOT, "configs/distill_tiny.yaml"), common + [
        f"train.batch_size={a.distill_batch_size}", f"train.eval_batches={max(1, a.eval_batches // 2)}",
        f"distill.init_from_run={tres.run_dir}", f"train.run_dir={out}/fcsd", "train.overwrite=true",
        f"train.steps={steps}", f"distill.max_tokens={budget}", f"train.lr={a.distill_lr}",
        f"train.warmup_steps={max(1, steps // 20)}", f"distill.eval_every={a.eval_every}", "distill.patience=1000",
        "train.log_every=10"])
    es_file = os.path.join(out, "fcsd", "early_stopping.json")
    if a.reuse_fcsd and os.path.isfile(es_file):
        import types

        with open(es_file) as f:
            es = json.load(f)
        ev = [dict(r) for r in read_metrics(os.path.join(out, "fcsd"), "eval")]
        ends = [r for r in read_metrics(os.path.join(out, "fcsd"), "event") if "status" in r]
        status = ends[-1]["status"] if ends else "interrupted (partial run)"
        dres = types.SimpleNamespace(run_dir=os.path.join(out, "fcsd"), best_step=es["best_step"], status=status, evals=ev)
    else:
        dres = distill(dcfg)

    # 4. table ------------------------------------------------------------------------------------
    _, gd_s, best = load_run(dres.run_dir, "best")
    conv = evaluate_pair(make_compare_fn(graphdef, dcfg.farskip), st, st, batches)
    after = evaluate_pair(make_compare_fn(gd_s, dcfg.farskip), best, st, batches)
    used = dres.best_step * a.distill_batch_size * a.seq_len
    teacher_loss = conv.teacher_loss
    rows_t = [
        ("teacher (standard)", teacher_loss, 1.0, 0.0, 0),
        ("converted, before training", conv.val_loss, conv.top1, conv.kl, 0),
        ("after FCSD (best checkpoint)", after.val_loss, after.top1, after.kl, used),
    ]
    lines = [f"# FCSD experiment ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
             f"teacher: {cfg.model.num_layers} layers, d_model {cfg.model.d_model}, {cfg.moe.num_experts} experts "
             f"top-{cfg.moe.top_k} + {cfg.moe.num_shared_experts} shared; pretrained {teacher_tokens:,} tokens "
             f"({a.teacher_steps} steps). Validation: {conv.tokens:,} tokens.", "",
             "| model | val loss | vs teacher | top-1 agreement | KL(teacher||model) | FCSD tokens |",
             "|---|---|---|---|---|---|"]
    for name, loss, top1, kl, toks in rows_t:
        lines.append(f"| {name} | {loss:.4f} | {100 * (loss / teacher_loss - 1):+.2f}% | {100 * top1:.2f}% | {kl:.5f} | "
                     f"{toks:,} ({100 * toks / teacher_tokens:.2f}%) |")
    ok_loss = after.val_loss <= 1.01 * teacher_loss
    ok_top1 = after.top1 >= 0.95
    lines += ["", f"target loss within 1% of teacher: {'MET' if ok_loss else 'NOT MET'}; "
                  f"top-1 >= 95%: {'MET' if ok_top1 else 'NOT MET'}; early-stop status: {dres.status}", "",
              "## first-N vs last-N conversion without training", "",
              "| converted | N | val loss | KL | top-1 |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['direction']} | {r['layers']} | {r['val_loss']:.4f} | {r['kl']:.5f} | {100 * r['top1']:.2f}% |")
    lines += ["", f"wall time: {(time.time() - t0) / 60:.1f} min"]
    text = "\n".join(lines)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(dict(table=rows_t, sweep=rows, evals=dres.evals, teacher_tokens=teacher_tokens, fcsd_tokens=used,
                       best_step=dres.best_step, status=dres.status), f, indent=1)
    _plot_fcsd(read_metrics(dres.run_dir, "eval"), teacher_loss, a.distill_batch_size * a.seq_len, teacher_tokens,
               os.path.join(out, "fcsd.png"))
    print(text, flush=True)
    print(f"files: {out}/results.md sweep.csv sweep.png fcsd.png", flush=True)
    return 0


def _plot_fcsd(evals: list, teacher_loss: float, tokens_per_step: int, teacher_tokens: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [100 * e["step"] * tokens_per_step / teacher_tokens for e in evals]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].plot(x, [e["val_loss"] for e in evals], "o-", label="FarSkip student")
    t_loss = evals[0].get("teacher_loss", teacher_loss)  # the teacher on the same (in-run) validation batches
    ax[0].axhline(t_loss, color="gray", ls=":", label="teacher (standard)")
    ax[0].axhline(1.01 * t_loss, color="red", ls="--", lw=0.8, label="teacher + 1%")
    ax[0].set_title("in-run validation batches", fontsize=9)
    ax[0].set(xlabel="FCSD tokens (% of teacher pretraining)", ylabel="validation loss")
    ax[1].plot(x, [100 * e["top1"] for e in evals], "o-", label="top-1 agreement")
    ax[1].axhline(95, color="red", ls="--", lw=0.8, label="95%")
    ax[1].set(xlabel="FCSD tokens (% of teacher pretraining)", ylabel="top-1 agreement with teacher (%)")
    for a in ax:
        a.grid(alpha=0.3)
        a.legend()
    fig.suptitle("FCSD: all layers converted to FarSkip")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())

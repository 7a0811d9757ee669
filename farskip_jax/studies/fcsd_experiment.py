"""Recorded FCSD experiment, rerunnable on CPU:

1. pretrain a small MoE teacher with standard connectivity on the embedded corpus (the trainer),
   and (--second-seed) a second teacher of the same recipe from another seed;
2. conversion sweep without training: first-N vs last-N layers converted to FarSkip (CSV + plot);
3. convert ALL layers and self-distill (FCSD, KL to the frozen teacher) with at most `--budget`
   (default 5%) of the teacher's pretraining tokens, early stopping on an in-run validation slice;
4. tables on a held-out validation slice (disjoint from the early-stopping slice): validation loss
   of the teacher, of the converted model before and after FCSD, top-1 agreement with the teacher,
   KL, tokens used (targets: loss within 1% of the teacher's, top-1 >= 95%); and the noise floor of
   top-1 agreement between STANDARD models: the teacher vs its own checkpoint 5% of pretraining
   earlier, and vs the second-seed teacher. Extra columns (never in place of top-1): the teacher's
   mean max-probability and top-1 agreement restricted to positions where it is >= --confidence.

    python -m farskip_jax.studies.fcsd_experiment                # ~45-60 min on 2 busy CPU cores (two teachers)
    python -m farskip_jax.studies.fcsd_experiment --teacher-steps 200 --second-seed -1 --out runs/fcsd_quick

Outputs under --out: teacher/, teacher_seed<S>/ and fcsd/ run folders, sweep.csv, sweep.png,
fcsd.png, results.md, results.json (with --fcsd-dir fcsd_NAME or NAME: results_NAME.md/.json and
fcsd_NAME.png, so recipe variants of one teacher sit side by side). Finished teacher runs are reused
(the trainer returns at once); --reuse-sweep reads sweep.csv instead of re-running the sweep.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from farskip_jax.studies.harness import REPO, figure

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a CPU experiment; JAX_PLATFORMS=cuda to run it on a GPU
from farskip_jax.config import load_config
from farskip_jax.loading.load import load_run
from farskip_jax.eval.metrics import STANDARD, evaluate_pair, make_compare_fn, val_batches
from farskip_jax.eval.sweep import conversion_sweep, plot_sweep, read_csv, write_csv
from farskip_jax.fcsd.distill import distill
from farskip_jax.train.logger import read_metrics
from farskip_jax.train.trainer import train
import types


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/fcsd")
    p.add_argument("--teacher-steps", type=int, default=1500)
    p.add_argument("--batch-size", type=int, default=16, help="teacher batch (rows of --seq-len)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--second-seed", type=int, default=1, help="train.seed of the noise-floor teacher; -1: skip it")
    p.add_argument("--budget", type=float, default=0.05, help="FCSD tokens as a fraction of pretraining tokens")
    p.add_argument("--distill-batch-size", type=int, default=8)
    p.add_argument("--distill-lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decay to lr * this at the budget's end")
    p.add_argument("--kl", default="forward", choices=["forward", "reverse", "both"])
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--ce-weight", type=float, default=0.0)
    p.add_argument("--hidden-weight", type=float, default=0.0,
                   help="> 0: add this weight x mean over layers of ||h_student - h_teacher||^2 / d_model "
                        "(per-layer full streams)")
    p.add_argument("--top-k", type=int, default=0, help="> 0: forward KL on the teacher's top-k tokens plus one tail bucket")
    p.add_argument("--eval-every", type=int, default=25, help="FCSD steps between early-stopping evaluations")
    p.add_argument("--select-batches", type=int, default=8,
                   help="early-stopping slice: the first N validation batches of --distill-batch-size rows")
    p.add_argument("--eval-batches", type=int, default=16,
                   help="report slice: the next N validation batches (disjoint from the early-stopping slice)")
    p.add_argument("--confidence", type=float, default=0.5, help="teacher max-probability of a 'confident' position")
    p.add_argument("--distill-seed", type=int, default=0,
                   help="train.seed of the FCSD run: the order of its training stream (the early-stopping and "
                        "report slices are validation text in file order, the same for every seed)")
    p.add_argument("--fcsd-dir", default="fcsd", help="FCSD run folder name under --out (sweeps of the recipe)")
    p.add_argument("--reuse-fcsd", action="store_true", help="reuse a finished FCSD run under --out (table only)")
    p.add_argument("--sweep-step", type=int, default=1,
                   help="conversion sweep over N = 0, k, 2k, ..., num_layers (k > 1: fewer compiles for deep models)")
    p.add_argument("--reuse-sweep", action="store_true",
                   help="read the conversion sweep from --out/sweep.csv when it exists (recipe variants of one teacher)")
    p.add_argument("overrides", nargs="*", help="extra overrides for every run, e.g. model.num_layers=6")
    return p.parse_args(argv)


def teacher_config(a, out: str, seed: int):

    name = "teacher" if seed == 0 else f"teacher_seed{seed}"
    return load_config(os.path.join(REPO, "configs/tiny.yaml"), [
        f"train.seq_len={a.seq_len}", "train.tensorboard=false", "mesh.data=1", *a.overrides,
        f"train.batch_size={a.batch_size}", "train.eval_batches=8", f"train.steps={a.teacher_steps}",
        f"train.run_dir={os.path.join(out, name)}", f"train.eval_every={max(1, a.teacher_steps // 6)}", f"train.seed={seed}",
        f"train.checkpoint_every={max(1, a.teacher_steps // 20)}", "train.keep_checkpoints=2", "train.log_every=50"])


def fcsd_config(a, out: str, teacher_dir: str, steps: int, budget: int):

    return load_config(os.path.join(REPO, "configs/distill_tiny.yaml"), [
        f"train.seq_len={a.seq_len}", "train.tensorboard=false", "mesh.data=1", *a.overrides,
        f"train.batch_size={a.distill_batch_size}", f"train.eval_batches={a.select_batches}",
        f"distill.init_from_run={teacher_dir}", f"train.run_dir={out}/{a.fcsd_dir}", "train.overwrite=true",
        f"train.steps={steps}", f"train.seed={a.distill_seed}", f"distill.max_tokens={budget}", f"train.lr={a.distill_lr}",
        f"train.min_lr_ratio={a.min_lr_ratio}", f"train.warmup_steps={max(1, steps // 20)}",
        f"distill.kl={a.kl}", f"distill.temperature={a.temperature}", f"distill.ce_weight={a.ce_weight}",
        f"distill.hidden_weight={a.hidden_weight}",
        f"distill.top_k_logits={a.top_k}", f"distill.eval_every={a.eval_every}", "distill.patience=1000",
        "train.log_every=25"])


def main(argv=None) -> int:
    a = parse(argv)

    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    teacher_tokens = a.teacher_steps * a.batch_size * a.seq_len

    # 1. teachers --------------------------------------------------------------------------------
    print(f"== 1. pretraining the teacher: {a.teacher_steps} steps x {a.batch_size * a.seq_len} tokens", flush=True)
    tres = train(teacher_config(a, a.out, 0))  # run_dir as given: a re-run from the same folder resumes it
    seed_dir = None
    if a.second_seed >= 0:
        print(f"== 1b. the same recipe from train.seed={a.second_seed} (noise floor of top-1 agreement)", flush=True)
        seed_dir = train(teacher_config(a, a.out, a.second_seed)).run_dir

    cfg, graphdef, st = load_run(tres.run_dir, "latest")
    # report slice: batches [select, select + eval) of distill_batch_size rows; the FCSD run early-stops
    # on batches [0, select) of the same stream (distill.val_batches), so the two never overlap
    allb = val_batches(cfg, a.select_batches + a.eval_batches, batch_size=a.distill_batch_size)
    batches = allb[a.select_batches:]

    # 2. conversion sweep without training ------------------------------------------------------
    print("== 2. first-N vs last-N conversion without training", flush=True)
    sweep_csv = os.path.join(out, "sweep.csv")
    if a.reuse_sweep and os.path.isfile(sweep_csv):
        rows = read_csv(sweep_csv)
        print(f"(reusing {sweep_csv})", flush=True)
    else:
        L = cfg.model.num_layers
        counts = sorted(set(range(0, L + 1, max(1, a.sweep_step))) | {L})
        rows = conversion_sweep(graphdef, st, cfg, batches, preset="farskip", counts=counts)
        write_csv(rows, sweep_csv)
        plot_sweep(rows, os.path.join(out, "sweep.png"),
                   title=f"FarSkip conversion without training ({cfg.model.num_layers} layers)")

    # 3. FCSD of all layers ---------------------------------------------------------------------
    budget = int(a.budget * teacher_tokens)
    tps = a.distill_batch_size * a.seq_len
    steps = budget // tps
    print(f"== 3. FCSD, all layers, budget {budget:,} tokens = {steps} steps of {tps} tokens", flush=True)
    dcfg = fcsd_config(a, out, tres.run_dir, steps, budget)
    fdir = os.path.join(out, a.fcsd_dir)
    es_file = os.path.join(fdir, "early_stopping.json")
    if a.reuse_fcsd and os.path.isfile(es_file):

        with open(es_file) as f:
            es = json.load(f)
        ends = [r for r in read_metrics(fdir, "event") if "status" in r]
        dres = types.SimpleNamespace(run_dir=fdir, best_step=es["best_step"],
                                     status=ends[-1]["status"] if ends else "interrupted (partial run)")
    else:
        dres = distill(dcfg)

    # 4. tables on the report slice ---------------------------------------------------------------
    cmp = lambda gd, fs: make_compare_fn(gd, fs, confidence=a.confidence)
    _, gd_s, best = load_run(dres.run_dir, "best")
    conv = evaluate_pair(cmp(graphdef, dcfg.farskip), st, st, batches)
    after = evaluate_pair(cmp(gd_s, dcfg.farskip), best, st, batches)
    used = dres.best_step * tps
    tl = conv.teacher_loss
    table = [("teacher (standard)", tl, 1.0, 1.0, 0.0, 0),
             ("converted, before training", conv.val_loss, conv.top1, conv.top1_confident, conv.kl, 0),
             ("after FCSD (best checkpoint)", after.val_loss, after.top1, after.top1_confident, after.kl, used)]
    floor = []  # standard-connectivity models compared with the teacher: how much argmax agreement moves anyway
    early = a.teacher_steps - max(1, a.teacher_steps // 20)
    try:
        _, gd_e, st_e = load_run(tres.run_dir, early)
        r = evaluate_pair(cmp(gd_e, STANDARD), st_e, st, batches)
        floor.append((f"teacher at step {early} (5% fewer pretraining tokens)", r))
    except Exception as e:  # noqa: BLE001 - a teacher run without that checkpoint: leave the row out
        print(f"(no checkpoint at step {early}: {e})", flush=True)
    if seed_dir:
        _, gd_2, st_2 = load_run(seed_dir, "latest")
        floor.append((f"teacher from train.seed={a.second_seed} (same recipe)", evaluate_pair(cmp(gd_2, STANDARD), st_2, st, batches)))

    recipe = (f"{a.kl} KL, T={a.temperature:g}, ce_weight {a.ce_weight:g}, hidden_weight {a.hidden_weight:g}, "
              f"top-k {a.top_k or 'all'}, lr {a.distill_lr:g} "
              f"(warmup {max(1, steps // 20)}, cosine to x{a.min_lr_ratio:g}), batch {a.distill_batch_size} x {a.seq_len}, "
              f"data-order seed {a.distill_seed}")
    L = [f"# FCSD experiment ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
         f"teacher: {cfg.model.num_layers} layers, d_model {cfg.model.d_model}, {cfg.moe.num_experts} experts "
         f"top-{cfg.moe.top_k} + {cfg.moe.num_shared_experts} shared, byte-level; pretrained {teacher_tokens:,} tokens "
         f"({a.teacher_steps} steps x {a.batch_size} x {a.seq_len}). Report slice: {conv.tokens:,} validation tokens "
         f"(early stopping used a disjoint slice of {a.select_batches * tps:,}).",
         f"FCSD recipe: {recipe}; budget {budget:,} tokens ({100 * a.budget:g}%), all layers converted.", "",
         f"| model | val loss | vs teacher | top-1 agreement | top-1 where teacher p_max >= {a.confidence:g} | "
         "KL(teacher‖model) | FCSD tokens |", "|---|---|---|---|---|---|---|"]
    for name, loss, top1, top1c, kl, toks in table:
        L.append(f"| {name} | {loss:.4f} | {100 * (loss / tl - 1):+.2f}% | {100 * top1:.2f}% | {100 * top1c:.2f}% | "
                 f"{kl:.5f} | {toks:,} ({100 * toks / teacher_tokens:.2f}%) |")
    ok_loss, ok_top1 = after.val_loss <= 1.01 * tl, after.top1 >= 0.95
    L += ["", f"target loss within 1% of teacher: {'MET' if ok_loss else 'NOT MET'}; "
              f"top-1 >= 95%: {'MET' if ok_top1 else 'NOT MET'}; early-stop status: {dres.status}", "",
          f"The teacher's mean max next-token probability is {conv.teacher_maxp:.3f}; {100 * conv.confident:.1f}% of "
          f"positions have p_max >= {a.confidence:g}.", "",
          "## noise floor: top-1 agreement between standard-connectivity models", "",
          "| model vs the teacher | its val loss | top-1 agreement | top-1 where teacher p_max >= "
          f"{a.confidence:g} | KL(teacher‖model) |", "|---|---|---|---|---|"]
    for name, r in floor:
        L.append(f"| {name} | {r.val_loss:.4f} | {100 * r.top1:.2f}% | {100 * r.top1_confident:.2f}% | {r.kl:.5f} |")
    L += ["", "## first-N vs last-N conversion without training", "",
          "| converted | N | val loss | KL | top-1 |", "|---|---|---|---|---|"]
    for r in rows:
        L.append(f"| {r['direction']} | {r['layers']} | {r['val_loss']:.4f} | {r['kl']:.5f} | {100 * r['top1']:.2f}% |")
    L += ["", f"wall time: {(time.time() - t0) / 60:.1f} min (2 CPU cores shared with other jobs)"]
    text = "\n".join(L)
    # recipe variants do not overwrite the default's files: --fcsd-dir fcsd_T2 -> results_T2.md, fcsd_T2.png
    sfx = "" if a.fcsd_dir == "fcsd" else "_" + a.fcsd_dir.removeprefix("fcsd_")
    with open(os.path.join(out, f"results{sfx}.md"), "w") as f:
        f.write(text + "\n")
    evals = read_metrics(dres.run_dir, "eval")
    with open(os.path.join(out, f"results{sfx}.json"), "w") as f:
        json.dump(dict(table=table, noise_floor=[(n, vars(r)) for n, r in floor], sweep=rows, evals=evals,
                       teacher_tokens=teacher_tokens, fcsd_tokens=used, best_step=dres.best_step, status=dres.status,
                       recipe=recipe, teacher_maxp=conv.teacher_maxp, confident=conv.confident), f, indent=1)
    _plot_fcsd(evals, tps, teacher_tokens, a.confidence, os.path.join(out, f"fcsd{sfx}.png"))
    print(text, flush=True)
    print(f"files: {out}/results{sfx}.md results{sfx}.json sweep.csv sweep.png fcsd{sfx}.png", flush=True)
    return 0


def _plot_fcsd(evals: list, tokens_per_step: int, teacher_tokens: int, confidence: float, path: str) -> None:
    x = [100 * e["step"] * tokens_per_step / teacher_tokens for e in evals]
    with figure(path, 1, 2, figsize=(10, 4)) as (fig, ax):
        ax[0].plot(x, [e["val_loss"] for e in evals], "o-", label="FarSkip student")
        t_loss = evals[0]["teacher_loss"]  # the teacher on the same (early-stopping) validation slice
        ax[0].axhline(t_loss, color="gray", ls=":", label="teacher (standard)")
        ax[0].axhline(1.01 * t_loss, color="red", ls="--", lw=0.8, label="teacher + 1%")
        ax[0].set_title("early-stopping validation slice", fontsize=9)
        ax[0].set(xlabel="FCSD tokens (% of teacher pretraining)", ylabel="validation loss")
        ax[1].plot(x, [100 * e["top1"] for e in evals], "o-", label="top-1 agreement (all positions)")
        if "top1_confident" in evals[0]:
            ax[1].plot(x, [100 * e["top1_confident"] for e in evals], "s--", ms=4,
                       label=f"extra: positions with teacher p_max >= {confidence:g}")
        ax[1].axhline(95, color="red", ls="--", lw=0.8, label="95%")
        ax[1].set(xlabel="FCSD tokens (% of teacher pretraining)", ylabel="top-1 agreement with teacher (%)")
        for a in ax:
            a.grid(alpha=0.3)
            a.legend(fontsize=8)
        fig.suptitle("FCSD: all layers converted to FarSkip")


if __name__ == "__main__":
    sys.exit(main())

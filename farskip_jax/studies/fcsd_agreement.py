"""Top-1 agreement between two models on the FCSD report slice: how far apart two equally good
conversions (or checkpoints) of one teacher are, the noise floor of "top-1 agreement with the teacher".

    python -m farskip_jax.studies.fcsd_agreement runs/fcsd_16l_long/fcsd_b2_lr075 runs/fcsd_16l_long/fcsd_b2_lr075_seed1 \
        --batch-size 2 --select-batches 32 --eval-batches 64

Each argument is a run folder (an FCSD run: its best checkpoint under its own FarSkip connectivity;
a pretraining run: its latest checkpoint, standard connectivity). The report slice is the one
`fcsd_experiment.py` reports on: validation batches [select, select + eval) of `--batch-size` rows.
Prints, for A vs B: top-1 agreement on all positions and where A's max probability >= --confidence,
KL(A || B), and each model's validation loss.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
from farskip_jax.loading.load import load_run
from farskip_jax.eval.metrics import STANDARD
from farskip_jax.eval.metrics import evaluate_pair, make_compare_fn, val_batches


def load(run_dir: str):
    """(cfg, graphdef, state, connectivity, description) of a run folder."""

    if os.path.isfile(os.path.join(run_dir, "early_stopping.json")):  # a distillation run
        cfg, gd, st = load_run(run_dir, "best")
        return cfg, gd, st, cfg.farskip, f"{run_dir} (best, farskip preset {cfg.farskip.preset})"
    cfg, gd, st = load_run(run_dir, "latest")
    return cfg, gd, st, STANDARD, f"{run_dir} (latest, standard)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", help="run folder of model A (the reference of the confidence split and the KL)")
    ap.add_argument("b", help="run folder of model B")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=None, help="default: A's train.seq_len")
    ap.add_argument("--select-batches", type=int, default=8, help="batches skipped (the early-stopping slice)")
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--confidence", type=float, default=0.5)
    a = ap.parse_args(argv)


    cfg_a, gd_a, st_a, fs_a, desc_a = load(a.a)
    _, gd_b, st_b, fs_b, desc_b = load(a.b)
    batches = val_batches(cfg_a, a.select_batches + a.eval_batches, batch_size=a.batch_size,
                          seq_len=a.seq_len)[a.select_batches:]
    # the compare fn runs one graphdef for both: the models share the architecture (one teacher)
    r = evaluate_pair(make_compare_fn(gd_a, fs_b, fs_a, confidence=a.confidence), st_b, st_a, batches)
    print(f"A: {desc_a}\nB: {desc_b}\nreport slice: {r.tokens:,} tokens")
    print(f"val loss A {r.teacher_loss:.4f}, B {r.val_loss:.4f} ({r.val_loss / r.teacher_loss - 1:+.2%})")
    print(f"top-1 agreement {r.top1:.2%}; where A's p_max >= {a.confidence} ({r.confident:.1%} of positions) "
          f"{r.top1_confident:.2%}; KL(A || B) {r.kl:.5f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

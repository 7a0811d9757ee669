"""Conversion experiments on a trained standard teacher: FCSD (fcsd/distill.py) for several
connectivity variants, recovery curves collected from each distillation run.

    recs = run_fcsd(distill_cfg, [Variant("farskip_all", {"farskip.preset": "farskip"}), ...],
                    teacher_run="runs/.../teacher", out_dir="runs/notebooks/conversion")
    recs[0].evals     # [{step, val_loss, teacher_loss, kl, top1, tokens_used, ...}] step 0 = before training

The conversion sweep without training is farskip_jax.eval.sweep.conversion_sweep (used as is).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Callable, Optional, Sequence

from farskip_jax.config import Config, replace
from farskip_jax.experiments.ablation import Variant
from farskip_jax.fcsd.distill import distill


@dataclasses.dataclass
class FcsdRecord:
    variant: str
    run_dir: str
    status: str
    best_step: Optional[int]
    evals: list  # one dict per evaluation (distill.py run_eval records), step 0 first
    tokens_per_step: int
    wall_s: float

    def at_best(self) -> dict:
        """The evaluation record of the best step (the step kept in <run_dir>/best)."""
        for e in self.evals:
            if e["step"] == self.best_step:
                return e
        return self.evals[-1]


def run_fcsd(distill_cfg: Config, variants: Sequence[Variant], teacher_run: str, out_dir: str, *,
             stream=None, log: Callable[[str], None] = lambda m: print(m, flush=True)) -> list[FcsdRecord]:
    """Self-distil the teacher of `teacher_run` into each variant's connectivity with `distill(cfg)`.

    distill_cfg: a train.mode=distill config (e.g. configs/distill_tiny.yaml with the budget set);
    each variant's overrides (farskip.preset / attn_input / layers ...) are applied on top and the run
    goes to `<out_dir>/fcsd_<variant>` (overwritten: FCSD runs are short)."""
    out_dir = os.path.abspath(out_dir)
    recs = []
    for k, v in enumerate(variants, 1):
        run_dir = os.path.join(out_dir, f"fcsd_{v.name}")
        cfg = replace(v.apply(distill_cfg), **{"distill.init_from_run": os.path.abspath(teacher_run),
                                               "train.run_dir": run_dir, "train.overwrite": True})
        log(f"[fcsd {k}/{len(variants)}] {v.name}: preset={cfg.farskip.preset} layers={cfg.farskip.layers} "
            f"attn_input={cfg.farskip.attn_input} -> {os.path.relpath(run_dir)}")
        t0 = time.time()
        res = distill(cfg, stream=stream if stream is not None else sys.stdout)
        recs.append(FcsdRecord(variant=v.name, run_dir=res.run_dir, status=res.status, best_step=res.best_step,
                               evals=list(res.evals), tokens_per_step=cfg.train.batch_size * cfg.train.seq_len,
                               wall_s=time.time() - t0))
        b = recs[-1].at_best()
        log(f"[fcsd {k}/{len(variants)}] {v.name}: {res.status}; best step {res.best_step}: val loss "
            f"{b['val_loss']:.4f} (teacher {b['teacher_loss']:.4f}), top-1 {100 * b['top1']:.1f}%")
    return recs

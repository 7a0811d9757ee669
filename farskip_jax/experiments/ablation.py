"""Connectivity ablation: the same small MoE pretrained under several connectivities x seeds with the
real trainer (train/trainer.py), validation curves collected from each run's metrics.jsonl, and the
exposed all-to-all fraction of each variant from the overlap tool (analysis/overlap.py).

    base = load_config("configs/tiny.yaml", ["train.steps=200", ...])
    runs = run_ablation(base, VARIANTS, seeds=(0, 1), out_dir="runs/notebooks/ablation")
    table = summarize(runs)                       # final val loss mean / std / min / max per variant
    pairs = paired_differences(runs)              # variant - standard per seed: mean, 95% interval, detectable
    ov = overlap_by_variant(base, VARIANTS, overrides=[...], hardware="mi300x")

A variant is a name and dotted config overrides applied on top of the base config; the seed sets
`train.seed` (initialisation and data order), and the parameter layout does not depend on the
connectivity, so two variants run with one seed start from the same weights and see the same batches
in the same order: a pair. The difference of their final validation losses is free of the spread
between seeds, and paired_differences turns the pairs into an interval and the smallest difference
the runs could detect.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from typing import Callable, Mapping, Optional, Sequence

import numpy as np
from scipy import stats

from farskip_jax.config import Config, replace, apply_overrides, from_dict, to_dict
from farskip_jax.analysis.overlap import run_overlap
from farskip_jax.errors import ConfigError
from farskip_jax.train.logger import read_metrics
from farskip_jax.train.trainer import train


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    overrides: Mapping[str, object]
    label: str = ""

    def apply(self, cfg: Config) -> Config:
        return replace(cfg, **dict(self.overrides)) if self.overrides else cfg


# The connectivities the ablation notebook compares (vocabulary: docs/design.md section 1).
VARIANTS = (
    Variant("standard", {"farskip.preset": "standard"}, "standard (full inputs)"),
    Variant("farskip", {"farskip.preset": "farskip"}, "farskip (attn partial + MoE outdated)"),
    Variant("all_outdated", {"farskip.preset": "farskip", "farskip.attn_input": "outdated"},
            "all outdated (attn outdated + MoE outdated)"),
    Variant("attn_only", {"farskip.preset": "attn_only"}, "attn_only (attn partial)"),
    Variant("mlp_only", {"farskip.preset": "mlp_only"}, "mlp_only (MoE outdated)"),
    Variant("skip2", {"farskip.preset": "farskip", "farskip.skip_distance": 2}, "farskip, skip_distance 2"),
)
# Federation of Experts (model/foe.py) under FarSkip connectivity: tiny.yaml split in 2 groups.
FOE_VARIANT = Variant("foe_farskip", {"runtime.num_groups": 2, "farskip.preset": "farskip"}, "FoE 2 groups + farskip")


def variants_by_name(names: Sequence[str], pool: Sequence[Variant] = VARIANTS + (FOE_VARIANT,)) -> list[Variant]:
    by = {v.name: v for v in pool}
    unknown = [n for n in names if n not in by]
    if unknown:
        raise ConfigError(f"unknown ablation variant(s) {unknown}; choose from {sorted(by)}")
    return [by[n] for n in names]


@dataclasses.dataclass
class RunRecord:
    """One (variant, seed) pretraining run: validation curve and summary numbers."""
    variant: str
    seed: int
    run_dir: str
    steps: list  # eval steps
    val_loss: list  # validation loss at those steps
    final_val_loss: float
    final_train_loss: float
    tokens_per_s: float
    status: str
    wall_s: float


def _eval_curve(run_dir: str) -> tuple[list, list]:
    by_step = {}
    for r in read_metrics(run_dir, "eval"):
        by_step[int(r["step"])] = float(r["val_loss"])  # a resumed run may log a step twice: keep the last
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def run_ablation(base: Config, variants: Sequence[Variant], seeds: Sequence[int], out_dir: str, *,
                 stream=None, log: Callable[[str], None] = lambda m: print(m, flush=True)) -> list[RunRecord]:
    """Pretrain every (variant, seed) with `train(cfg)` into `<out_dir>/<variant>_seed<seed>`.

    A finished run folder is reused (the trainer resumes and returns at once), so rerunning a notebook
    only trains what is missing. `stream` receives the trainer's log lines (None: stdout)."""
    names = [v.name for v in variants]
    for what, items in (("variant", names), ("seed", [int(s) for s in seeds])):
        twice = sorted({x for x in items if items.count(x) > 1})
        if twice:
            raise ConfigError(f"{what}(s) {twice} given twice: each (variant, seed) is one run folder and one record; "
                              f"list each {what} once")
    out_dir = os.path.abspath(out_dir)
    records = []
    n, k = len(variants) * len(seeds), 0
    for v in variants:
        for seed in seeds:
            k += 1
            run_dir = os.path.join(out_dir, f"{v.name}_seed{seed}")
            cfg = replace(v.apply(base), **{"train.seed": int(seed), "train.run_dir": run_dir})
            log(f"[ablation {k}/{n}] {v.name} seed {seed}: {cfg.train.steps} steps -> {os.path.relpath(run_dir)}")
            t0 = time.time()
            res = train(cfg, stream=stream if stream is not None else sys.stdout)
            steps, losses = _eval_curve(run_dir)
            rec = RunRecord(variant=v.name, seed=int(seed), run_dir=run_dir, steps=steps, val_loss=losses,
                            final_val_loss=float(res.val_loss) if res.val_loss is not None else float("nan"),
                            final_train_loss=float(res.final_loss), tokens_per_s=float(res.tokens_per_s or "nan"),
                            status=res.status, wall_s=time.time() - t0)
            log(f"[ablation {k}/{n}] {v.name} seed {seed}: {res.status}, val loss {rec.final_val_loss:.4f} "
                f"({rec.wall_s:.0f}s)")
            records.append(rec)
    return records


def summarize(records: Sequence[RunRecord], reference: str = "standard") -> list[dict]:
    """Per variant (first-seen order): final val loss mean, std (over seeds, ddof=0), min, max, the
    number of seeds and the relative difference of the mean to `reference`'s mean (when present)."""
    order, by = [], {}
    for r in records:
        if r.variant not in by:
            order.append(r.variant)
        by.setdefault(r.variant, []).append(r.final_val_loss)
    ref = float(np.mean(by[reference])) if reference in by else None
    rows = []
    for name in order:
        x = np.asarray(by[name], dtype=np.float64)
        mean = float(x.mean())
        rows.append(dict(variant=name, seeds=len(x), mean=mean, std=float(x.std()), min=float(x.min()),
                         max=float(x.max()), vs_ref=(mean / ref - 1.0) if ref else None))
    return rows


def overlap_by_variant(base: Config, variants: Sequence[Variant], *, overrides: Sequence[str] = (),
                       program: str = "forward", batch: Optional[int] = None, seq: Optional[int] = None,
                       hardware: Optional[str] = "mi300x", target: str = "h100_sxm",
                       log: Callable[[str], None] = lambda m: print(m, flush=True)) -> dict[str, dict]:
    """{variant: totals} of the overlap report of each variant's deviceless 8-GPU compile.

    overrides: dotted `key=value` strings applied to every variant (e.g. a larger d_model / seq to model
    a realistic shape, `runtime.dispatch=all_to_all mesh.expert=8`). Each entry: exposed_frac (exposed
    all-to-all time / all-to-all time), hidden_frac, bound_frac, step_time_us, count — from the two-stream
    cost model on `hardware` when given, else from XLA's own schedule."""
    out = {}
    for v in variants:
        cfg = v.apply(base)
        if overrides:
            cfg = from_dict(Config, apply_overrides(to_dict(cfg), list(overrides)))
        (res,) = run_overlap(cfg, (cfg.farskip.preset,), (program,), batch=batch, seq=seq, target=target,
                             hardware=hardware, log=log)
        rep = res.modelled if res.modelled is not None else res.report
        tot = rep.totals("all")
        out[v.name] = dict(exposed_frac=tot["exposed"] / tot["duration"] if tot["duration"] else 0.0,
                           hidden_frac=tot["hidden_frac"], bound_frac=tot["bound_frac"], count=tot["count"],
                           step_time_us=rep.step_time, model=rep.label)
    return out


@dataclasses.dataclass(frozen=True)
class PairedDifference:
    """Final validation loss of `variant` minus the reference's, over the seeds both ran (nats).

    ci: the two-sided `level` t-interval of the mean difference; detectable: the smallest true
    difference a paired t-test on this many pairs with this spread finds with probability `power`
    at that level, (t_{1-a/2, n-1} + t_{power, n-1}) x sd / sqrt(n); rel_*: as fractions of the
    reference's mean loss. With one pair sd, ci and detectable are nan."""
    variant: str
    reference: str
    seeds: tuple
    diffs: tuple
    mean: float
    sd: float
    ci: tuple
    detectable: float
    reference_mean: float
    level: float = 0.95
    power: float = 0.8

    @property
    def n(self) -> int:
        return len(self.diffs)

    @property
    def rel_mean(self) -> float:
        return self.mean / self.reference_mean

    @property
    def rel_detectable(self) -> float:
        return self.detectable / self.reference_mean

    @property
    def resolved(self) -> bool:
        """The interval excludes 0 (the sign of the difference is resolved at `level`)."""
        return self.n > 1 and (self.ci[0] > 0 or self.ci[1] < 0)


def paired_differences(records: Sequence[RunRecord], reference: str = "standard", level: float = 0.95,
                       power: float = 0.8) -> list[PairedDifference]:
    """One PairedDifference per variant other than `reference` (first-seen order), over the seeds that
    both ran. ConfigError when no record is the reference or a variant shares no seed with it."""
    if not 0 < level < 1 or not 0 < power < 1:
        raise ConfigError(f"level={level} and power={power} must be probabilities in (0, 1)")
    by: dict = {}
    for r in records:
        by.setdefault(r.variant, {})[r.seed] = r.final_val_loss
    if reference not in by:
        raise ConfigError(f"no run of the reference variant {reference!r} among {sorted(by)}: paired differences "
                          f"need it run with the same seeds")
    ref = by[reference]
    out = []
    for name, runs in by.items():
        if name == reference:
            continue
        seeds = tuple(sorted(set(runs) & set(ref)))
        if not seeds:
            raise ConfigError(f"variant {name!r} ran seeds {sorted(runs)}, {reference!r} ran {sorted(ref)}: no pair; "
                              "run both with the same seeds")
        d = np.array([runs[s] - ref[s] for s in seeds], dtype=np.float64)
        n, mean = len(d), float(d.mean())
        nan = float("nan")
        if n > 1:
            sd = float(d.std(ddof=1))
            half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
            ci = (mean - half, mean + half)
            detectable = (float(stats.t.ppf(0.5 + level / 2, n - 1)) + float(stats.t.ppf(power, n - 1))) * sd / math.sqrt(n)
        else:
            sd, ci, detectable = nan, (nan, nan), nan
        out.append(PairedDifference(variant=name, reference=reference, seeds=seeds, diffs=tuple(float(x) for x in d),
                                    mean=mean, sd=sd, ci=ci, detectable=detectable,
                                    reference_mean=float(np.mean([ref[s] for s in seeds])), level=level, power=power))
    return out

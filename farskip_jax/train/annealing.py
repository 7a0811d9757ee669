"""FCSD conversion methods: connectivity annealing and progressive conversion (docs/fcsd.md,
"Conversion methods"; issue 25).

Both set alpha, a per-layer mixing coefficient in [0, 1] that the student runs as
`Transformer(..., connectivity_mix=alpha)`: each converted sub-block reads its FarSkip stream plus
(1 - alpha) times what FarSkip removes from it (alpha 0 = the teacher's standard connectivity,
alpha 1 = FarSkip). alpha is a traced input of the jitted step, so no schedule change recompiles.

    sched = ConversionSchedule.from_config(cfg, tokens_per_step, max_steps)   # None: plain FCSD
    events = sched.advance_to(step)          # stage starts by distill.stage_tokens up to `step`
    alpha = sched.alpha(step)                # [num_layers] float32: the update step -> step + 1 trains at it
    if sched.needs_stage_kl(step): event = sched.observe(step, val_kl_at_alpha)   # at an evaluation
    sched.counts(step)                       # does an evaluation at `step` count for early stopping

Timeline: `step` counts finished updates; update s + 1 trains at alpha(s). The converted layers
(those `farskip` does not leave at full/full) form stages: one stage of all of them (annealing
alone), or one layer per stage, last layer first (`distill.progressive`). Stage i starts at step
s_i (stage 0 at 0); its layers' alpha is ramp((s + 1 - s_i) / R) with R = ceil(anneal_tokens /
tokens_per_step) updates (linear: u; cosine: (1 - cos(pi u)) / 2): the R updates of the ramp train
at 1/R, 2/R, ..., 1 (linear), never at exactly 0 (the teacher itself, a zero gradient). With
`distill.anneal: none` alpha steps 0 -> 1 at s_i. Layers of stages not started have alpha 0
(the student starts as the teacher); unconverted layers 1 (ignored by the model).

Stage i trains at its final alpha from update F_i + 1 on, F_i = s_i + max(R - 1, 0). Progressive
stage i + 1 starts at the first of
  * settled: an evaluation at step e > F_i (the last update trained at the stage's final alpha)
    whose val KL of the student at that alpha improved by less than `distill.settle_rel` (relative)
    on the previous such evaluation of the same stage; the stage starts at e;
  * the cap: s_i + ceil(stage_tokens / tokens_per_step).
The conversion is complete at C = F_last (every converted layer at alpha 1 from update C + 1 on);
an evaluation at step e counts for early stopping when e > C.

Resume: the starts set by the settle rule and the stage KLs are saved (`state_dict`, in
early_stopping.json) and restored up to the checkpoint's step; the capped starts are a pure
function of the earlier start, so alpha(s) of a resumed run equals the straight run's.

`GatedStopper`: the early stopper of a run with a schedule. Every evaluation measures the true
FarSkip student (alpha = 1) and may become the kept best; only evaluations that count (after the
conversion completed) can add to `patience` or trigger `max_drop`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import numpy as np

from farskip_jax.config import Config
from farskip_jax.errors import ConfigError
from farskip_jax.train.early_stopping import Decision, EarlyStopper


def converted_layers(cfg: Config) -> list[int]:
    """Layers whose connectivity `cfg.farskip` changes (not full/full), in layer order."""
    n = cfg.model.num_layers
    return [i for i in range(n) if cfg.farskip.layer_inputs(i, n) != ("full", "full")]


def ramp(u: float, shape: str) -> float:
    """alpha of a ramp at progress u in [0, 1]: linear u, cosine (1 - cos(pi u)) / 2."""
    u = min(max(u, 0.0), 1.0)
    return u if shape == "linear" else 0.5 * (1.0 - math.cos(math.pi * u))


@dataclasses.dataclass
class ConversionSchedule:
    num_layers: int
    stages: tuple  # layers of each stage, in stage order
    shape: str  # none | linear | cosine
    ramp_steps: int  # R (0 with shape none)
    stage_steps: Optional[int]  # cap of a stage in steps (progressive)
    settle_rel: float
    progressive: bool
    starts: list = dataclasses.field(default_factory=lambda: [0])
    causes: list = dataclasses.field(default_factory=lambda: ["start"])
    stage_kls: list = dataclasses.field(default_factory=list)  # [[step, stage, kl]]

    @classmethod
    def from_config(cls, cfg: Config, tokens_per_step: int, max_steps: int) -> Optional["ConversionSchedule"]:
        """The schedule of `cfg.distill` (None without annealing or progressive conversion); validates
        it against the model (cfg carries the checkpoint's shape) and the run's length."""
        d = cfg.distill
        if d.anneal == "none" and not d.progressive:
            return None
        what = f"distill.anneal={d.anneal}" + (" with distill.progressive: true" if d.progressive else "")
        if cfg.moe.num_groups > 1:
            raise ConfigError(f"{what}: connectivity annealing is not implemented for Federation of Experts "
                              "(moe.num_groups > 1); set distill.anneal: none and distill.progressive: false")
        conv = converted_layers(cfg)
        if not conv:
            raise ConfigError(f"{what} needs converted layers, but farskip (preset {cfg.farskip.preset!r}, layers "
                              f"{cfg.farskip.layers!r}) converts none of the {cfg.model.num_layers} layers; set "
                              "farskip.preset: farskip (and farskip.layers), or distill.anneal: none and "
                              "distill.progressive: false")
        r = 0 if d.anneal == "none" else -(-d.anneal_tokens // tokens_per_step)
        cap = None if d.stage_tokens is None else -(-d.stage_tokens // tokens_per_step)
        stages = tuple((i,) for i in reversed(conv)) if d.progressive else (tuple(conv),)
        tail = max(r - 1, 0)  # F_i - s_i
        worst = tail + (len(stages) - 1) * cap if cap is not None else tail if len(stages) == 1 else None
        if worst is not None and worst >= max_steps:
            key = "distill.anneal_tokens" if len(stages) == 1 else "distill.stage_tokens / distill.anneal_tokens"
            raise ConfigError(
                f"{what}: the conversion completes only after {worst + 1} steps ({(worst + 1) * tokens_per_step:,} "
                f"tokens) but the run stops at step {max_steps} (train.steps / distill.max_tokens); alpha would not "
                f"reach 1 on every converted layer with time left to train the FarSkip student itself: lower {key}")
        return cls(num_layers=cfg.model.num_layers, stages=stages, shape=d.anneal, ramp_steps=r, stage_steps=cap,
                   settle_rel=d.settle_rel, progressive=d.progressive)

    # ---- the timeline ----------------------------------------------------------------------------

    @property
    def converted(self) -> list[int]:
        return [i for st in self.stages for i in st]

    def advance_to(self, step: int) -> list[str]:
        """Start every stage whose cap ends at or before `step`; one message per stage started."""
        out = []
        while self.stage_steps is not None and len(self.starts) < len(self.stages) \
                and step >= self.starts[-1] + self.stage_steps:
            self.starts.append(self.starts[-1] + self.stage_steps)
            self.causes.append("stage_tokens")
            out.append(self.describe_start(len(self.starts) - 1))
        return out

    def describe_start(self, i: int) -> str:
        return (f"conversion stage {i + 1}/{len(self.stages)} (layer {', '.join(map(str, self.stages[i]))}) starts at "
                f"step {self.starts[i]} ({self.causes[i]})")

    def stage_at(self, step: int) -> int:
        """Index of the stage the update step -> step + 1 belongs to."""
        return sum(1 for s in self.starts if s <= step) - 1

    def alpha(self, step: int) -> np.ndarray:
        """[num_layers] float32 alpha of the update step -> step + 1 (unconverted layers: 1)."""
        a = np.ones(self.num_layers, np.float32)
        for i, layers in enumerate(self.stages):
            if i >= len(self.starts) or step < self.starts[i]:
                v = 0.0
            elif self.ramp_steps == 0:
                v = 1.0
            else:
                v = ramp((step + 1 - self.starts[i]) / self.ramp_steps, self.shape)
            a[list(layers)] = v
        return a

    def mean_alpha(self, step: int) -> float:
        return float(np.mean(self.alpha(step)[self.converted]))

    def final_from(self, i: int) -> int:
        """F_i: stage i (started) trains at its final alpha from update F_i + 1 on."""
        return self.starts[i] + max(self.ramp_steps - 1, 0)

    @property
    def complete_step(self) -> Optional[int]:
        """C: from update C + 1 on every converted layer trains at alpha 1 (None: not yet known)."""
        if len(self.starts) < len(self.stages):
            return None
        return self.final_from(len(self.starts) - 1)

    def counts(self, step: int) -> bool:
        """Whether an evaluation at `step` counts for early stopping (the conversion had completed)."""
        c = self.complete_step
        return c is not None and step > c

    def needs_stage_kl(self, step: int) -> bool:
        """Progressive, a next stage to start, and the current stage's ramp done by the update that
        ended at `step`: an evaluation there measures the stage's val KL (`observe`)."""
        return self.progressive and len(self.starts) < len(self.stages) and step > self.final_from(self.stage_at(step))

    def observe(self, step: int, kl: float) -> Optional[str]:
        """Record the stage's val KL at an evaluation; start the next stage at `step` when it settled."""
        i = self.stage_at(step)
        prev = [k for s, st, k in self.stage_kls if st == i and s < step]
        self.stage_kls.append([int(step), i, float(kl)])
        if not prev or len(self.starts) >= len(self.stages):
            return None
        rel = (prev[-1] - kl) / max(abs(prev[-1]), 1e-12)
        if not rel < self.settle_rel:
            return None
        self.starts.append(int(step))
        self.causes.append(f"settled: stage KL {prev[-1]:.5g} -> {kl:.5g}, {100 * rel:.2f}% < "
                           f"settle_rel {100 * self.settle_rel:.2f}%")
        return self.describe_start(len(self.starts) - 1)

    # ---- resume --------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return dict(starts=list(self.starts), causes=list(self.causes), stage_kls=[list(x) for x in self.stage_kls])

    def load_state_dict(self, d: dict, upto: int) -> None:
        """Restore the starts and stage KLs up to step `upto` (the checkpoint's); later ones are re-decided
        by the resumed run, which repeats the same evaluations."""
        starts, causes = d.get("starts") or [0], d.get("causes") or ["start"]
        keep = [j for j, s in enumerate(starts) if s <= upto] or [0]
        self.starts = [int(starts[j]) for j in keep]
        self.causes = [causes[j] if j < len(causes) else "start" for j in keep]
        self.stage_kls = [list(x) for x in d.get("stage_kls", []) if x[0] <= upto]
        self.advance_to(upto)


class GatedStopper(EarlyStopper):
    """EarlyStopper whose patience and max_drop see only the evaluations `counts(step)` accepts; the
    others (during conversion) are recorded and may become the best, never stop the run."""

    def __init__(self, mode: str, patience: int, max_drop: float, counts: Callable[[int], bool]):
        super().__init__(mode, patience, max_drop)
        self.counts = counts

    def update(self, step: int, value: float) -> Decision:
        if self.counts(step):
            return super().update(step, value)
        value = float(value)
        self.history.append((int(step), value))
        better = self.best is None or (value < self.best - self.min_delta if self.mode == "min"
                                       else value > self.best + self.min_delta)
        if math.isfinite(value) and better:
            self.best, self.best_step = value, int(step)
            return Decision(improved=True, stop=False)
        return Decision(improved=False, stop=False)

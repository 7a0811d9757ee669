"""Early stopping on a validation metric (the paper's FCSD recipe: evaluate every 1000 steps, keep the
best checkpoint, stop after `patience` evaluations without improvement or when the metric falls more
than `max_drop` (relative) behind the best one).

    es = EarlyStopper(mode="min", patience=20, max_drop=0.02)
    for step, value in evaluations:
        d = es.update(step, value)      # Decision(improved, stop, reason)
        if d.improved: save_best(step)
        if d.stop: break

mode "min" for losses/KL (worse = larger), "max" for task accuracy (worse = smaller). The drop of a
value v from the best b is (v - b) / |b| in mode min and (b - v) / |b| in mode max; `max_drop <= 0`
turns the drop rule off. A non-finite value counts as a drop beyond any threshold.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Optional


@dataclasses.dataclass(frozen=True)
class Decision:
    improved: bool
    stop: bool
    reason: str = ""


class EarlyStopper:
    def __init__(self, mode: Literal["min", "max"] = "min", patience: int = 20, max_drop: float = 0.02,
                 min_delta: float = 0.0):
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        self.mode, self.patience, self.max_drop, self.min_delta = mode, patience, max_drop, min_delta
        self.best: Optional[float] = None
        self.best_step: Optional[int] = None
        self.bad_evals = 0
        self.history: list[tuple[int, float]] = []

    def _better(self, v: float, b: float) -> bool:
        return v < b - self.min_delta if self.mode == "min" else v > b + self.min_delta

    def drop(self, v: float) -> float:
        """Relative degradation of `v` from the best value (0 when no best yet or v is better)."""
        if self.best is None:
            return 0.0
        if not math.isfinite(v):
            return math.inf
        diff = (v - self.best) if self.mode == "min" else (self.best - v)
        return max(diff, 0.0) / max(abs(self.best), 1e-12)

    def update(self, step: int, value: float) -> Decision:
        value = float(value)
        self.history.append((int(step), value))
        if math.isfinite(value) and (self.best is None or self._better(value, self.best)):
            self.best, self.best_step, self.bad_evals = value, int(step), 0
            return Decision(improved=True, stop=False)
        self.bad_evals += 1
        d = self.drop(value)
        if self.max_drop > 0 and d > self.max_drop:
            return Decision(False, True, f"metric {value:.6g} is {100 * d:.2f}% worse than the best {self.best:.6g} "
                                         f"(step {self.best_step}); max_drop={100 * self.max_drop:.2f}%")
        if self.bad_evals >= self.patience:
            return Decision(False, True, f"no improvement in {self.bad_evals} evaluations (patience {self.patience}); "
                                         f"best {self.best:.6g} at step {self.best_step}")
        return Decision(False, False)

    def state_dict(self) -> dict:
        return dict(best=self.best, best_step=self.best_step, bad_evals=self.bad_evals, history=self.history)

    def forget_best(self) -> None:
        """No best value (history and the count of evaluations without improvement stay): the next
        finite evaluation becomes the best; used when the best's weights are no longer kept."""
        self.best, self.best_step = None, None

    def load_state_dict(self, d: dict, upto: Optional[int] = None) -> None:
        """Restore a state_dict by replaying its history (best, best_step and bad_evals follow from
        it); with `upto`, only the evaluations up to that step: a resume from an older checkpoint
        then re-runs the later evaluations without counting them twice against the patience."""
        self.best, self.best_step, self.bad_evals, self.history = None, None, 0, []
        for step, value in d["history"]:
            if upto is None or step <= upto:
                self.update(step, value)

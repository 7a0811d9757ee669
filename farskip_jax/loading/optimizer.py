"""Optimizer: AdamW with linear warmup + cosine decay, global-norm clipping, no decay on vectors.

    tx, schedule = make_optimizer(cfg.train)
    lr_at_step = schedule(step)
"""

from __future__ import annotations

import dataclasses

import jax
import optax

from farskip_jax.config import TrainConfig


def make_schedule(t: TrainConfig) -> optax.Schedule:
    """0 -> lr over `warmup_steps`, then cosine to lr * min_lr_ratio at `steps`."""
    warmup = min(t.warmup_steps, max(t.steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=t.lr, warmup_steps=warmup, decay_steps=max(t.steps, warmup + 1),
        end_value=t.lr * t.min_lr_ratio)


def _decay_mask(params):
    """Weight decay on matrices only (norm scales, biases and other vectors are not decayed)."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(t: TrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = make_schedule(t)
    parts = []
    if t.grad_clip and t.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(t.grad_clip))
    parts.append(optax.adamw(schedule, b1=t.b1, b2=t.b2, eps=1e-8, weight_decay=t.weight_decay, mask=_decay_mask))
    return optax.chain(*parts), schedule


def schedule_change_warning(old_steps: int, t: TrainConfig, step: int) -> str:
    """One line: the warmup + cosine schedule is a function of train.steps, so a resume with another
    total follows the new curve from `step` on (the learning rate jumps to the new curve's value)."""
    old_lr = float(make_schedule(dataclasses.replace(t, steps=old_steps))(step))
    new_lr = float(make_schedule(t)(step))
    return (f"WARNING: train.steps changed from {old_steps} (saved run) to {t.steps}: the warmup + cosine "
            f"learning-rate schedule is re-stretched to {t.steps} steps and followed from resume step {step} "
            f"on (lr there {old_lr:.3g} -> {new_lr:.3g}); keep train.steps={old_steps} to continue the "
            f"original curve")

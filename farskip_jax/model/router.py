"""Token-choice router: scores, (group-limited) top-k selection, weights, balance losses.

    RouteResult = Router(x: [batch, seq, d_model])
      indices [b, s, k] int32    selected experts (by score + selection bias)
      weights [b, s, k] float32  unbiased scores of the selected experts, optionally normalised,
                                 times routed_scaling_factor
      aux_loss, z_loss []        load-balance loss E * sum_i f_i P_i and mean logsumexp(logits)^2
      load [E]                   fraction of the b*s*k assignments each expert received (f)
      importance [E]             mean router probability of each expert over the tokens (P)

Aux-loss-free balancing (DeepSeek-V3): `selection_bias` adds a non-trained bias [E] (a `RouterBias`
variable, updated by the trainer from `load`, never by the optimizer) to the scores used for selection
only; the weights stay unbiased.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx, struct

from farskip_jax.config import MoEConfig
from farskip_jax.model.layers import matmul_2d, normal_init


class RouterBias(nnx.Variable):
    """Selection bias of aux-loss-free routing; not a Param, so optimizers never touch it."""


@struct.dataclass
class RouteResult:
    indices: jax.Array
    weights: jax.Array
    aux_loss: jax.Array
    z_loss: jax.Array
    load: jax.Array
    importance: Optional[jax.Array] = None


def balance_loss(load: jax.Array, importance: jax.Array, num_groups: int = 1) -> jax.Array:
    """Load-balance loss from the expert load f [E] (fraction of all assignments) and importance P
    (mean router probability, [E], or [H, E/H] per group for num_groups H > 1): E * sum_i f_i P_i,
    gradient through P only; per group (E/H) * sum over the group's experts of f_i * H * P_i (f_i * H:
    the fraction of the group's own assignments), averaged over groups. Pooling the f and P of equal
    micro-batches (means) gives the loss of the whole batch."""
    e = load.shape[-1]
    if num_groups == 1:
        return e * jnp.sum(jax.lax.stop_gradient(load) * importance, axis=-1)
    frac = load.reshape(num_groups, e // num_groups) * num_groups
    return jnp.mean(e // num_groups * jnp.sum(jax.lax.stop_gradient(frac) * importance, axis=-1))


def select_experts(scores: jax.Array, sel: jax.Array, cfg: MoEConfig, k: int | None = None) -> jax.Array:
    """Top-k (k default cfg.top_k) expert indices [..., k] from selection scores `sel` [..., E]
    (group-limited if n_group > 1)."""
    if cfg.n_group > 1:
        e = sel.shape[-1]
        grouped = sel.reshape(*sel.shape[:-1], cfg.n_group, e // cfg.n_group)
        if cfg.group_score == "top2_sum":
            group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)
        else:
            group_scores = grouped.max(-1)
        _, top_groups = jax.lax.top_k(group_scores, cfg.topk_group)
        keep = jnp.any(jax.nn.one_hot(top_groups, cfg.n_group, dtype=bool), axis=-2)  # [..., n_group]
        mask = jnp.repeat(keep, e // cfg.n_group, axis=-1)
        sel = jnp.where(mask, sel, -jnp.inf)
    return jax.lax.top_k(sel, cfg.top_k if k is None else k)[1].astype(jnp.int32)


class Router(nnx.Module):
    """Linear router [d_model, E] in float32 with softmax or sigmoid scoring.

    num_groups = H > 1 (Federation of Experts, model/foe.py): the experts form H contiguous groups of
    E/H; each group's scores are normalised over its own experts (softmax per group) and it picks
    top_k/H of them, weights normalised within the group (norm_topk_prob); choices [h*k/H, (h+1)*k/H)
    of `indices` are group h's (global expert ids). aux / z losses are taken per group and averaged.
    H = 1 is the ordinary router (no group axis is traced)."""

    def __init__(self, d_model: int, cfg: MoEConfig, *, rngs: nnx.Rngs, std: float = 0.02, num_experts: int | None = None):
        self.cfg = cfg
        e = num_experts or cfg.num_experts
        self.w = nnx.Param(normal_init(rngs, (d_model, e), std, jnp.float32), axes=("embed", None))
        self.bias = RouterBias(jnp.zeros((e,), jnp.float32), axes=(None,)) if cfg.selection_bias else None

    def __call__(self, x: jax.Array, num_groups: int = 1) -> RouteResult:
        """x: [b, s, d] -> RouteResult (module docstring)."""
        cfg, h = self.cfg, num_groups
        logits = matmul_2d(x.astype(jnp.float32), self.w[...])
        b, s, e = logits.shape
        eg, kg = e // h, cfg.top_k // h
        lg = logits if h == 1 else logits.reshape(b, s, h, eg)  # [b, s, (H,) E/H]
        scores = jax.nn.softmax(lg, -1) if cfg.scoring == "softmax" else jax.nn.sigmoid(lg)
        if self.bias is None:
            sel = scores
        else:
            sel = scores + (self.bias[...] if h == 1 else self.bias[...].reshape(h, eg))
        idx = select_experts(scores, jax.lax.stop_gradient(sel), cfg, kg)
        w = jnp.take_along_axis(scores, idx, axis=-1)
        if cfg.norm_topk_prob:
            w = w / (w.sum(-1, keepdims=True) + 1e-20)
        w = w * cfg.routed_scaling_factor
        if h > 1:  # group-local ids -> global ids, groups' choices concatenated
            idx = (idx + (jnp.arange(h, dtype=jnp.int32) * eg)[:, None]).reshape(b, s, h * kg)
            w = w.reshape(b, s, h * kg)
        counts = jnp.sum(jax.nn.one_hot(idx, e, dtype=jnp.float32), axis=(0, 1, 2))
        load = counts / idx.size
        probs = scores / (scores.sum(-1, keepdims=True) if cfg.scoring == "sigmoid" else 1.0)
        importance = probs.mean(axis=(0, 1))  # [(H,) E/H]
        aux = balance_loss(load, importance, h)
        z = jnp.mean(jax.nn.logsumexp(lg, axis=-1) ** 2)
        return RouteResult(indices=idx, weights=w, aux_loss=aux, z_loss=z, load=load, importance=importance)

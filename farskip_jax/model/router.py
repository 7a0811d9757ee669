"""Token-choice router: scores, (group-limited) top-k selection, weights, balance losses.

    RouteResult = Router(x: [batch, seq, d_model])
      indices [b, s, k] int32    selected experts (by score + selection bias)
      weights [b, s, k] float32  unbiased scores of the selected experts, optionally normalised,
                                 times routed_scaling_factor
      aux_loss, z_loss []        load-balance loss E * sum_i f_i P_i and mean logsumexp(logits)^2
      load [E]                   fraction of the b*s*k assignments each expert received

Aux-loss-free balancing (DeepSeek-V3): `selection_bias` adds a non-trained bias [E] (a `RouterBias`
variable, updated by the trainer from `load`, never by the optimizer) to the scores used for selection
only; the weights stay unbiased.
"""

from __future__ import annotations

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


def select_experts(scores: jax.Array, sel: jax.Array, cfg: MoEConfig) -> jax.Array:
    """Top-k expert indices [..., k] from selection scores `sel` [..., E] (group-limited if n_group>1)."""
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
    return jax.lax.top_k(sel, cfg.top_k)[1].astype(jnp.int32)


class Router(nnx.Module):
    """Linear router [d_model, E] in float32 with softmax or sigmoid scoring."""

    def __init__(self, d_model: int, cfg: MoEConfig, *, rngs: nnx.Rngs, std: float = 0.02, num_experts: int | None = None):
        self.cfg = cfg
        e = num_experts or cfg.num_experts
        self.w = nnx.Param(normal_init(rngs, (d_model, e), std, jnp.float32), axes=("embed", None))
        self.bias = RouterBias(jnp.zeros((e,), jnp.float32), axes=(None,)) if cfg.selection_bias else None

    def __call__(self, x: jax.Array) -> RouteResult:
        cfg = self.cfg
        logits = matmul_2d(x.astype(jnp.float32), self.w[...])
        scores = jax.nn.softmax(logits, -1) if cfg.scoring == "softmax" else jax.nn.sigmoid(logits)
        sel = scores + self.bias[...] if self.bias is not None else scores
        idx = select_experts(scores, jax.lax.stop_gradient(sel), cfg)
        w = jnp.take_along_axis(scores, idx, axis=-1)
        if cfg.norm_topk_prob:
            w = w / (w.sum(-1, keepdims=True) + 1e-20)
        w = w * cfg.routed_scaling_factor
        e = scores.shape[-1]
        counts = jnp.sum(jax.nn.one_hot(idx, e, dtype=jnp.float32), axis=(0, 1, 2))
        load = counts / idx.size
        probs = scores / (scores.sum(-1, keepdims=True) if cfg.scoring == "sigmoid" else 1.0)
        aux = e * jnp.sum(jax.lax.stop_gradient(load) * probs.mean(axis=(0, 1)))
        z = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
        return RouteResult(indices=idx, weights=w, aux_loss=aux, z_loss=z, load=load)

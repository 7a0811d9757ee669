"""Token-level distances between a teacher's and a student's next-token distributions.

All inputs are logits [batch, seq, vocab] (any float dtype; math in float32) and a mask [batch, seq]
of tokens that count (1 = real token, 0 = padding). Per-token results are [batch, seq].

    forward KL   KL(p_t || p_s) = sum_v p_t (log p_t - log p_s)     (mode covering, FCSD default)
    reverse KL   KL(p_s || p_t) = sum_v p_s (log p_s - log p_t)     (mode seeking)
    temperature  both distributions are softmax(logits / T); the loss is multiplied by T^2 so its
                 gradient scale does not depend on T (Hinton et al.)
    top-k        forward KL against the teacher's k most likely tokens only, renormalised over them:
                 sum_{v in topk} q_t(v) (log q_t(v) - log p_s(v)) with p_s the student's FULL softmax
                 (>= 0 because sum_{topk} p_s <= 1); what a cached top-k teacher can provide.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _logp(logits: jax.Array, temperature: float) -> jax.Array:
    return jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)


def forward_kl(t_logits: jax.Array, s_logits: jax.Array, temperature: float = 1.0) -> jax.Array:
    """KL(teacher || student) per token: [b, s]."""
    lt, ls = _logp(t_logits, temperature), _logp(s_logits, temperature)
    return jnp.sum(jnp.exp(lt) * (lt - ls), axis=-1)


def reverse_kl(t_logits: jax.Array, s_logits: jax.Array, temperature: float = 1.0) -> jax.Array:
    """KL(student || teacher) per token: [b, s]."""
    return forward_kl(s_logits, t_logits, temperature)


def topk_forward_kl(t_logits: jax.Array, s_logits: jax.Array, k: int, temperature: float = 1.0) -> jax.Array:
    """Forward KL against the teacher's top-k tokens (renormalised): [b, s]."""
    t = t_logits.astype(jnp.float32) / temperature
    top_vals, top_idx = jax.lax.top_k(t, k)
    lq = jax.nn.log_softmax(top_vals, axis=-1)
    ls = jnp.take_along_axis(_logp(s_logits, temperature), top_idx, axis=-1)
    return jnp.sum(jnp.exp(lq) * (lq - ls), axis=-1)


def token_divergence(t_logits: jax.Array, s_logits: jax.Array, *, kind: str = "forward", temperature: float = 1.0,
                     top_k: int = 0) -> jax.Array:
    """Per-token divergence [b, s] of `kind` forward | reverse | both (sum of the two), times T^2."""
    if kind not in ("forward", "reverse", "both"):
        raise ValueError(f"unknown KL kind {kind!r}")
    out = jnp.zeros(t_logits.shape[:-1], jnp.float32)
    if kind in ("forward", "both"):
        out = out + (topk_forward_kl(t_logits, s_logits, top_k, temperature) if top_k
                     else forward_kl(t_logits, s_logits, temperature))
    if kind in ("reverse", "both"):
        out = out + reverse_kl(t_logits, s_logits, temperature)
    return out * (temperature ** 2)


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of x [b, s] over mask [b, s] (0 when the mask is empty)."""
    m = mask.astype(jnp.float32)
    return jnp.sum(x * m) / jnp.maximum(jnp.sum(m), 1.0)


def top1_agreement(t_logits: jax.Array, s_logits: jax.Array) -> jax.Array:
    """1.0 where teacher and student agree on the most likely next token: [b, s] float32."""
    return (jnp.argmax(t_logits, -1) == jnp.argmax(s_logits, -1)).astype(jnp.float32)


def hidden_l2(t_hidden: tuple, s_hidden: tuple, mask: jax.Array) -> jax.Array:
    """Mean over layers and masked tokens of ||h_s - h_t||^2 / d_model (per-layer full streams [b, s, d])."""
    per = [masked_mean(jnp.mean(jnp.square(s.astype(jnp.float32) - t.astype(jnp.float32)), -1), mask)
           for t, s in zip(t_hidden, s_hidden)]
    return jnp.mean(jnp.stack(per))

"""Token-level distances between a teacher's and a student's next-token distributions.

All inputs are logits [batch, seq, vocab] (any float dtype; math in float32) and a mask [batch, seq]
of tokens that count (1 = real token, 0 = padding). Per-token results are [batch, seq].

    forward KL   KL(p_t || p_s) = sum_v p_t (log p_t - log p_s)     (mode covering, FCSD default)
    reverse KL   KL(p_s || p_t) = sum_v p_s (log p_s - log p_t)     (mode seeking)
    temperature  both distributions are softmax(logits / T); the loss is multiplied by T^2 so its
                 gradient scale does not depend on T (Hinton et al.)
    top-k        forward KL over k + 1 categories: the teacher's k most likely tokens plus one tail
                 bucket holding the rest of the mass, for both distributions (p = the FULL softmax):
                 sum_{v in topk_t} p_t(v) (log p_t(v) - log p_s(v)) + T_t (log T_t - log T_s),
                 T = 1 - sum_{topk_t} p. What a cached top-k teacher (top-k log-probs of its full softmax)
                 can provide; 0 <= it <= the full forward KL (a coarsening), = it when k = vocab.
                 (Before, the teacher's top-k was renormalised over the k tokens against the student's
                 full log-probs, which pushed all the student's mass onto them.)
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


def _tail_logsumexp(x: jax.Array, in_top: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(log sum_{v not in_top} exp(x_v), nonempty) over the last axis: [...], [...] bool. Exact (no
    1 - sum cancellation); -inf where the complement is empty or all -inf, with finite gradients."""
    xs = jnp.where(in_top, -jnp.inf, x)
    m = jnp.max(xs, axis=-1)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    tot = jnp.sum(jnp.exp(xs - m[..., None]), axis=-1)  # >= 1 when some x_v is finite
    nonempty = tot > 0
    return jnp.where(nonempty, m + jnp.log(jnp.where(nonempty, tot, 1.0)), -jnp.inf), nonempty


def topk_forward_kl(t_logits: jax.Array, s_logits: jax.Array, k: int, temperature: float = 1.0) -> jax.Array:
    """Forward KL over the teacher's top-k tokens plus one tail bucket (the rest of the mass): [b, s].
    k >= vocab is the full forward KL."""
    lt, ls = _logp(t_logits, temperature), _logp(s_logits, temperature)
    vocab = lt.shape[-1]
    k = min(int(k), vocab)
    top_lt, top_idx = jax.lax.top_k(lt, k)
    top_ls = jnp.take_along_axis(ls, top_idx, axis=-1)
    head = jnp.sum(jnp.exp(top_lt) * (top_lt - top_ls), axis=-1)
    # the teacher's top-k as a mask over the vocabulary (a scatter of the exact indices, so tied
    # logits at the k-th place are split the same way as top_k did)
    flat_idx = top_idx.reshape(-1, k)
    in_top = jax.vmap(lambda i: jnp.zeros((vocab,), bool).at[i].set(True))(flat_idx).reshape(lt.shape)
    tail_t, has_t = _tail_logsumexp(lt, in_top)
    tail_s, _ = _tail_logsumexp(ls, in_top)
    safe_t = jnp.where(has_t, tail_t, 0.0)  # keeps -inf (and 0 * -inf) out of the discarded branch
    tail = jnp.where(has_t, jnp.exp(safe_t) * (safe_t - tail_s), 0.0)
    return head + tail


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

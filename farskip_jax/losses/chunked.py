"""Cross entropy and the FCSD divergences from final streams and unembeddings, `chunk` positions at a time.

    w, transposed = model.unembed()                      # logits = final @ w, or final @ w.T (tied)
    out = model(tokens, positions, segment_ids, logits=False)
    ce, n = chunked_ce(out.final, (w, transposed), targets, mask, chunk=256, compute_dtype=jnp.bfloat16)
    kl, ce, n = chunked_fcsd(s_final, s_unembed, t_final, t_unembed, targets, mask, chunk=256, ...)

final [b, s, d]; targets [b, s] int; mask [b, s] (1 = token counts). The sequence is cut into
ceil(s / chunk) chunks of `chunk` positions (the last one padded with masked positions); each chunk's
logits [b, chunk, V] f32 = (final_c in compute_dtype) @ (w in compute_dtype), as the model's own
output layer computes them. Only one chunk's logits (and their gradient) are live at a time, in the
forward and in the backward: batch x chunk x V x 4 bytes instead of batch x s x V x 4 (1.6 GiB per
sequence of 4096 over a 102,400-token vocabulary, several such arrays in the loss and its gradient).
The batch axis is kept whole in every chunk, so a batch sharded over devices stays sharded.

Same values and gradients as the full-logit losses (losses/ce.token_ce, losses/divergence.token_divergence
+ masked_mean) up to float summation order:
  - chunked_ce: a custom VJP whose forward also computes the gradient of the mean cross entropy
    (d logits = mask / n * (softmax - onehot), per chunk, into d final [b, s, d] and d w), so the
    backward is a scale by the incoming cotangent: no logits are recomputed. Without differentiation
    only the loss is computed.
  - chunked_fcsd: each chunk's (KL sum, CE sum) under jax.checkpoint inside a lax.scan: the backward
    recomputes one chunk's teacher and student logits at a time and differentiates the exact
    per-token divergence of losses/divergence.py. The teacher gets no gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from farskip_jax.losses.ce import token_nll
from farskip_jax.losses.divergence import token_divergence
from farskip_jax.model.layers import matmul_2d


def num_chunks(seq: int, chunk: int) -> int:
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 positions, got {chunk}")
    return -(-seq // chunk)


def to_chunks(x: jax.Array, chunk: int) -> jax.Array:
    """[b, s, ...] -> [n, b, chunk, ...] (positions past s: zeros)."""
    b, s = x.shape[:2]
    n = num_chunks(s, chunk)
    if n * chunk != s:
        x = jnp.pad(x, [(0, 0), (0, n * chunk - s)] + [(0, 0)] * (x.ndim - 2))
    return jnp.swapaxes(x.reshape(b, n, chunk, *x.shape[2:]), 0, 1)


def from_chunks(y: jax.Array, seq: int) -> jax.Array:
    """[n, b, chunk, ...] -> [b, seq, ...]."""
    n, b, c = y.shape[:3]
    return jnp.swapaxes(y, 0, 1).reshape(b, n * c, *y.shape[3:])[:, :seq]


def chunk_logits(x: jax.Array, w_cd: jax.Array, transposed: bool) -> jax.Array:
    """[b, c, d] -> [b, c, V] f32: x rounded to w_cd's dtype (the compute dtype) @ w_cd ([d, V], or [V, d]
    with transposed)."""
    return matmul_2d(x.astype(w_cd.dtype), w_cd, transpose_w=transposed).astype(jnp.float32)


def _ce_chunk(x, t, m, w_cd, transposed, inv_n, want_grad):
    """One chunk: (sum of nll * m, d x [b, c, d] in x.dtype, d w f32) of the mean CE's share (inv_n =
    1 / max(n, 1)); the gradients only with want_grad."""
    logits = chunk_logits(x, w_cd, transposed)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
    nll_sum = jnp.sum((lse - picked) * m)
    if not want_grad:
        return nll_sum, None, None
    onehot = jnp.arange(logits.shape[-1], dtype=t.dtype) == t[..., None]
    g = (m * inv_n)[..., None]
    dl = ((jnp.exp(logits - lse[..., None]) - onehot.astype(jnp.float32)) * g).astype(w_cd.dtype)
    dx = matmul_2d(dl, w_cd, transpose_w=not transposed).astype(x.dtype)
    xf, dlf = x.astype(w_cd.dtype).reshape(-1, x.shape[-1]), dl.reshape(-1, dl.shape[-1])
    pair = (dlf, xf) if transposed else (xf, dlf)  # dw [V, d] (tied) or [d, V]
    dw = jax.lax.dot_general(*pair, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return nll_sum, dx, dw


def _ce_scan(x, w, targets, mask, transposed, chunk, compute_dtype, want_grad):
    w_cd = w.astype(compute_dtype)
    mask = mask.astype(jnp.float32)
    inv_n = 1.0 / jnp.maximum(jnp.sum(mask), 1.0)
    xs = (to_chunks(x, chunk), to_chunks(targets, chunk), to_chunks(mask, chunk))

    def body(dw_acc, c):
        nll_sum, dx, dw = _ce_chunk(*c, w_cd, transposed, inv_n, want_grad)
        if want_grad:
            return dw_acc + dw, (nll_sum, dx)
        return dw_acc, (nll_sum, None)

    dw0 = jnp.zeros(w.shape, jnp.float32) if want_grad else jnp.zeros((), jnp.float32)
    dw, (sums, dx) = jax.lax.scan(body, dw0, xs)
    ce = jnp.sum(sums) * inv_n
    if not want_grad:
        return ce, None
    return ce, (from_chunks(dx, x.shape[1]), dw.astype(w.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _ce(x, w, targets, mask, transposed, chunk, compute_dtype):
    return _ce_scan(x, w, targets, mask, transposed, chunk, compute_dtype, want_grad=False)[0]


def _ce_fwd(x, w, targets, mask, transposed, chunk, compute_dtype):
    ce, grads = _ce_scan(x, w, targets, mask, transposed, chunk, compute_dtype, want_grad=True)
    return ce, grads


def _ce_bwd(transposed, chunk, compute_dtype, grads, g):
    dx, dw = grads
    return (dx * g.astype(dx.dtype), dw * g.astype(dw.dtype), None, None)


_ce.defvjp(_ce_fwd, _ce_bwd)


def chunked_ce(final: jax.Array, unembed: tuple, targets: jax.Array, mask: jax.Array, *, chunk: int,
               compute_dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """Mean cross entropy over masked tokens of logits = final @ w, `chunk` positions at a time.

    final [b, s, d]; unembed = (w, transposed) of Transformer.unembed(); targets [b, s] int; mask
    [b, s]. -> (ce [], n_tokens []), as losses/ce.token_ce(logits, targets, mask). Differentiable
    in final and w (custom VJP, see the module docstring); not in targets or mask."""
    w, transposed = unembed
    n = jnp.sum(mask.astype(jnp.float32))
    num_chunks(final.shape[1], chunk)
    return _ce(final, w, targets, mask, bool(transposed), int(chunk), jnp.dtype(compute_dtype)), n


def chunked_fcsd(s_final: jax.Array, s_unembed: tuple, t_final: jax.Array, t_unembed: tuple, targets: jax.Array,
                 mask: jax.Array, *, chunk: int, kind: str = "forward", temperature: float = 1.0, top_k: int = 0,
                 compute_dtype=jnp.float32) -> tuple[jax.Array, jax.Array, jax.Array]:
    """FCSD's logit losses from the student's and the teacher's final streams, `chunk` positions at a time.

    s_final, t_final [b, s, d]; s_unembed, t_unembed = (w, transposed) of each model's unembed();
    targets [b, s] int; mask [b, s]. -> (kl [], ce [], n_tokens []) with
        kl = masked_mean(token_divergence(t_logits, s_logits, kind, temperature, top_k), mask)
        ce = token_ce(s_logits, targets, mask)
    as fcsd/distill.py computes them from full logits (losses/divergence.py: forward | reverse | both,
    T^2 scaling, top-k + tail). Gradients flow to s_final and the student's w only (the teacher's
    logits are stop_gradient, as in distillation)."""
    if kind not in ("forward", "reverse", "both"):
        raise ValueError(f"unknown KL kind {kind!r}")
    (ws, s_tr), (wt, t_tr) = s_unembed, t_unembed
    ws_cd = ws.astype(compute_dtype)
    wt_cd = jax.lax.stop_gradient(wt).astype(compute_dtype)
    mask = mask.astype(jnp.float32)
    n = jnp.sum(mask)
    num_chunks(s_final.shape[1], chunk)
    xs = (to_chunks(s_final, chunk), to_chunks(jax.lax.stop_gradient(t_final), chunk), to_chunks(targets, chunk),
          to_chunks(mask, chunk))

    @jax.checkpoint
    def sums(ws_cd, xs_c, xt_c, t_c, m_c):
        s_logits = chunk_logits(xs_c, ws_cd, bool(s_tr))
        t_logits = jax.lax.stop_gradient(chunk_logits(xt_c, wt_cd, bool(t_tr)))
        div = token_divergence(t_logits, s_logits, kind=kind, temperature=temperature, top_k=top_k)
        nll = token_nll(s_logits, t_c)
        return jnp.sum(div * m_c), jnp.sum(nll * m_c)

    def body(acc, c):
        kl_s, ce_s = sums(ws_cd, *c)
        return (acc[0] + kl_s, acc[1] + ce_s), None

    zero = jnp.zeros((), jnp.float32)
    (kl_sum, ce_sum), _ = jax.lax.scan(body, (zero, zero), xs)
    inv = 1.0 / jnp.maximum(n, 1.0)
    return kl_sum * inv, ce_sum * inv, n

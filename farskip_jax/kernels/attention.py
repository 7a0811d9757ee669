"""Attention cores: softmax(q k^T * scale) v over a boolean mask, in plain JAX, chosen by name.

    core_attention(impl, block, q [b, t, h, d], k [b, s, kv, d], v [b, s, kv, dv], mask [b, 1, t, s], scale)
        -> [b, t, h, dv]

`naive` (attention_core: one [t, s] score matrix, softmax in fp32), `blockwise` (flash-style online
softmax over `block`-token blocks, causal blocks skipped, a FlashAttention-2 VJP that recomputes the
scores) or `causal_blocks` (each query block against its key prefix: exact softmax, plain autodiff),
or a core registered in the op registry (kernels/ops.py: `fused_cpu`, the C++ CPU kernel of
kernels/cpu/ when the config enables it); `auto` is a registered core of the platform (`fused_cpu`
in a one-device CPU program) and `naive` otherwise. GQA: h query heads share kv = h / g key/value heads.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from farskip_jax.kernels import ops

NEG_INF = -1e30


def attention_core(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float) -> jax.Array:
    """q: [b, t, h, d], k/v: [b, s, kv, d(v)], mask: [b, 1, t, s] -> [b, t, h, dv] (softmax in fp32)."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, h // kv, d)
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    logits = jnp.where(mask[:, :, None], logits, NEG_INF)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, h, v.shape[-1])


def _spans(n: int, block: int) -> list[tuple[int, int]]:
    return [(i, min(i + block, n)) for i in range(0, n, block)]


def _causal_pairs(t: int, block: int):
    """(query span, [key spans]) with every key block that is not wholly after the query block."""
    return [((q0, q1), [(k0, k1) for k0, k1 in _spans(t, block) if k0 < q1]) for q0, q1 in _spans(t, block)]


def _block_scores(qb, kb, mask_b, scale):
    """qb: [b, tq, kv, g, d], kb: [b, tk, kv, d], mask_b: [b, 1, tq, tk] -> masked f32 [b, kv, g, tq, tk]."""
    sc = jnp.einsum("btkgd,bskd->bkgts", qb, kb, preferred_element_type=jnp.float32) * scale
    return jnp.where(mask_b[:, :, None], sc, NEG_INF)


def _flash_forward(q, k, v, mask, scale, block):
    """Online softmax over key blocks -> (o [b, t, h, dv] in v.dtype, lse f32 [b, kv, g, t])."""
    b, t, h, d = q.shape
    kvh, dv = k.shape[2], v.shape[-1]
    qg = q.reshape(b, t, kvh, h // kvh, d)
    outs, lses = [], []
    for (q0, q1), kspans in _causal_pairs(t, block):
        qb = qg[:, q0:q1]
        m = l = acc = None
        for k0, k1 in kspans:
            sc = _block_scores(qb, k[:, k0:k1], mask[:, :, q0:q1, k0:k1], scale)
            m_new = sc.max(-1) if m is None else jnp.maximum(m, sc.max(-1))
            p = jnp.exp(sc - m_new[..., None])
            pv = jnp.einsum("bkgts,bskd->bkgtd", p.astype(v.dtype), v[:, k0:k1], preferred_element_type=jnp.float32)
            if m is None:
                l, acc = p.sum(-1), pv
            else:
                corr = jnp.exp(m - m_new)
                l, acc = l * corr + p.sum(-1), acc * corr[..., None] + pv
            m = m_new
        outs.append(acc / l[..., None])
        lses.append(m + jnp.log(l))
    o = jnp.concatenate(outs, axis=3)  # [b, kv, g, t, dv]
    o = o.transpose(0, 3, 1, 2, 4).reshape(b, t, h, dv).astype(v.dtype)
    return o, jnp.concatenate(lses, axis=3)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _flash(q, k, v, mask, scale, block):
    return _flash_forward(q, k, v, mask, scale, block)[0]


def _flash_fwd(q, k, v, mask, scale, block):
    o, lse = _flash_forward(q, k, v, mask, scale, block)
    return o, (q, k, v, mask, o, lse)


def _flash_bwd(scale, block, res, do):
    """FlashAttention-2 backward: p = exp(s - lse) recomputed per block, ds = p * (dp - rowsum(do * o))."""
    q, k, v, mask, o, lse = res
    b, t, h, d = q.shape
    kvh, dv_dim = k.shape[2], v.shape[-1]
    g = h // kvh
    qg, dog = q.reshape(b, t, kvh, g, d), do.reshape(b, t, kvh, g, dv_dim)
    delta = jnp.sum(dog.astype(jnp.float32) * o.reshape(b, t, kvh, g, dv_dim).astype(jnp.float32), -1)
    delta = delta.transpose(0, 2, 3, 1)  # [b, kv, g, t]
    spans = _spans(t, block)
    dk = [None] * len(spans)
    dv = [None] * len(spans)
    dq = []
    add = lambda acc, x: x if acc is None else acc + x
    for (q0, q1), kspans in _causal_pairs(t, block):
        qb, dob = qg[:, q0:q1], dog[:, q0:q1]
        dq_i = None
        for j, (k0, k1) in enumerate(kspans):
            kb, vb = k[:, k0:k1], v[:, k0:k1]
            sc = _block_scores(qb, kb, mask[:, :, q0:q1, k0:k1], scale)
            p = jnp.exp(sc - lse[..., q0:q1, None])
            dv[j] = add(dv[j], jnp.einsum("bkgts,btkgd->bskd", p.astype(do.dtype), dob,
                                          preferred_element_type=jnp.float32))
            dp = jnp.einsum("btkgd,bskd->bkgts", dob, vb, preferred_element_type=jnp.float32)
            ds = p * (dp - delta[..., q0:q1, None]) * scale
            dq_i = add(dq_i, jnp.einsum("bkgts,bskd->btkgd", ds.astype(k.dtype), kb, preferred_element_type=jnp.float32))
            dk[j] = add(dk[j], jnp.einsum("bkgts,btkgd->bskd", ds.astype(q.dtype), qb, preferred_element_type=jnp.float32))
        dq.append(dq_i)
    dq = jnp.concatenate(dq, axis=1).reshape(b, t, h, d).astype(q.dtype)
    return dq, jnp.concatenate(dk, axis=1).astype(k.dtype), jnp.concatenate(dv, axis=1).astype(v.dtype), None


_flash.defvjp(_flash_fwd, _flash_bwd)


def blockwise_attention_core(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float,
                             block: int = 512) -> jax.Array:
    """attention_core computed flash-style: query x key blocks of `block` tokens, online softmax in fp32,
    key blocks wholly after a query block skipped, a custom VJP that recomputes the scores per block
    from the saved log-sum-exp (FlashAttention-2) instead of storing the [t, s] probabilities.

    q: [b, t, h, d], k/v: [b, t, kv, d(v)] (self-attention, same length), mask: [b, 1, t, t] ->
    [b, t, h, dv]. Equals attention_core when the mask never lets a query see a later index (causal
    by index, as every training/eval path builds it: positions increase within each document);
    skipping the blocks above the diagonal is what makes it cheaper (~(n+1)/2n of the score work
    for n blocks). The blocks are unrolled in Python, so XLA sees (and schedules) every block."""
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"blockwise attention needs self-attention (q len {q.shape[1]} != k len {k.shape[1]})")
    return _flash(q, k, v, mask, float(scale), int(block))


def causal_blocks_attention_core(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float,
                                 block: int = 512) -> jax.Array:
    """attention_core per query block of `block` tokens against its key prefix only: query block
    [q0, q1) attends to keys [0, q1) in one exact softmax (attention_core itself), so the score blocks
    wholly after the query block are never computed (~(n+1)/2n of the naive work for n blocks) while
    memory traffic per score and autodiff stay those of the naive core. Same contract and shapes as
    blockwise_attention_core (self-attention, mask causal by index)."""
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"causal_blocks attention needs self-attention (q len {q.shape[1]} != k len {k.shape[1]})")
    outs = [attention_core(q[:, q0:q1], k[:, :q1], v[:, :q1], mask[:, :, q0:q1, :q1], scale)
            for q0, q1 in _spans(q.shape[1], block)]
    return jnp.concatenate(outs, axis=1)


BUILTIN_CORES = ("naive", "blockwise", "causal_blocks")


def resolve_attention_impl(impl: str, platform: str | None = None, devices: int = 1) -> str:
    """`auto` -> a registered core of the platform that takes a program over `devices` devices
    (ops.resolve: `fused_cpu` on a one-device CPU program when the kernels are installed), else
    `naive`; other names are returned checked (a registered one on its platform only)."""
    return ops.resolve(ops.ATTENTION_CORE, impl, key="runtime.attention_impl", builtins=BUILTIN_CORES,
                       platform=platform, devices=devices, default=lambda p: "naive")


def core_attention(impl: str, block: int, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                   scale: float) -> jax.Array:
    """The attention core `impl` (runtime.attention_impl: auto | naive | blockwise | causal_blocks | a
    registered one) with blocks of `block` tokens (runtime.attention_block); shapes as attention_core.
    With blockwise / causal_blocks, sequences of one block or less take the naive core (the same
    computation)."""
    impl = resolve_attention_impl(impl)
    registered = ops.registered(ops.ATTENTION_CORE, impl)
    if registered is not None:
        return registered.fn(q, k, v, mask, scale)
    if impl == "blockwise" and q.shape[1] > block:
        return blockwise_attention_core(q, k, v, mask, scale, block)
    if impl == "causal_blocks" and q.shape[1] > block:
        return causal_blocks_attention_core(q, k, v, mask, scale, block)
    return attention_core(q, k, v, mask, scale)

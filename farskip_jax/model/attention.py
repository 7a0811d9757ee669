"""Grouped-query attention (GQA/MQA/MHA) with RoPE, optional q/k RMSNorm, causal + document masks.

Split in named parts so the compiled schedule can be read per part (DESIGN.md section 4):
`attention_qkv` (projections + rope), `attention_core` (softmax(QK^T)V), `attention_out` (output
projection). x: [batch, seq, d_model]; positions, segment_ids: [batch, seq].
The core is `model.attention_impl`: `naive` (one [t, s] score matrix), `blockwise` (flash-style
online softmax over `model.attention_block`-token blocks, causal blocks skipped, recomputing VJP) or
`causal_blocks` (each query block against its key prefix: exact softmax, plain autodiff), or a core
registered in the backend seam (model/ops.py: `fused_cpu`, the C++ CPU kernel of farskip_jax.kernels
when the config enables it); `auto` (default) is a registered core of the platform (`fused_cpu` in a
one-device CPU program) and `naive` otherwise.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from farskip_jax.config import ModelConfig
from farskip_jax.model import ops
from farskip_jax.model.layers import Linear, RMSNorm, dtype_of
from farskip_jax.model.rope import apply_rope, rope_frequencies

NEG_INF = -1e30


def attention_mask(q_pos: jax.Array, k_pos: jax.Array, q_seg: Optional[jax.Array], k_seg: Optional[jax.Array],
                   *, causal: bool = True, chunk_size: Optional[int] = None) -> jax.Array:
    """Boolean mask [batch, 1, q_len, k_len]: causal (by position), same document, optional chunk."""
    m = jnp.ones((q_pos.shape[0], q_pos.shape[1], k_pos.shape[1]), bool)
    if causal:
        m &= k_pos[:, None, :] <= q_pos[:, :, None]
    if q_seg is not None and k_seg is not None:
        m &= q_seg[:, :, None] == k_seg[:, None, :]
    if chunk_size:
        m &= (q_pos[:, :, None] // chunk_size) == (k_pos[:, None, :] // chunk_size)
    return m[:, None]


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
    return ops.resolve(ops.ATTENTION_CORE, impl, key="model.attention_impl", builtins=BUILTIN_CORES,
                       platform=platform, devices=devices, default=lambda p: "naive")


def core_attention(cfg: ModelConfig, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                   scale: float) -> jax.Array:
    """The attention core selected by `model.attention_impl` (auto | naive | blockwise | causal_blocks |
    a registered one); shapes as attention_core. With blockwise / causal_blocks, sequences of one
    block or less take the naive core (the same computation)."""
    impl = resolve_attention_impl(cfg.attention_impl)
    registered = ops.registered(ops.ATTENTION_CORE, impl)
    if registered is not None:
        return registered.fn(q, k, v, mask, scale)
    if impl == "blockwise" and q.shape[1] > cfg.attention_block:
        return blockwise_attention_core(q, k, v, mask, scale, cfg.attention_block)
    if impl == "causal_blocks" and q.shape[1] > cfg.attention_block:
        return causal_blocks_attention_core(q, k, v, mask, scale, cfg.attention_block)
    return attention_core(q, k, v, mask, scale)


def temperature_scale(positions: jax.Array, floor: float, scale: float) -> jax.Array:
    """Llama-4 attention temperature tuning of NoPE layers: [b, t] -> [b, t, 1, 1] query multiplier."""
    p = positions.astype(jnp.float32)
    return (jnp.log1p(jnp.floor((p + 1.0) / floor)) * scale + 1.0)[:, :, None, None]


def l2_norm(x: jax.Array, eps: float) -> jax.Array:
    """Weightless RMS normalisation over the last dim (Llama-4's q/k "L2Norm")."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def layer_mask(cfg: ModelConfig, layer_idx: int, positions: jax.Array, segment_ids: Optional[jax.Array]) -> jax.Array:
    """Causal/document mask of one layer, chunked when the layer uses chunked local attention."""
    chunked = cfg.attention_chunk_size and (cfg.chunked_layers is None or layer_idx in cfg.chunked_layers)
    return attention_mask(positions, positions, segment_ids, segment_ids,
                          chunk_size=cfg.attention_chunk_size if chunked else None)


class AttentionBase(nnx.Module):
    """The three named parts shared by every attention variant. Subclasses provide `qkv(x, positions)`,
    `cfg`, `layer_idx`, `scale`, `o_proj` and `gate_proj` (None when ungated).

    num_groups = H > 1 (Federation of Experts, model/foe.py; GQA only): x is [H, b, t, d], group h
    runs query heads [h*nh/H, (h+1)*nh/H) with their kv heads through its own rows of o_proj, the
    groups folded into the batch of the core; the result is [H, b, t, d] (sum_h = the ordinary
    attention when every group reads the same input)."""

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: Optional[jax.Array] = None,
                 num_groups: int = 1) -> jax.Array:
        with jax.named_scope("attention_qkv"):
            q, k, v = self.qkv(x, positions) if num_groups == 1 else self.qkv(x, positions, num_groups)
        with jax.named_scope("attention_core"):
            if num_groups > 1:
                positions = jnp.tile(positions, (num_groups, 1))
                segment_ids = None if segment_ids is None else jnp.tile(segment_ids, (num_groups, 1))
            mask = layer_mask(self.cfg, self.layer_idx, positions, segment_ids)
            o = core_attention(self.cfg, q, k, v, mask, self.scale)
        with jax.named_scope("attention_out"):
            return self.project_out(o, x, num_groups)

    def project_out(self, o: jax.Array, x: jax.Array, num_groups: int = 1) -> jax.Array:
        """o: [b, t, h, dv] core output, x: [b, t, d] attention input -> [b, t, d] (gate + o_proj; KV-cache
        decode reuses it). num_groups H > 1: o [H*b, t, h/H, dv], x [H, b, t, d] -> [H, b, t, d]."""
        if num_groups > 1:
            o = o.reshape(*x.shape[:3], -1)
            if self.gate_proj is not None:
                o = o * jax.nn.sigmoid(self.gate_proj.grouped(x, num_groups))
            return self.o_proj.grouped(o, num_groups, split="in")
        o = o.reshape(o.shape[0], o.shape[1], -1)
        if self.gate_proj is not None:
            o = o * jax.nn.sigmoid(self.gate_proj(x))
        return self.o_proj(o)


class Attention(AttentionBase):
    """GQA attention. Heads: num_heads queries share num_kv_heads key/value heads.

    Optional pieces (ModelConfig): q/k RMSNorm per head or over all heads, NoPE layers, q/k L2 norm
    after rope, chunked local attention, NoPE temperature tuning, sigmoid-gated output."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, layer_idx: int = 0):
        self.cfg = cfg
        self.layer_idx = layer_idx
        d, h, kv, hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
        pd = dtype_of(cfg.param_dtype)
        kw = dict(rngs=rngs, std=cfg.init_std, param_dtype=pd, compute_dtype=dtype_of(cfg.compute_dtype))
        self.q_proj = Linear(d, h * hd, axes=("embed", "heads"), bias=cfg.attention_bias, **kw)
        self.k_proj = Linear(d, kv * hd, axes=("embed", "kv_heads"), bias=cfg.attention_bias, **kw)
        self.v_proj = Linear(d, kv * hd, axes=("embed", "kv_heads"), bias=cfg.attention_bias, **kw)
        self.o_proj = Linear(h * hd, d, axes=("heads", "embed"), **kw)
        self.gate_proj = Linear(d, h * hd, axes=("embed", "heads"), **kw) if cfg.gated_attention else None
        if cfg.qk_norm and cfg.qk_norm_scope == "all_heads":
            self.q_norm = RMSNorm(h * hd, eps=cfg.norm_eps, param_dtype=pd, axes=("heads",))
            self.k_norm = RMSNorm(kv * hd, eps=cfg.norm_eps, param_dtype=pd, axes=("kv_heads",))
        elif cfg.qk_norm:
            self.q_norm = RMSNorm(hd, eps=cfg.norm_eps, param_dtype=pd, axes=("head_dim",))
            self.k_norm = RMSNorm(hd, eps=cfg.norm_eps, param_dtype=pd, axes=("head_dim",))
        else:
            self.q_norm = self.k_norm = None
        self.use_rope = layer_idx not in cfg.nope_layers
        self.inv_freq, self.rope_factor = rope_frequencies(hd, cfg.rope_theta, cfg.rope_scaling)
        self.inv_freq = tuple(float(f) for f in self.inv_freq)  # hashable static attribute
        self.scale = hd ** -0.5

    def qkv(self, x: jax.Array, positions: jax.Array, num_groups: int = 1) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [b, t, d] -> q [b, t, nh, hd], k / v [b, t, nkv, hd] (rope, q/k norms applied).
        num_groups H > 1: x [H, b, t, d] -> each group's heads, groups folded into the batch:
        q [H*b, t, nh/H, hd], k / v [H*b, t, nkv/H, hd] (head-scope q/k norm only)."""
        cfg, hg = self.cfg, num_groups
        t = x.shape[-2]
        hd = cfg.resolved_head_dim
        if hg == 1:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = (p.grouped(x, hg) for p in (self.q_proj, self.k_proj, self.v_proj))
            positions = jnp.tile(positions, (hg, 1))
        if self.q_norm is not None and cfg.qk_norm_scope == "all_heads":
            q, k = self.q_norm(q), self.k_norm(k)
        rows = x.shape[0] * (x.shape[1] if hg > 1 else 1)
        q = q.reshape(rows, t, cfg.num_heads // hg, hd)
        k = k.reshape(rows, t, cfg.num_kv_heads // hg, hd)
        v = v.reshape(rows, t, cfg.num_kv_heads // hg, hd)
        q, k = self.position_qk(q, k, positions)
        return q, k, v

    def position_qk(self, q: jax.Array, k: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Per-head q/k norm, rope (or NoPE temperature tuning), L2 q/k norm. q, k: [b, t, heads, hd]."""
        cfg = self.cfg
        if self.q_norm is not None and cfg.qk_norm_scope == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            inv = jnp.asarray(self.inv_freq)
            q = apply_rope(q, positions, inv, attention_factor=self.rope_factor, interleaved=cfg.rope_interleaved)
            k = apply_rope(k, positions, inv, attention_factor=self.rope_factor, interleaved=cfg.rope_interleaved)
            if cfg.qk_l2_norm:
                q, k = l2_norm(q, cfg.norm_eps), l2_norm(k, cfg.norm_eps)
        elif cfg.attn_temperature_tuning:
            q = (q * temperature_scale(positions, cfg.attn_temperature_floor, cfg.attn_temperature_scale)).astype(q.dtype)
        return q, k


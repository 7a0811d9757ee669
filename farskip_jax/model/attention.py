"""Grouped-query attention (GQA/MQA/MHA) with RoPE, optional q/k RMSNorm, causal + document masks.

Split in named parts so the compiled schedule can be read per part (docs/design.md section 4):
`attention_qkv` (projections + rope), `attention_core` (softmax(QK^T)V), `attention_out` (output
projection). x: [batch, seq, d_model]; positions, segment_ids: [batch, seq].
The core is `runtime.attention_impl` with blocks of `runtime.attention_block` tokens (kernels/attention.py:
naive, blockwise, causal_blocks or a registered kernel; `auto` by platform).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx, struct

from farskip_jax.config import ModelConfig, RuntimeConfig
from farskip_jax.kernels.attention import attention_core, core_attention
from farskip_jax.model.layers import Linear, RMSNorm, dtype_of
from farskip_jax.model.rope import apply_rope, rope_frequencies

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


def temperature_scale(positions: jax.Array, floor: float, scale: float) -> jax.Array:
    """Llama-4 attention temperature tuning of NoPE layers: [b, t] -> [b, t, 1, 1] query multiplier."""
    p = positions.astype(jnp.float32)
    return (jnp.log1p(jnp.floor((p + 1.0) / floor)) * scale + 1.0)[:, :, None, None]


def l2_norm(x: jax.Array, eps: float) -> jax.Array:
    """Weightless RMS normalisation over the last dim (Llama-4's q/k "L2Norm")."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def _chunk(cfg: ModelConfig, layer_idx: int) -> Optional[int]:
    """The chunk of a layer's chunked local attention (None: global attention)."""
    chunked = cfg.attention_chunk_size and (cfg.chunked_layers is None or layer_idx in cfg.chunked_layers)
    return cfg.attention_chunk_size if chunked else None


def layer_mask(cfg: ModelConfig, layer_idx: int, positions: jax.Array, segment_ids: Optional[jax.Array]) -> jax.Array:
    """Causal/document mask of one layer, chunked when the layer uses chunked local attention."""
    return attention_mask(positions, positions, segment_ids, segment_ids, chunk_size=_chunk(cfg, layer_idx))


def cache_mask(cfg: ModelConfig, layer_idx: int, positions: jax.Array, key_positions: jax.Array) -> jax.Array:
    """[b, 1, t, L]: which cache slots (at key_positions [b, L]) the new tokens at positions [b, t] see
    in one layer (causal by position, chunked when the layer is)."""
    return attention_mask(positions, key_positions, None, None, chunk_size=_chunk(cfg, layer_idx))


@struct.dataclass
class LayerCache:
    """One layer's KV cache as its attention reads and writes it (decoding).

    k [b, L, kv, hd], v [b, L, kv, dv] (MLA: the decompressed per-head keys / values), or the whole
    stack of a scanned model [repeats, b, L, ...] with `row` the layer's row (an int, or traced in a
    scan over layer indices); start []: the slot of the first new token; mask [b, 1, t, L] (cache_mask).
    written: the keys / values the last `write` put at slots [start, start + t), for a caller that
    keeps the cache elsewhere (the tp_ep and dp_ep layouts bring a stacked cache's row out of their
    shard_map and `write` it there)."""

    k: jax.Array
    v: jax.Array
    start: jax.Array
    mask: jax.Array
    row: Any = None
    written: Optional[tuple] = None

    def write(self, k: jax.Array, v: jax.Array) -> "LayerCache":
        """The cache with new keys / values k, v [b, t, heads, dim] at slots [start, start + t) (in place)."""
        k, v = k.astype(self.k.dtype), v.astype(self.v.dtype)
        if self.row is None:
            kc = jax.lax.dynamic_update_slice(self.k, k, (0, self.start, 0, 0))
            vc = jax.lax.dynamic_update_slice(self.v, v, (0, self.start, 0, 0))
        else:
            kc = jax.lax.dynamic_update_slice(self.k, k[None], (self.row, 0, self.start, 0, 0))
            vc = jax.lax.dynamic_update_slice(self.v, v[None], (self.row, 0, self.start, 0, 0))
        return self.replace(k=kc, v=vc, written=(k, v))

    def keys_values(self) -> tuple[jax.Array, jax.Array]:
        """The layer's keys and values [b, L, heads, dim] (its row of a stacked cache)."""
        if self.row is None:
            return self.k, self.v
        return (jax.lax.dynamic_index_in_dim(self.k, self.row, 0, keepdims=False),
                jax.lax.dynamic_index_in_dim(self.v, self.row, 0, keepdims=False))


@struct.dataclass
class KVCache:
    """The KV cache of a forward over new tokens written at cache slots [start, start + t): what the
    Transformer takes as `cache` and returns updated (out.cache).

    layers: per group of the layer loop (model/layer_loop.py), per block q of its period, (k, v)
    [b, L, heads, dim] (a stack's: [repeats, b, L, heads, dim]); with runtime.micro_batches m > 1 a tuple
    of m such, one per micro-batch (rows split_rows(x, m)[j]). key_positions [b, L]: the position of
    each slot after the write (an empty or pad slot a position no query reaches). scan (static): walk
    a stacked model's layers as scans over layer indices (default) or unrolled over per-layer views."""

    layers: Any
    start: jax.Array
    key_positions: jax.Array
    scan: bool = struct.field(pytree_node=False, default=True)


class AttentionBase(nnx.Module):
    """The three named parts shared by every attention variant. Subclasses provide `qkv(x, positions)`,
    `cfg`, `layer_idx`, `scale`, `o_proj` and `gate_proj` (None when ungated).

        out, cache = attn(x [b, t, d], positions [b, t], segment_ids [b, t] or None, cache=None)

    cache: a LayerCache (decoding): the new keys / values are written into it and the core reads
    every slot of it through its mask (segment_ids unused); returned updated (None without one).
    num_groups = H > 1 (Federation of Experts, model/foe.py; GQA only): x is [H, b, t, d], group h
    runs query heads [h*nh/H, (h+1)*nh/H) with their kv heads through its own rows of o_proj, the
    groups folded into the batch of the core (a cache's rows H*b: group h's at h*b + j); the result
    is [H, b, t, d] (sum_h = the ordinary attention when every group reads the same input)."""

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: Optional[jax.Array] = None,
                 cache: Optional[LayerCache] = None, num_groups: int = 1) -> tuple[jax.Array, Optional[LayerCache]]:
        with jax.named_scope("attention_qkv"):
            q, k, v = self.qkv(x, positions) if num_groups == 1 else self.qkv(x, positions, num_groups)
        if cache is None:
            with jax.named_scope("attention_core"):
                if num_groups > 1:
                    positions = jnp.tile(positions, (num_groups, 1))
                    segment_ids = None if segment_ids is None else jnp.tile(segment_ids, (num_groups, 1))
                mask = layer_mask(self.cfg, self.layer_idx, positions, segment_ids)
                o = core_attention(self.runtime.attention_impl, self.runtime.attention_block, q, k, v, mask, self.scale)
        else:
            cache = cache.write(k, v)
            kc, vc = cache.keys_values()
            with jax.named_scope("attention_core"):
                o = attention_core(q, kc, vc, cache.mask, self.scale)
        with jax.named_scope("attention_out"):
            return self.project_out(o, x, num_groups), cache

    def project_out(self, o: jax.Array, x: jax.Array, num_groups: int = 1) -> jax.Array:
        """o: [b, t, h, dv] core output, x: [b, t, d] attention input -> [b, t, d] (gate + o_proj).
        num_groups H > 1: o [H*b, t, h/H, dv], x [H, b, t, d] -> [H, b, t, d]."""
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

    def __init__(self, cfg: ModelConfig, runtime: RuntimeConfig, *, rngs: nnx.Rngs, layer_idx: int = 0):
        self.cfg, self.runtime = cfg, runtime
        self.layer_idx = layer_idx
        d, h, kv, hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
        pd = dtype_of(runtime.param_dtype)
        kw = dict(rngs=rngs, std=cfg.init_std, param_dtype=pd, compute_dtype=dtype_of(runtime.compute_dtype))
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


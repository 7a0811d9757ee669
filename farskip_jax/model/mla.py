"""Multi-head latent attention (MLA, DeepSeek-V2/V3) with optional gated output (Instella-MoE).

    q      = q_proj(x)                         or  q_b(norm(q_a(x)))          (q-LoRA)   [b, t, h, nope+rope]
    c, k_r = split(kv_a(x), [kv_lora, rope])   compressed latent + one rope key shared by all heads
    k_n, v = split(kv_b(norm(c)), [nope, v])   per head                                    [b, t, h, .]
    q = [q_nope, rope(q_rope)], k = [k_nope, rope(k_r)]; o = softmax(q k^T * scale) v      [b, t, h, v]
    out = o_proj(o (* sigmoid(gate_proj(x)) when gated))

`scale` = (nope+rope)^-0.5, times mscale(factor, mscale_all_dim)^2 under DeepSeek's YaRN. The rope
is over `qk_rope_head_dim` dims (interleaved pairs when `rope_interleaved`). Parameters are plain
Linear layers with flat output dims (the HF layout transposed). Same named scopes as attention.py.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from flax import nnx

from farskip_jax.config import ModelConfig, RuntimeConfig
from farskip_jax.model.attention import AttentionBase
from farskip_jax.model.layers import Linear, RMSNorm, dtype_of
from farskip_jax.model.rope import apply_rope, rope_frequencies, yarn_get_mscale

LATENT_NORM_EPS = 1e-6  # HF DeepSeek builds q_a/kv_a layernorms with the default eps, not rms_norm_eps


class MLAttention(AttentionBase):
    def __init__(self, cfg: ModelConfig, runtime: RuntimeConfig, *, rngs: nnx.Rngs, layer_idx: int = 0):
        self.cfg, self.runtime = cfg, runtime
        self.layer_idx = layer_idx
        d, h = cfg.d_model, cfg.num_heads
        nope, rope, vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        pd = dtype_of(runtime.param_dtype)
        kw = dict(rngs=rngs, std=cfg.init_std, param_dtype=pd, compute_dtype=dtype_of(runtime.compute_dtype))
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(d, h * (nope + rope), axes=("embed", "heads"), **kw)
            self.q_a_proj = self.q_a_norm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = Linear(d, cfg.q_lora_rank, axes=("embed", None), bias=cfg.attention_bias, **kw)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, eps=LATENT_NORM_EPS, param_dtype=pd, axes=(None,))
            self.q_b_proj = Linear(cfg.q_lora_rank, h * (nope + rope), axes=(None, "heads"), **kw)
        self.kv_a_proj = Linear(d, cfg.kv_lora_rank + rope, axes=("embed", None), bias=cfg.attention_bias, **kw)
        self.kv_a_norm = RMSNorm(cfg.kv_lora_rank, eps=LATENT_NORM_EPS, param_dtype=pd, axes=(None,))
        self.kv_b_proj = Linear(cfg.kv_lora_rank, h * (nope + vd), axes=(None, "heads"), **kw)
        self.o_proj = Linear(h * vd, d, axes=("heads", "embed"), bias=cfg.attention_bias, **kw)
        self.gate_proj = Linear(d, h * vd, axes=("embed", "heads"), **kw) if cfg.gated_attention else None
        inv_freq, self.rope_factor = rope_frequencies(rope, cfg.rope_theta, cfg.rope_scaling)
        self.inv_freq = tuple(float(f) for f in inv_freq)
        scale = (nope + rope) ** -0.5
        s = cfg.rope_scaling
        if s.type == "yarn" and s.mscale_all_dim:
            scale *= yarn_get_mscale(s.factor, s.mscale_all_dim) ** 2
        self.scale = scale

    def qkv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x: [b, t, d] -> q, k: [b, t, h, nope+rope], v: [b, t, h, v_head_dim]."""
        cfg = self.cfg
        b, t, _ = x.shape
        h, nope, rope, vd = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q = q.reshape(b, t, h, nope + rope)
        ckv = self.kv_a_proj(x)
        c, k_rope = ckv[..., : cfg.kv_lora_rank], ckv[..., cfg.kv_lora_rank:]
        kv = self.kv_b_proj(self.kv_a_norm(c)).reshape(b, t, h, nope + vd)
        k_nope, v = kv[..., :nope], kv[..., nope:]
        inv = jnp.asarray(self.inv_freq)
        rot = lambda z: apply_rope(z, positions, inv, attention_factor=self.rope_factor, interleaved=cfg.rope_interleaved)
        q = jnp.concatenate([q[..., :nope], rot(q[..., nope:])], axis=-1)
        k_rope = jnp.broadcast_to(rot(k_rope[:, :, None, :]), (b, t, h, rope))
        k = jnp.concatenate([k_nope, k_rope.astype(k_nope.dtype)], axis=-1)
        return q, k, v


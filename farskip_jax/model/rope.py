"""Rotary position embeddings with the scaling variants of HF checkpoints.

`rope_frequencies(dim, theta, scaling)` -> (inv_freq [dim/2], attention_factor): the frequencies and
the factor HF multiplies cos/sin by (1 except for YaRN). `apply_rope(x, positions, inv_freq, ...)`
rotates x: [batch, seq, heads, dim] at positions: [batch, seq]. `interleaved=False` rotates the two
halves (HF "rotate_half"); `interleaved=True` rotates adjacent pairs (GPT-J / DeepSeek's layout).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from farskip_jax.config import RopeScalingConfig


def _yarn_find_correction_dim(num_rot, dim, base, max_pos):
    return (dim * math.log(max_pos / (num_rot * 2 * math.pi))) / (2 * math.log(base))


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(dim: int, theta: float, scaling: RopeScalingConfig | None = None) -> tuple[np.ndarray, float]:
    """Inverse frequencies [dim // 2] (float64 numpy, host constant) and the cos/sin factor."""
    inv_freq = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    s = scaling or RopeScalingConfig()
    if s.type == "none":
        return inv_freq, 1.0
    if s.type == "linear":
        return inv_freq / s.factor, 1.0
    if s.type == "llama3":
        low_wl = s.original_max_position / s.low_freq_factor
        high_wl = s.original_max_position / s.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wl, inv_freq / s.factor, inv_freq)
        smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        is_medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        return np.where(is_medium, smoothed, scaled), 1.0
    if s.type == "yarn":
        if s.attention_factor is not None:
            attn = s.attention_factor
        elif s.mscale and s.mscale_all_dim:
            attn = yarn_get_mscale(s.factor, s.mscale) / yarn_get_mscale(s.factor, s.mscale_all_dim)
        else:
            attn = yarn_get_mscale(s.factor)
        low = _yarn_find_correction_dim(s.beta_fast, dim, theta, s.original_max_position)
        high = _yarn_find_correction_dim(s.beta_slow, dim, theta, s.original_max_position)
        if s.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrapolation_factor = 1 - ramp
        inv_interp = inv_freq / s.factor
        return inv_interp * (1 - extrapolation_factor) + inv_freq * extrapolation_factor, float(attn)
    raise ValueError(f"unknown rope scaling type {s.type!r}")


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, *, attention_factor: float = 1.0,
               interleaved: bool = False) -> jax.Array:
    """x: [batch, seq, heads, dim]; positions: [batch, seq] -> rotated x (same dtype)."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)  # [b, t, d/2]
    cos = (jnp.cos(angles) * attention_factor)[:, :, None, :]
    sin = (jnp.sin(angles) * attention_factor)[:, :, None, :]
    xf = x.astype(jnp.float32)
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x.shape)
    else:
        half = x.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)

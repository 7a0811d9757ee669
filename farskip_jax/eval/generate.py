"""Autoregressive generation with a KV cache that honours the model's connectivity.

Every stream of FarSkip connectivity (DESIGN.md section 1) is per token: the streams of token j
depend only on token j's own sub-block outputs, and tokens interact only inside attention (through
keys/values). So a decode step runs the SAME stream logic (model/connectivity.py `Streams`) over the
new tokens only, with attention reading the cached keys/values of all earlier tokens. The cache
holds, per layer, k [batch, max_len, kv_heads, head_dim] and v [batch, max_len, kv_heads, v_dim]
(MLA: the decompressed per-head keys/values, not the latent; simple and exact, not memory-lean).
A decode step is the model's own forward with each layer's attention swapped for a cached one
(Transformer's `attention_fns`), so the streams are never written twice. Federation of Experts
(moe.num_groups > 1) goes through model/foe.py's forward, each group's heads reading the cache rows
of its own representation.

    out = generate(model, prompt_bp, max_new_tokens=32)                   # greedy, cfg.farskip
    out = generate(model, prompt_bp, 32, farskip=FarSkipConfig(), temperature=0.8, top_p=0.9, seed=1)
    out.tokens [b, P + new] (rows stop at eos_id: later tokens are eos), out.logits [b, new, V]

Prompts in one batch share a length P (positions 0..P-1); `prefill` handles all P tokens in one call.
A dropless MoE (capacity_factor null) gives exactly the full forward; with a capacity, tokens routed
together can drop differently than in a full-sequence forward.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from farskip_jax.config import FarSkipConfig
from farskip_jax.model.attention import attention_core, attention_mask
from farskip_jax.model.foe import group_project_out, group_qkv

FAR = np.iinfo(np.int32).max  # position given to empty cache slots: never <= a query position


@dataclasses.dataclass
class Generation:
    tokens: np.ndarray  # [b, P + new]
    logits: np.ndarray  # [b, new, vocab] logits that produced each new token


def init_cache(model, batch: int, max_len: int) -> tuple:
    """Zero KV cache: per layer (k [b, max_len, kv, d], v [b, max_len, kv, dv]) in the compute dtype.
    Federation of Experts (moe.num_groups = H > 1): k, v [H*b, max_len, kv/H, d] (group h's heads of
    sequence j at row h*b + j, as model/foe.py folds groups into the batch)."""
    d = model.cfg.model.d_model
    hg = model.cfg.moe.num_groups
    cache = []
    for block in model.layers:
        if hg > 1:
            qkv = partial(group_qkv, block.attn, num_groups=hg)
            x = jax.ShapeDtypeStruct((hg, batch, 1, d), jnp.float32)
        else:
            qkv, x = block.attn.qkv, jax.ShapeDtypeStruct((batch, 1, d), jnp.float32)
        q, k, v = jax.eval_shape(qkv, x, jax.ShapeDtypeStruct((batch, 1), jnp.int32))
        rows = k.shape[0]
        cache.append((jnp.zeros((rows, max_len) + k.shape[2:], k.dtype), jnp.zeros((rows, max_len) + v.shape[2:], v.dtype)))
    return tuple(cache)


def _cache_mask(model, layer: int, positions: jax.Array, k_pos: jax.Array) -> jax.Array:
    """Causal (or chunked-local) mask of queries at `positions` [b', t] over cache slots at k_pos [b', L]."""
    m = model.cfg.model
    chunked = m.attention_chunk_size and (m.chunked_layers is None or layer in m.chunked_layers)
    return attention_mask(positions, k_pos, None, None, chunk_size=m.attention_chunk_size if chunked else None)


def _write_cache(entry: tuple, k: jax.Array, v: jax.Array, start: jax.Array) -> tuple:
    kc = jax.lax.dynamic_update_slice(entry[0], k.astype(entry[0].dtype), (0, start, 0, 0))
    vc = jax.lax.dynamic_update_slice(entry[1], v.astype(entry[1].dtype), (0, start, 0, 0))
    return kc, vc


def decode_step(model, tokens: jax.Array, start: jax.Array, cache: tuple, farskip: FarSkipConfig):
    """Run tokens [b, t] at positions start..start+t-1 against the cache -> (logits [b, t, V] f32, cache).

    The model's own forward (its streams; FoE's group sums) with each layer's attention replaced by
    one that writes the new keys/values into cache slots [start, start + t) and reads every slot;
    slots < start must hold earlier tokens."""
    b, t = tokens.shape
    hg = model.cfg.moe.num_groups
    positions = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))
    max_len = cache[0][0].shape[1]
    slots = jnp.arange(max_len, dtype=jnp.int32)
    k_pos = jnp.broadcast_to(jnp.where(slots < start + t, slots, FAR), (b, max_len))
    q_pos, kv_pos = (jnp.tile(positions, (hg, 1)), jnp.tile(k_pos, (hg, 1))) if hg > 1 else (positions, k_pos)
    new_cache = [None] * len(model.layers)

    def cached_attention(i, attn):
        def fn(xn):  # normalised attention input ([b, t, d], FoE [H, b, t, d]) -> attention output
            q, k, v = group_qkv(attn, xn, positions, hg) if hg > 1 else attn.qkv(xn, positions)
            new_cache[i] = kc, vc = _write_cache(cache[i], k, v, start)
            o = attention_core(q, kc, vc, _cache_mask(model, i, q_pos, kv_pos), attn.scale)
            return group_project_out(attn, o, xn, hg) if hg > 1 else attn.project_out(o, xn)
        return fn

    out = model(tokens, positions, farskip=farskip,
                attention_fns=[cached_attention(i, blk.attn) for i, blk in enumerate(model.layers)])
    return out.logits, tuple(new_cache)


def make_decode_fn(graphdef, farskip: FarSkipConfig):
    """jitted fn(state, tokens [b, t], start [], cache) -> (logits, cache); state = nnx state of the model."""

    def fn(state, tokens, start, cache):
        return decode_step(nnx.merge(graphdef, state), tokens, start, cache, farskip)

    return jax.jit(fn, donate_argnums=3)


def sample_next(logits: jax.Array, key: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """logits [b, V] -> token ids [b]: greedy when temperature == 0, else nucleus (top-p) sampling."""
    if temperature <= 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    lg = logits.astype(jnp.float32) / temperature
    if top_p < 1.0:
        sorted_lg = jnp.sort(lg, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_lg, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly more likely tokens
        cutoff = jnp.min(jnp.where(before < top_p, sorted_lg, jnp.inf), axis=-1, keepdims=True)
        lg = jnp.where(lg >= cutoff, lg, -jnp.inf)
    return jax.random.categorical(key, lg, axis=-1).astype(jnp.int32)


def generate(model, prompt, max_new_tokens: int, *, farskip: Optional[FarSkipConfig] = None, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, eos_id: Optional[int] = None, decode_fn=None) -> Generation:
    """Generate `max_new_tokens` after prompt [b, P] (see module docstring). `model`: a Transformer."""
    fs = farskip if farskip is not None else model.cfg.farskip
    prompt = jnp.asarray(prompt, jnp.int32)
    b, p = prompt.shape
    graphdef, state = nnx.split(model)
    fn = decode_fn or make_decode_fn(graphdef, fs)
    cache = init_cache(model, b, p + max_new_tokens)
    key = jax.random.key(seed)
    logits, cache = fn(state, prompt, jnp.int32(0), cache)
    last = logits[:, -1]
    out_tokens, out_logits = [], []
    done = np.zeros((b,), bool)
    for i in range(max_new_tokens):
        key, sub = jax.random.split(key)
        nxt = np.asarray(sample_next(last, sub, temperature, top_p))
        if eos_id is not None:
            nxt = np.where(done, eos_id, nxt)
            done |= nxt == eos_id
        out_tokens.append(nxt)
        out_logits.append(np.asarray(last))
        if i + 1 == max_new_tokens or (eos_id is not None and done.all()):
            break
        logits, cache = fn(state, jnp.asarray(nxt[:, None], jnp.int32), jnp.int32(p + i), cache)
        last = logits[:, -1]
    new = np.stack(out_tokens, axis=1) if out_tokens else np.zeros((b, 0), np.int32)
    return Generation(tokens=np.concatenate([np.asarray(prompt), new], axis=1),
                      logits=np.stack(out_logits, axis=1) if out_logits else np.zeros((b, 0, 0), np.float32))

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

Stacked layers (`model.scan_layers`, docs/scan.md): the decode step is a scan per stack (and run of
equal connectivity) over the whole stacked weights, the cache stacked on the same layer axis and
carried (eval/decode_scan.py); no layer's weights are sliced out of a stack outside the loop. The
unrolled loop over per-layer views stays for FoE and as `scan=False` (the former program).

    out = generate(model, prompt_bp, max_new_tokens=32)                   # greedy, cfg.farskip
    out = generate(model, prompt_bp, 32, farskip=FarSkipConfig(), temperature=0.8, top_p=0.9, seed=1)
    out = generate(model, [[5, 6, 7], [8, 9]], 16, layout=TpEpLayout(mesh))   # ragged, on a mesh
    out.tokens [b, P + new] (rows stop at eos_id: later tokens are eos), out.logits [b, new, V]

Requests of different lengths: a list of token sequences is left-padded to the longest, P (`pad_id`;
`out.pad` [b] pad tokens per row, `out.lengths` [b] prompt lengths). Row j's token in cache slot i
sits at position i - pad[j]; pad slots are never keys (position FAR) and pad queries sit at position
0, so a row's tokens see exactly its own prompt: its logits equal its own unpadded full forward.
Every row writes slot P + n at decode step n. The prefill handles all P slots in one call.

On a mesh (`layout`, parallel/inference.py TpEpLayout, the paper's TP-attention / replicated-MoE
serving layout): the model must come from parallel.inference.inference_model; attention heads and
the cache's heads are split over `tensor`, rows over `data`; the decode step is the same program.
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
from farskip_jax.errors import ConfigError
from farskip_jax.eval.decode_scan import init_stacked_cache, scanned_decode, scanned_decode_step
from farskip_jax.model.attention import attention_core, attention_mask
from farskip_jax.model.foe import group_project_out, group_qkv

FAR = np.iinfo(np.int32).max  # position given to empty cache slots: never <= a query position


@dataclasses.dataclass
class Generation:
    tokens: np.ndarray  # [b, P + new], prompts left-padded to P
    logits: np.ndarray  # [b, new, vocab] logits that produced each new token
    pad: Optional[np.ndarray] = None  # [b] pad tokens before each row's prompt
    lengths: Optional[np.ndarray] = None  # [b] prompt lengths

    def completion(self, row: int) -> np.ndarray:
        """The new tokens of one row (eos-filled after its eos)."""
        return self.tokens[row, self.tokens.shape[1] - self.logits.shape[1]:]


def pad_prompts(prompts, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A [b, P] array (returned as is) or a list of b token sequences -> (tokens [b, P] left-padded
    with pad_id, pad [b] int32 pad tokens per row)."""
    if isinstance(prompts, (np.ndarray, jax.Array)) and np.ndim(prompts) == 2:
        arr = np.asarray(prompts, np.int32)
        return arr, np.zeros((arr.shape[0],), np.int32)
    seqs = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
    if not seqs or min(len(q) for q in seqs) == 0:
        raise ConfigError("generate needs at least one prompt and no empty prompt (give each row >= 1 token, e.g. BOS)")
    p = max(len(q) for q in seqs)
    out = np.full((len(seqs), p), pad_id, np.int32)
    for i, q in enumerate(seqs):
        out[i, p - len(q):] = q
    return out, np.asarray([p - len(q) for q in seqs], np.int32)


def init_cache(model, batch: int, max_len: int, layout=None, scan: Optional[bool] = None) -> tuple:
    """Zero KV cache: per layer (k [b, max_len, kv, d], v [b, max_len, kv, dv]) in the compute dtype.
    Federation of Experts (moe.num_groups = H > 1): k, v [H*b, max_len, kv/H, d] (group h's heads of
    sequence j at row h*b + j, as model/foe.py folds groups into the batch). On a `layout`
    (parallel/inference.TpEpLayout): heads split over `tensor` (replicated kv heads: one per rank),
    rows over `data`, created in place on the mesh. Stacked layers (model.scan_layers, no FoE): the
    stacked cache of eval/decode_scan.py, per stack per block (k, v) [repeats, b, max_len, heads, dim]
    (scan=False: the per-layer cache of the unrolled loop anyway; None: scanned_decode(model))."""
    if scanned_decode(model) if scan is None else scan:
        return init_stacked_cache(model, batch, max_len, layout)
    d = model.cfg.model.d_model
    hg = model.cfg.moe.num_groups
    cache = []
    for block in model.blocks():
        if hg > 1:
            qkv = partial(group_qkv, block.attn, num_groups=hg)
            x = jax.ShapeDtypeStruct((hg, batch, 1, d), jnp.float32)
        else:
            qkv, x = block.attn.qkv, jax.ShapeDtypeStruct((batch, 1, d), jnp.float32)
        q, k, v = jax.eval_shape(qkv, x, jax.ShapeDtypeStruct((batch, 1), jnp.int32))
        rows = k.shape[0]
        ks, vs = (rows, max_len) + k.shape[2:], (rows, max_len) + v.shape[2:]
        if layout is None:
            cache.append((jnp.zeros(ks, k.dtype), jnp.zeros(vs, v.dtype)))
            continue
        ks = ks[:2] + (layout.cache_heads(model.cfg.model, ks[2]),) + ks[3:]
        vs = vs[:2] + (layout.cache_heads(model.cfg.model, vs[2]),) + vs[3:]
        sh = layout.cache_sharding()
        cache.append((jnp.zeros(ks, k.dtype, device=sh), jnp.zeros(vs, v.dtype, device=sh)))
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


def slot_positions(start: jax.Array, t: int, max_len: int, pad: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Positions of the new tokens [b, t] (slot - pad, pad queries at 0) and of every cache slot
    [b, max_len] after writing slots [start, start + t) (slot - pad; FAR for pad and empty slots)."""
    slot = start + jnp.arange(t, dtype=jnp.int32)
    positions = jnp.maximum(slot[None, :] - pad[:, None], 0)
    slots = jnp.arange(max_len, dtype=jnp.int32)[None, :]
    valid = (slots < start + t) & (slots >= pad[:, None])
    return positions, jnp.where(valid, slots - pad[:, None], FAR)


def decode_step(model, tokens: jax.Array, start: jax.Array, cache: tuple, farskip: FarSkipConfig,
                pad: Optional[jax.Array] = None, layout=None, scan: Optional[bool] = None):
    """Run tokens [b, t] in cache slots start..start+t-1 against the cache -> (logits [b, t, V] f32, cache).

    The model's own forward (its streams; FoE's group sums) with each layer's attention replaced by
    one that writes the new keys/values into cache slots [start, start + t) and reads every slot;
    slots < start must hold earlier tokens. pad [b]: left-pad tokens per row (module doc); layout:
    parallel/inference.TpEpLayout (tensor-parallel cached attention), None = one program as is.
    Stacked layers (model.scan_layers, no FoE): one scan per stack and run of equal connectivity
    over the whole stacked weights and the stacked cache (eval/decode_scan.py); else (or scan=False:
    the former program of a stacked model, for comparison) the unrolled loop over the model's layers."""
    b, t = tokens.shape
    hg = model.cfg.moe.num_groups
    pad = jnp.zeros((b,), jnp.int32) if pad is None else pad.astype(jnp.int32)
    if scanned_decode(model) if scan is None else scan:
        positions, k_pos = slot_positions(start, t, cache[0][0][0].shape[2], pad)
        return scanned_decode_step(model, tokens, positions, start, cache, farskip,
                                   lambda layer: _cache_mask(model, layer, positions, k_pos), layout)
    positions, k_pos = slot_positions(start, t, cache[0][0].shape[1], pad)
    q_pos, kv_pos = (jnp.tile(positions, (hg, 1)), jnp.tile(k_pos, (hg, 1))) if hg > 1 else (positions, k_pos)
    blocks = model.blocks()  # the layers (FoE under model.scan_layers: per-layer views of the stacks)
    new_cache = [None] * len(blocks)

    def cached_attention(i, attn):
        def fn(xn):  # normalised attention input ([b, t, d], FoE [H, b, t, d]) -> attention output
            mask = _cache_mask(model, i, q_pos, kv_pos)
            if layout is not None:
                o, new_cache[i] = layout.cached_attention(attn, xn, positions, cache[i], start, mask)
                return o
            q, k, v = group_qkv(attn, xn, positions, hg) if hg > 1 else attn.qkv(xn, positions)
            new_cache[i] = kc, vc = _write_cache(cache[i], k, v, start)
            o = attention_core(q, kc, vc, mask, attn.scale)
            return group_project_out(attn, o, xn, hg) if hg > 1 else attn.project_out(o, xn)
        return fn

    out = model(tokens, positions, farskip=farskip,
                attention_fns=[cached_attention(i, blk.attn) for i, blk in enumerate(blocks)])
    return out.logits, tuple(new_cache)


def make_decode_fn(graphdef, farskip: FarSkipConfig, layout=None, scan: Optional[bool] = None, jit: bool = True):
    """jitted fn(state, tokens [b, t], start [], cache, pad [b]) -> (logits, cache); state = nnx
    state of the model. With a layout, compiled with its compiler options (layout.compiler_options).
    scan: as decode_step (None: scanned when the model's layers are stacked); jit=False: the plain
    function (e.g. for jax.make_jaxpr)."""

    def fn(state, tokens, start, cache, pad):
        return decode_step(nnx.merge(graphdef, state), tokens, start, cache, farskip, pad, layout, scan)

    if not jit:
        return fn

    opts = layout.compiler_options() if layout is not None else None
    return jax.jit(fn, donate_argnums=3, compiler_options=opts)


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
             top_p: float = 1.0, seed: int = 0, eos_id: Optional[int] = None, decode_fn=None, layout=None,
             pad_id: int = 0) -> Generation:
    """Generate `max_new_tokens` after prompt [b, P] or a list of b prompts of any lengths (see the
    module docstring). `model`: a Transformer (on a layout: from parallel.inference.inference_model).
    Sampling (temperature > 0, top_p) draws from jax.random.key(seed): the same seed gives the same
    tokens, on one device or a mesh."""
    fs = farskip if farskip is not None else model.cfg.farskip
    prompt_np, pad_np = pad_prompts(prompt, pad_id)
    b, p = prompt_np.shape
    graphdef, state = nnx.split(model)
    fn = decode_fn or make_decode_fn(graphdef, fs, layout)
    put = (lambda x: jnp.asarray(x)) if layout is None else (lambda x: jax.device_put(x, layout.batch_sharding(x.ndim)))
    pad = put(pad_np)
    cache = init_cache(model, b, p + max_new_tokens, layout)
    key = jax.random.key(seed)
    logits, cache = fn(state, put(prompt_np), jnp.int32(0), cache, pad)
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
        logits, cache = fn(state, put(np.asarray(nxt[:, None], np.int32)), jnp.int32(p + i), cache, pad)
        last = logits[:, -1]
    new = np.stack(out_tokens, axis=1) if out_tokens else np.zeros((b, 0), np.int32)
    return Generation(tokens=np.concatenate([prompt_np, new], axis=1),
                      logits=np.stack(out_logits, axis=1) if out_logits else np.zeros((b, 0, 0), np.float32),
                      pad=pad_np, lengths=p - pad_np)

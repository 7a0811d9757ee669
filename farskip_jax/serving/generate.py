"""Autoregressive generation with a KV cache that honours the model's connectivity.

Every stream of FarSkip connectivity (docs/design.md section 1) is per token: the streams of token j
depend only on token j's own sub-block outputs, and tokens interact only inside attention (through
keys/values). So a decode step runs the SAME stream logic (connectivity/streams.py `Streams`) over the
new tokens only, with attention reading the cached keys/values of all earlier tokens. The cache
holds, per layer, k [batch, max_len, kv_heads, head_dim] and v [batch, max_len, kv_heads, v_dim]
(MLA: the decompressed per-head keys/values, not the latent; simple and exact, not memory-lean).
A decode step is the model's own forward (the one layer loop, model/layer_loop.py) with each layer's
attention swapped for a cached one (the `attention` hook) and the cache as the loop's per-layer
side state, so the streams are never written twice. Federation of Experts (runtime.num_groups > 1) runs
its FoE step the same way, each group's heads reading the cache rows of its own representation.

Stacked layers (`runtime.scan_layers`, docs/scan.md): the cache is stacked like the weights (per stack,
per block q, [repeats, ...]) and the decode step is a scan per stack and run of equal connectivity
over layer INDICES: each iteration indexes its layer's weights and cache row inside the loop, the
stacked cache is carried and written in place (XLA:GPU still copies a row into a buffer of its own
where a cuBLAS GEMM reads it: docs/inference.md), and no layer's weights are sliced out of a stack
outside the loop. `scan=False` runs the same stacked model unrolled over per-layer views (a static
slice, i.e. a copy, of every layer's weights per call: the comparison program); FoE always does.

    out = generate(model, prompt_bp, max_new_tokens=32)                   # greedy, cfg.farskip
    out = generate(model, prompt_bp, 32, farskip=FarSkipConfig(), temperature=0.8, top_p=0.9, seed=1)
    out = generate(model, [[5, 6, 7], [8, 9]], 16, layout=TpEpLayout(mesh))   # ragged, on a mesh
    out.tokens [b, P + new] (rows stop at eos_id: later tokens are eos), out.logits [b, new, V]

Requests of different lengths: a list of token sequences is left-padded to the longest, P (`pad_id`;
`out.pad` [b] pad tokens per row, `out.lengths` [b] prompt lengths). Row j's token in cache slot i
sits at position i - pad[j]; pad slots are never keys (position FAR) and pad queries sit at position
0, so a row's tokens see exactly its own prompt: its logits equal its own unpadded full forward.
Every row writes slot P + n at decode step n. The prefill handles all P slots in one call.

On a mesh (`layout`, serving/tp_ep.py TpEpLayout, the paper's TP-attention / replicated-MoE
serving layout): the model must come from serving.tp_ep.inference_model; attention heads and
the cache's heads are split over `tensor`, rows over `data`; the decode step is the same program.
Federation of Experts on its own GPUs per group (serving/foe.FoELayout, model from
foe_inference_model): the cache rows of group h on its devices, the model's own FoE attention.
A dropless MoE (capacity_factor null) gives exactly the full forward; with a capacity, tokens routed
together can drop differently than in a full-sequence forward.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from farskip_jax.config import FarSkipConfig
from farskip_jax.errors import ConfigError
from farskip_jax.model.attention import KVCache
from farskip_jax.model.stacking import plan_segments

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


def _entry_shapes(model, batch: int, max_len: int) -> list:
    """Per layer: (k, v) ShapeDtypeStructs of its cache entry [rows, max_len, heads, dim] on one device
    (FoE: rows = H*b, group h's heads of sequence j at row h*b + j)."""
    d, hg = model.cfg.model.d_model, model.cfg.runtime.num_groups
    x = jax.ShapeDtypeStruct((batch, 1, d) if hg == 1 else (hg, batch, 1, d), jnp.float32)
    pos = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
    out = []
    for blk in model.blocks():
        _, k, v = jax.eval_shape(lambda x, p, a=blk.attn: a.qkv(x, p) if hg == 1 else a.qkv(x, p, hg), x, pos)
        out.append(tuple(jax.ShapeDtypeStruct((a.shape[0], max_len) + a.shape[2:], a.dtype) for a in (k, v)))
    return out


def stacked_cache_shapes(cfg, entry_shapes) -> tuple:
    """Per stack, per block q: (k shape, v shape) with the leading repeats axis; entry_shapes(layer)
    -> (k shape, v shape) of one layer's entry."""
    return tuple(tuple(tuple((seg.repeats,) + tuple(s) for s in entry_shapes(seg.layer(q, 0)))
                       for q in range(seg.period)) for seg in plan_segments(cfg))


def init_cache(model, batch: int, max_len: int, layout=None) -> tuple:
    """Zero KV cache in the dtype the attention produces. Unstacked model: per layer (k [b, max_len, kv, d],
    v [b, max_len, kv, dv]). Stacked layers (runtime.scan_layers): per stack, per block q, (k, v)
    [repeats, b, max_len, heads, dim]. Federation of Experts: rows H*b, heads kv/H. On a `layout`
    (serving/tp_ep.TpEpLayout): heads split over `tensor` (replicated kv heads: one per rank),
    rows over `data`, created in place on the mesh. runtime.micro_batches m > 1 (two-batch overlap): a
    tuple of m such caches of batch / m rows each (micro-batch j = rows j, j + m, ...)."""
    m = model.cfg.runtime.micro_batches
    if m > 1:
        if batch % m:
            raise ConfigError(f"runtime.micro_batches={m} needs a batch that is a multiple of {m}, got {batch} rows")
        return tuple(_init_cache(model, batch // m, max_len, layout) for _ in range(m))
    return _init_cache(model, batch, max_len, layout)


def _init_cache(model, batch: int, max_len: int, layout=None) -> tuple:
    entries = _entry_shapes(model, batch, max_len)

    def zeros(a, stacked: bool, repeats: int = 1):
        shape = ((repeats,) if stacked else ()) + a.shape
        if layout is None:
            return jnp.zeros(shape, a.dtype)
        head = 3 if stacked else 2
        shape = shape[:head] + (layout.cache_heads(model.cfg.model, shape[head]),) + shape[head + 1:]
        return jnp.zeros(shape, a.dtype, device=layout.stacked_cache_sharding() if stacked else layout.cache_sharding())

    if not model.scanned:
        return tuple(tuple(zeros(a, False) for a in e) for e in entries)
    return tuple(tuple(tuple(zeros(a, True, seg.repeats) for a in entries[seg.layer(q, 0)])
                       for q in range(seg.period)) for seg in plan_segments(model.cfg))


def slot_positions(start: jax.Array, t: int, max_len: int, pad: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Positions of the new tokens [b, t] (slot - pad, pad queries at 0) and of every cache slot
    [b, max_len] after writing slots [start, start + t) (slot - pad; FAR for pad and empty slots)."""
    slot = start + jnp.arange(t, dtype=jnp.int32)
    positions = jnp.maximum(slot[None, :] - pad[:, None], 0)
    slots = jnp.arange(max_len, dtype=jnp.int32)[None, :]
    valid = (slots < start + t) & (slots >= pad[:, None])
    return positions, jnp.where(valid, slots - pad[:, None], FAR)


def decode_step(model, tokens: jax.Array, start: jax.Array, cache: tuple, farskip: FarSkipConfig,
                pad: Optional[jax.Array] = None, scan: Optional[bool] = None):
    """Run tokens [b, t] in cache slots start..start+t-1 against the cache -> (logits [b, t, V] f32, cache).

    The model's own forward (its streams; FoE's group sums; a serving layout's step) with a KVCache:
    each layer's attention writes the new keys/values into cache slots [start, start + t) and reads
    every slot; slots < start must hold earlier tokens. pad [b]: left-pad tokens per row (module doc).
    scan (stacked layers): scans over layer indices (default) or False: unrolled per-layer views."""
    b, t = tokens.shape
    pad = jnp.zeros((b,), jnp.int32) if pad is None else pad.astype(jnp.int32)
    m = model.cfg.runtime.micro_batches
    caches = list(cache) if m > 1 else [cache]  # one per micro-batch
    max_len = (caches[0][0][0][0] if model.scanned else caches[0][0][0]).shape[-3]
    positions, k_pos = slot_positions(start, t, max_len, pad)
    layers = [c if model.scanned else tuple((entry,) for entry in c) for c in caches]
    kv = KVCache(layers=tuple(layers) if m > 1 else layers[0], start=start, key_positions=k_pos, scan=scan is not False)
    out = model(tokens, positions, farskip=farskip, cache=kv)
    new = [sd if model.scanned else tuple(g[0] for g in sd) for sd in (out.cache.layers if m > 1 else [out.cache.layers])]
    return out.logits, tuple(new) if m > 1 else new[0]


def make_decode_fn(graphdef, farskip: FarSkipConfig, layout=None, scan: Optional[bool] = None, jit: bool = True):
    """jitted fn(state, tokens [b, t], start [], cache, pad [b]) -> (logits, cache); state = nnx
    state of the model. With a layout, compiled with its compiler options (layout.compiler_options).
    scan: as decode_step; jit=False: the plain function (e.g. for jax.make_jaxpr)."""

    def fn(state, tokens, start, cache, pad):
        return decode_step(nnx.merge(graphdef, state), tokens, start, cache, farskip, pad, scan)

    if not jit:
        return fn

    opts = layout.compiler_options() if layout is not None else None
    return jax.jit(fn, donate_argnums=3, compiler_options=opts)


def check_rows(rows: int, layout, micro_batches: int = 1) -> None:
    """ConfigError unless `rows` requests split evenly over the devices the layout splits a batch's
    rows over (each micro-batch's rows, under two-batch overlap)."""
    spec = layout.batch_sharding(1).spec[0]
    n = math.prod(layout.mesh.shape[a] for a in (spec if isinstance(spec, tuple) else (spec,)) if a)
    if rows % (n * micro_batches):
        each = f" in each of runtime.micro_batches={micro_batches}" if micro_batches > 1 else ""
        raise ConfigError(f"the layout splits a batch's rows over {n} devices{each}, but there are {rows} requests; "
                          f"give a multiple of {n * micro_batches} prompts")


def check_sampling(max_new_tokens: int, temperature: float, top_p: float) -> None:
    """ConfigError naming the setting when generation cannot run as asked: a negative token count, a
    negative temperature, or a top-p outside (0, 1] (0 keeps no token at all)."""
    if max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens={max_new_tokens} must be >= 0 (eval.max_new_tokens: tokens to generate)")
    if not temperature >= 0:
        raise ConfigError(f"temperature={temperature} must be >= 0 (eval.temperature: 0 = greedy, > 0 = sampling)")
    if not 0.0 < top_p <= 1.0:
        raise ConfigError(f"top_p={top_p} must be in (0, 1] (eval.top_p: the probability mass sampling keeps; "
                          "1 = every token)")


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
    module docstring). `model`: a Transformer (on a layout: from serving.tp_ep.inference_model).
    Sampling (temperature > 0, top_p) draws from jax.random.key(seed): the same seed gives the same
    tokens, on one device or a mesh."""
    check_sampling(max_new_tokens, temperature, top_p)
    fs = farskip if farskip is not None else model.cfg.farskip
    prompt_np, pad_np = pad_prompts(prompt, pad_id)
    b, p = prompt_np.shape
    if layout is not None:
        check_rows(b, layout, model.cfg.runtime.micro_batches)
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

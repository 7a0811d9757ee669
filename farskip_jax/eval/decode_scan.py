"""KV-cache prefill and decode of a model with stacked layers (`model.scan_layers`), as a scan.

Under scan_layers the parameters of each stack (model/stacking.py) carry a leading "layers" axis.
The unrolled decode of eval/generate.py (now FoE and `scan=False` only) runs over per-layer views
(`model.blocks()`): one static slice, i.e. a copy, of every layer's weights per call. This module
runs each stack as `jax.lax.scan` instead, as Transformer._scanned does for the full forward:

- the cache of a stack is stacked on the same axis: per stack, per block q of its period,
  (k [repeats, b, max_len, kv_heads, head_dim], v [repeats, b, max_len, kv_heads, v_dim]);
  `init_stacked_cache` builds it, `stacked_cache_shapes` gives its shapes from the config;
- the stacked cache is carried (with the streams): iteration r writes the new keys/values of layer
  start + r * period + q at slots [start, start + t) in place (dynamic-update-slice of the carried
  buffer) and reads its layer's cache; nothing is copied in or out of the loop at the JAX level
  (XLA:GPU still copies a row into a buffer of its own where a cuBLAS GEMM reads it: docs/inference.md);
- the stacked weights enter the loop whole: the scan runs over layer indices, and each iteration
  indexes its layer's weights inside the body (`layer_at`); no slice of a stack outside the loop;
- connectivity is static in the body: each stack's repeats are split into maximal runs of equal
  FarSkipConfig.layer_inputs (a stack split by e.g. farskip.layers=last:2 gives one scan per run,
  each over the same whole stacked weights with its own index range); the carry is the padded
  `Streams` (model/connectivity.py), exact since x + 0 == x, holding only the streams a layer still
  to run reads (`prune`: the others are scalar zeros; XLA removes dead streams of an unrolled
  program, but copies every carried one of a loop; standard connectivity carries `full` only);
- on the tp_ep layout (parallel/inference.py) the cached attention of each iteration is
  `TpEpLayout.cached_attention(..., layer=index)` (heads over `tensor`, stacked cache sharded
  P(None, data, None, tensor, None)); the MoE runs the model's own routed backend.

Federation of Experts (moe.num_groups > 1) is not scanned (its forward is per layer): it keeps the
unrolled path and the per-layer cache. Used by eval/generate.py (`decode_step`, `init_cache`):

    if scanned_decode(model): logits, cache = scanned_decode_step(model, tokens, positions, start, cache,
                                                                  farskip, mask_of, layout)
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from farskip_jax.config import FarSkipConfig
from farskip_jax.model.attention import attention_core
from farskip_jax.model.connectivity import Streams
from farskip_jax.model.stacking import (LAYER_AXIS, connectivity_runs, is_variable, plan_segments, scan_scope,
                                        stable_carry)



def scanned_decode(model) -> bool:
    """Whether `model` decodes through this module: stacked layers, no Federation of Experts."""
    return bool(model.cfg.model.scan_layers) and model.cfg.moe.num_groups == 1


def layer_at(state, index):
    """One layer of a stacked nnx state: each Variable's value at `index` (an int or a traced scalar)
    of its leading layer axis, with "layers" dropped from its axes metadata."""

    def one(v):
        axes = v.get_metadata().get("axes")
        x = jax.lax.dynamic_index_in_dim(v.get_value(), index, 0, keepdims=False)
        if axes and axes[0] == LAYER_AXIS:
            return v.replace(x, axes=tuple(axes[1:]))
        return v.replace(x)

    return jax.tree.map(one, state, is_leaf=is_variable)


def stacked_cache_shapes(cfg, entry_shapes: Callable[[int], tuple]) -> tuple:
    """Per stack, per block q: (k shape, v shape) with the leading repeats axis; entry_shapes(layer)
    -> (k shape, v shape) of one layer's entry."""
    out = []
    for seg in plan_segments(cfg):
        out.append(tuple(tuple((seg.repeats,) + tuple(s) for s in entry_shapes(seg.layer(q, 0)))
                         for q in range(seg.period)))
    return tuple(out)


def init_stacked_cache(model, batch: int, max_len: int, layout=None) -> tuple:
    """Zero stacked cache of a scanned model: per stack, per block q, (k, v) [repeats, b, max_len,
    heads, dim] in the dtype its attention produces; on a layout, heads over `tensor` (replicated kv
    heads: one per rank) and rows over `data`, created in place (layout.stacked_cache_sharding)."""
    d = model.cfg.model.d_model
    x = jax.ShapeDtypeStruct((batch, 1, d), jnp.float32)
    pos = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
    cache = []
    for st in model.stacks:
        per_q = []
        for blk in st.blocks:
            gd, state = nnx.split(blk.attn)
            _, k, v = jax.eval_shape(lambda s, x, p, gd=gd: nnx.merge(gd, layer_at(s, 0)).qkv(x, p), state, x, pos)
            shapes = [(st.repeats, batch, max_len) + a.shape[2:] for a in (k, v)]
            if layout is None:
                per_q.append(tuple(jnp.zeros(s, a.dtype) for s, a in zip(shapes, (k, v))))
                continue
            sh = layout.stacked_cache_sharding()
            shapes = [s[:3] + (layout.cache_heads(model.cfg.model, s[3]),) + s[4:] for s in shapes]
            per_q.append(tuple(jnp.zeros(s, a.dtype, device=sh) for s, a in zip(shapes, (k, v))))
        cache.append(tuple(per_q))
    return tuple(cache)


def _cached_attention(attn, positions, mask, entry, start, layer, layout, sink: dict):
    """fn(normalised attention input [b, t, d]) -> attention output of one layer of a stack: writes
    its keys/values into the stacked entry at [layer, :, start:start + t] and attends over its layer's
    slots; the updated entry goes to sink["entry"]."""

    def fn(xn):
        if layout is not None:
            o, sink["entry"] = layout.cached_attention(attn, xn, positions, entry, start, mask, layer=layer)
            return o
        q, k, v = attn.qkv(xn, positions)
        kc = jax.lax.dynamic_update_slice(entry[0], k[None].astype(entry[0].dtype), (layer, 0, start, 0, 0))
        vc = jax.lax.dynamic_update_slice(entry[1], v[None].astype(entry[1].dtype), (layer, 0, start, 0, 0))
        sink["entry"] = (kc, vc)
        kl = jax.lax.dynamic_index_in_dim(kc, layer, 0, keepdims=False)
        vl = jax.lax.dynamic_index_in_dim(vc, layer, 0, keepdims=False)
        return attn.project_out(attention_core(q, kl, vl, mask, attn.scale), xn)

    return fn


def live_streams(kinds_from: set) -> dict:
    """Which Streams fields a carry needs when the attention inputs `kinds_from` (the attn kinds of
    every layer still to run) are read: the MoE reads `full` only, `partial` reads no_routed,
    `outdated` no_moe; pending routed outputs feed both, pending shared outputs no_moe only."""
    partial, outdated = "partial" in kinds_from, "outdated" in kinds_from
    return dict(no_routed=partial, no_moe=outdated, pending_routed=partial or outdated, pending_shared=outdated)


def prune(streams: Streams, live: dict) -> Streams:
    """`streams` with the fields no later layer reads replaced by scalar zeros: a scan carry then
    holds (and XLA copies) only the live streams; the live ones are untouched (exact)."""
    zero = jnp.zeros((), streams.full.dtype)
    out = {}
    for name, keep in live.items():
        if not keep:
            v = getattr(streams, name)
            out[name] = tuple(zero for _ in v) if isinstance(v, tuple) else zero
    return streams.replace(**out) if out else streams


def scanned_decode_step(model, tokens: jax.Array, positions: jax.Array, start: jax.Array, cache: tuple,
                        farskip: FarSkipConfig, mask_of: Callable[[int], jax.Array], layout=None):
    """tokens [b, t] at `positions` [b, t] into cache slots [start, start + t) of the stacked `cache`
    (init_stacked_cache) -> (logits [b, t, V] f32 via model.output, new cache). mask_of(layer) -> the
    [b, 1, t, max_len] mask of that layer's queries over the cache slots (alike layers of a stack share it)."""
    n = model.cfg.model.num_layers
    streams = Streams.init(model.embed(tokens), farskip.skip_distance)
    attn_kinds = [farskip.layer_inputs(i, n)[0] for i in range(n)]
    outs, new_cache = [], []
    for s, st in enumerate(model.stacks):
        seg = st.segment
        gds, states, is_moe = st.split_blocks()
        masks = [mask_of(seg.layer(q, 0)) for q in range(seg.period)]
        kinds = st.connectivity(farskip, n)
        entries = cache[s]
        for r0, r1 in connectivity_runs(kinds):
            kind = kinds[r0]
            live = live_streams(set(attn_kinds[seg.layer(0, r0):]))  # read by this run or any later layer

            def body(carry, r, kind=kind, gds=gds, states=states, masks=masks, live=live):
                streams, entries = carry
                entries, stats = list(entries), []
                for q in range(len(gds)):
                    attn_kind, moe_kind = kind[q]
                    blk = nnx.merge(gds[q], layer_at(states[q], r))
                    sink: dict = {}
                    fn = _cached_attention(blk.attn, positions, masks[q], entries[q], start, r, layout, sink)
                    with jax.named_scope(f"layer_q{q}"):
                        out = blk(streams.attn_input(attn_kind), streams.full, positions, None, moe_kind,
                                  attention_fn=fn)
                        streams = prune(streams.update(out.attn, out.shared, out.routed).padded(), live)
                    entries[q] = sink["entry"]
                    stats.append(out.replace(attn=None, shared=None, routed=None))
                return (streams, tuple(entries)), stats

            with jax.named_scope(f"stack_{s}"), jax.named_scope(scan_scope(seg.layer(0, r0), seg.period)):
                carry = stable_carry(body, (prune(streams.padded(), live), entries), jnp.int32(r0))
                (streams, entries), ys = jax.lax.scan(body, carry, jnp.arange(r0, r1, dtype=jnp.int32))
            for j in range(r1 - r0):
                for q in range(seg.period):
                    outs.append((is_moe[q], jax.tree.map(lambda y: y[j], ys[q])))
        new_cache.append(entries)
    return model.output(streams.full, outs, None, None).logits, tuple(new_cache)

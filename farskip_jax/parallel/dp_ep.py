"""The layer of the dp_ep serving layout (serving/dp_ep.py): SGLang's large-scale expert parallelism.

    attention       data parallel: every device its own requests (batch rows over data x fsdp x
                    expert) and their KV cache rows; the whole attention per device, no collective
    MoE             the training's expert-parallel exchange (parallel/ep.py: `all_to_all`, or
                    `hierarchical`, node-deduplicated as DeepEP's): dispatch -> local experts -> combine
    shared experts  whole on every device, on its own tokens (no collective)

    layer = DpEpLayer(mesh)                    # the Transformer's layer_step on this layout
    model = Transformer(cfg, rngs=..., routed_compute=AllToAllCompute(mesh), layer_step=layer)

DpEpStep is the ordinary layer (model/layer_step.py) with two hooks: the attention and the shared
experts run per device (`per_device`: a shard_map over the batch axes with the module's weights
whole). So the only collectives of a layer are its dispatch and combine, and under FarSkip the
attention of layer k+1 (which reads N_k, without the routed output of layer k) does not wait for the
combine of layer k: XLA may run it under the combine (tests/test_dp_ep.py checks the compiled HLO).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from farskip_jax.errors import ConfigError
from farskip_jax.model.attention import LayerCache
from farskip_jax.model.layer_step import LayerStep
from farskip_jax.parallel.mesh import BATCH_AXES, batch_shards


def _rows(ndim: int) -> P:
    """[rows, ...] arrays: rows over the batch axes (each device its own requests); scalars replicated."""
    return P(BATCH_AXES, *([None] * (ndim - 1))) if ndim else P()


def per_device(mesh: Mesh, fn, module, *arrays):
    """fn(module, *arrays) on every device's own rows (arrays [rows, ...] over the batch axes, scalars
    replicated, None passed through), the module's weights whole on every device; outputs likewise."""
    gd, st = nnx.split(module)
    keep = [i for i, a in enumerate(arrays) if a is not None]
    rows, shards = arrays[keep[0]].shape[0], batch_shards(mesh)
    if rows % shards:
        raise ConfigError(f"inference.layout=dp_ep gives each of the data x fsdp x expert = {shards} devices its own "
                          f"requests, but a batch (or micro-batch) has {rows} rows; use a multiple of {shards} rows")

    def body(st, *xs):
        full = list(arrays)
        for i, x in zip(keep, xs):
            full[i] = x
        return fn(nnx.merge(gd, st), *full)

    out_shape = jax.eval_shape(lambda: fn(module, *arrays))
    f = jax.shard_map(body, mesh=mesh, in_specs=(P(), *(_rows(arrays[i].ndim) for i in keep)),
                      out_specs=jax.tree.map(lambda s: _rows(s.ndim), out_shape),
                      check_vma=False)  # model code inside (the attention cores) does not track manual axes
    return f(st, *(arrays[i] for i in keep))


@dataclasses.dataclass(frozen=True)
class DpEpLayer:
    """The dp_ep layer on `mesh` (module doc): calling it builds the layer step of one forward."""

    mesh: Mesh

    def __call__(self, model, positions, segment_ids, farskip, remat, cache=None) -> "DpEpStep":
        return DpEpStep(self.mesh, model, positions, segment_ids, farskip, remat, cache)


class DpEpStep(LayerStep):
    """The ordinary layer with data-parallel attention and local shared experts (module doc)."""

    def __init__(self, mesh: Mesh, model, positions, segment_ids, farskip, remat="none", cache=None):
        super().__init__(model, positions, segment_ids, farskip, remat, cache)
        self.mesh = mesh

    def attention_of(self, site, plan):
        return self.attention

    def ffn_options(self, block, extra, site, plan) -> dict:
        return dict(shared=self.shared) if block.is_moe and block.moe.shared is not None else {}

    def attention(self, attn, xn, positions, segment_ids, cache: Optional[LayerCache] = None):
        """Block.attend's `attention`: xn [b, t, d] -> (out [b, t, d], cache), each device its rows. A
        stacked cache's row is read before the shard_map and written after it (in place, as tp_ep)."""
        if cache is None:
            return per_device(self.mesh, lambda a, x, p, s: a(x, p, s)[0], attn, xn, positions, segment_ids), None

        def cached(a, x, p, k, v, start, mask):
            o, c = a(x, p, None, LayerCache(k, v, start, mask))
            return o, c.written if cache.row is not None else (c.k, c.v)

        k, v = cache.keys_values()
        o, (k, v) = per_device(self.mesh, cached, attn, xn, positions, k, v, cache.start, cache.mask)
        if cache.row is None:
            return o, cache.replace(k=k, v=v)
        o, k, v = jax.lax.optimization_barrier((o, k, v))
        return o, cache.write(k, v)

    def shared(self, moe, x):
        """MoEBlock's shared_fn: the shared experts on every device's own tokens x [b, s, d] (times the
        Qwen2 gate, whose weights are replicated: GSPMD keeps it local)."""
        with jax.named_scope("shared_experts"):
            y = per_device(self.mesh, lambda m, x: m(x), moe.shared, x)
            return y * jax.nn.sigmoid(moe.shared_gate(x)) if moe.shared_gate is not None else y

"""The layer, written once: `LayerStep` runs one layer on the carried streams, for every layout.

    step = LayerStep(model, positions [b, s], segment_ids, farskip, remat="none", cache=None)
    carry = step.init(embedding [b, s, d])
    carry, out, entry = step(block, carry, site, entry)        # the layer loop calls this per layer

The body (`__call__` and `layer`) is the only code that says what a layer does:

    plan   = step.plan(block, carry, site)                  static per-layer choices of a layout
    x      = step.attention_input(carry, site, plan)        the stream attention reads (connectivity)
    a      = block.attend(x, ..., cache, step.attention_of) norm -> attention        (scope attention)
    a, h   = step.attention_sum(a, extra, site, plan)       a layout's collective after attention
    x_moe  = step.moe_input(the MoE's stream of kind)      the stream the MoE reads (Block.layer)
    out    = block.ffn(x_moe, **step.ffn_options(...))      norm -> MoE / MLP        (scope moe | mlp)
    out    = step.finish(out, a, h, site, plan)             where a deferred partial sum goes
    carry  = step.update(carry, out, site)                  the streams take the outputs

under the one remat wrapper (block.remat; no remat while decoding). A layout subclasses LayerStep and
overrides only the hooks it changes: which attention runs and how its output is summed, which routed
compute and shared experts the MoE uses, where a partial sum goes (model/foe.FoEStep for a
Federation of Experts, parallel/tp_ep.TpEpStep for the tp_ep serving layout). The defaults here
are the ordinary layer: one program (or the expert-parallel exchange of the block's routed compute).

Decoding (cache: attention.KVCache): `entry` is the layer's (k, v) cache entry; the step gives the
attention a LayerCache with the layer's mask (`layer_cache`) and returns the updated entry.
"""

from __future__ import annotations

from typing import Any, Optional

import jax

from farskip_jax.config import FarSkipConfig
from farskip_jax.model.attention import KVCache, LayerCache, cache_mask
from farskip_jax.model.block import Block, BlockOutput, remat
from farskip_jax.connectivity.streams import Streams


class LayerStep:
    """The ordinary layer on the streams of connectivity/streams.py (module doc). scannable: whether the
    layer loop may run a stack's layers as a scan with this step."""

    scannable = True

    def __init__(self, model, positions: jax.Array, segment_ids: Optional[jax.Array], farskip: FarSkipConfig,
                 remat: str = "none", cache: Optional[KVCache] = None):
        self.cfg = model.cfg
        self.positions, self.segment_ids, self.farskip = positions, segment_ids, farskip
        self.remat = remat if cache is None else "none"
        self.cache = cache

    # ---- the carry ------------------------------------------------------------------------------

    def init(self, h: jax.Array) -> Streams:
        return Streams.init(h, self.farskip.skip_distance)

    @staticmethod
    def scan_carry(streams: Streams, later_kinds: set) -> Streams:
        return streams.padded().pruned(later_kinds)

    # ---- the body ------------------------------------------------------------------------------

    def __call__(self, block: Block, carry, site, entry=None):
        """One layer -> (carry, BlockOutput, the updated cache entry or None)."""
        plan = self.plan(block, carry, site)
        x, extra = self.attention_input(carry, site, plan)
        cache = None if entry is None else self.layer_cache(block, site, entry)

        def layer(blk, x, full, extra):
            return self.layer(blk, x, full, extra, site, plan, cache)

        out, cache = remat(block, self.remat, layer, x, carry.full, extra)
        return self.update(carry, out, site), out, None if cache is None else (cache.k, cache.v)

    def layer(self, block: Block, x: jax.Array, full: jax.Array, extra, site, plan, cache: Optional[LayerCache]):
        """attention -> MoE / MLP on the streams x (attention's) and full (R_{k-1}) -> (BlockOutput, cache):
        the block's layer body (Block.layer) with this step's hooks."""
        return block.layer(self, x, full, extra, site, plan, cache)

    # ---- hooks: the ordinary layer ----------------------------------------------------------------

    def plan(self, block: Block, carry, site) -> Any:
        """Static per-layer choices of a layout (None: the ordinary layer has none)."""
        return None

    def attention_input(self, carry, site, plan) -> tuple[jax.Array, tuple]:
        """(the stream attention reads, extra arrays the layer needs beyond it and R_{k-1})."""
        return carry.attn_input(site.kinds[0]), ()

    def layer_cache(self, block: Block, site, entry) -> LayerCache:
        """The attention's view of the layer's cache entry (k, v): its row, start and mask."""
        c = self.cache
        mask = cache_mask(self.cfg.model, block.layer_idx, self.cache_rows(self.positions),
                          self.cache_rows(c.key_positions))
        return LayerCache(entry[0], entry[1], c.start, mask, site.row)

    def cache_rows(self, x: jax.Array) -> jax.Array:
        """A cache's rows of a [b, ...] array (the batch's own)."""
        return x

    def attention_of(self, site, plan):
        """attention(attn, xn, positions, segment_ids, cache) -> (out, cache) for Block.attend, or None
        (the block's own attention)."""
        return None

    def attention_sum(self, a: jax.Array, extra, site, plan) -> tuple[Optional[jax.Array], Any]:
        """(the attention output the MoE input and the streams take, anything finish needs)."""
        return a, None

    def moe_input(self, x: jax.Array) -> jax.Array:
        return x

    def ffn_options(self, block: Block, extra, site, plan) -> dict:
        """Keyword arguments of Block.ffn (routed, shared, num_groups, sums)."""
        return {}

    def finish(self, out: BlockOutput, a, held, site, plan) -> BlockOutput:
        return out.replace(attn=a)

    def update(self, carry, out: BlockOutput, site):
        return carry.update(out.attn, out.shared, out.routed)

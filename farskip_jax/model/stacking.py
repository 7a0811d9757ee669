"""Stacked layer parameters for `runtime.scan_layers` and the per-layer <-> stacked conversions.

A model with `scan_layers: true` keeps its blocks as `stacks`, a list of `LayerStack`s; stack s
covers layers [start, start + period * repeats) and holds `period` Blocks whose every parameter
carries a leading "layers" axis of length `repeats`:

    layer  i = start + r * period + q   is   stacks[s].blocks[q]  at index r of the layer axis

`plan_segments` chooses the stacks from the model's shape only (never from the connectivity, so
every checkpoint still loads into every connectivity): layers are alike when they have the same
`layer_signature` (MoE or dense, rope or NoPE, chunked or global attention); a run of alike layers
is one stack of period 1 (DeepSeek-V2-Lite: the dense layer 0 alone, then 26 MoE layers), a
repeating pattern is one stack of that period (Llama-4-Scout: 3 chunked rope layers + 1 NoPE
layer, 12 times). A layer that repeats nothing is a stack of repeats 1 (it runs unrolled).

The per-layer layout ("layers", i, ...) stays the exchange format: HF import/export name layers
by index, and checkpoints of either layout convert through loading/layer_keys.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

LAYER_AXIS = "layers"  # logical name of the stacked layer axis (parallel/sharding.py: never sharded)


def scan_scope(first: int, period: int) -> str:
    """Named scope of the scan of a run whose first layer is `first` (the training scan in
    model/layer_loop.py, training and decoding): inside it, block q of iteration k is layer
    first + k * period + q, named `layer_q{q}` (analysis/loop_schedule.py renames it `layer_{i}`
    when it unrolls the loop)."""
    return f"scan_L{first}_P{period}"


SCAN_SCOPE = re.compile(r"scan_L(\d+)_P(\d+)")
MAX_PERIOD = 8


@dataclass(frozen=True)
class Segment:
    start: int
    period: int
    repeats: int

    @property
    def stop(self) -> int:
        return self.start + self.period * self.repeats

    def layer(self, q: int, r: int) -> int:
        return self.start + r * self.period + q

    def locate(self, i: int) -> tuple[int, int]:
        """(q, r) of layer i."""
        r, q = divmod(i - self.start, self.period)
        return q, r


def layer_signature(cfg, i: int) -> tuple:
    """What makes layer i's Block differ from another's beyond its weights (cfg: Config)."""
    m = cfg.model
    chunked = bool(m.attention_chunk_size) and (m.chunked_layers is None or i in m.chunked_layers)
    return (bool(cfg.moe.num_experts) and m.is_moe_layer(i), i in m.nope_layers, chunked)


def plan_segments(cfg) -> tuple[Segment, ...]:
    """Greedy cover of the layers by stacks: at each start the (period, repeats) covering the most
    layers with repeats >= 2 (smallest period on ties), else a single layer."""
    n = cfg.model.num_layers
    sig = [layer_signature(cfg, i) for i in range(n)]
    out, i = [], 0
    while i < n:
        best = Segment(i, 1, 1)
        for p in range(1, MAX_PERIOD + 1):
            r = 1
            while i + (r + 1) * p <= n and sig[i + r * p:i + (r + 1) * p] == sig[i:i + p]:
                r += 1
            if r >= 2 and p * r > best.period * best.repeats:
                best = Segment(i, p, r)
        out.append(best)
        i = best.stop
    return tuple(out)


def is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def connectivity_runs(kinds: list) -> list[tuple[int, int]]:
    """[(r0, r1)] maximal runs of equal entries of `kinds` (a stack's repeats with the same static
    connectivity: one scan each)."""
    out, r0 = [], 0
    for r in range(1, len(kinds) + 1):
        if r == len(kinds) or kinds[r] != kinds[r0]:
            out.append((r0, r))
            r0 = r
    return out


def stable_carry(body, carry, x0):
    """`carry` cast to the dtypes one `body(carry, x0)` step gives back (lax.scan needs carry in ==
    carry out; a stream may widen after the first layer, e.g. bf16 + f32 -> f32, as in the loop)."""
    for _ in range(3):
        out = jax.eval_shape(lambda c: body(c, x0)[0], carry)
        if jax.tree.all(jax.tree.map(lambda a, b: a.dtype == b.dtype, carry, out)):
            return carry
        carry = jax.tree.map(lambda a, b: a.astype(b.dtype), carry, out)
    return carry


def _with_axes(v: nnx.Variable, value, axes: Optional[tuple]) -> nnx.Variable:
    return v.replace(value) if axes is None else v.replace(value, axes=axes)


def stack_modules(mods: Sequence[nnx.Module]) -> nnx.Module:
    """One module like mods[0] whose Variables are the stacked values of every module's (new leading
    axis, logical name "layers" prepended to `axes`)."""
    graphdef, first = nnx.split(mods[0])
    states = [first] + [nnx.split(m)[1] for m in mods[1:]]

    def stack(*vs):
        axes = vs[0].get_metadata().get("axes")
        return _with_axes(vs[0], jnp.stack([v.get_value() for v in vs]),
                          None if axes is None else (LAYER_AXIS, *axes))

    return nnx.merge(graphdef, jax.tree.map(stack, *states, is_leaf=is_variable))


def slice_state(state: Any, index) -> Any:
    """`state` (an nnx.State of stacked Variables) at `index` of the layer axis: an int or a traced
    scalar (an indexed scan's row) drops the axis (and "layers" from `axes`), a slice keeps it."""

    def one(v):
        if isinstance(index, slice):
            return v.replace(v.get_value()[index])
        axes = v.get_metadata().get("axes")
        x = v.get_value()[index] if isinstance(index, int) else \
            jax.lax.dynamic_index_in_dim(v.get_value(), index, 0, keepdims=False)
        return _with_axes(v, x, tuple(axes[1:]) if axes and axes[0] == LAYER_AXIS else axes)

    return jax.tree.map(one, state, is_leaf=is_variable)


class LayerStack(nnx.Module):
    """`period` Blocks with parameters stacked over `repeats` layers (module docstring)."""

    def __init__(self, segment: Segment, blocks: Sequence[nnx.Module]):
        """blocks: the segment's per-layer Blocks in layer order."""
        self.start, self.period, self.repeats = segment.start, segment.period, segment.repeats
        p, r = segment.period, segment.repeats
        self.blocks = nnx.List([stack_modules([blocks[k * p + q] for k in range(r)]) for q in range(p)])

    @property
    def segment(self) -> Segment:
        return Segment(self.start, self.period, self.repeats)

    def split_blocks(self) -> tuple[list, list, list]:
        """(graphdefs, stacked states, is_moe) of the `period` stacked Blocks, for a scan body."""
        split = [nnx.split(b) for b in self.blocks]
        return [g for g, _ in split], [x for _, x in split], [b.is_moe for b in self.blocks]

    def layer(self, q: int, r: int) -> nnx.Module:
        """A Block of layer start + r*period + q whose Variables are slices of the stacked ones (a view:
        writes to it do not reach the stack; `write_layers` puts views back)."""
        graphdef, state = nnx.split(self.blocks[q])
        blk = nnx.merge(graphdef, slice_state(state, r))
        i = self.segment.layer(q, r)
        blk.layer_idx = i
        if hasattr(blk, "attn") and hasattr(blk.attn, "layer_idx"):
            blk.attn.layer_idx = i
        return blk

    def write_layers(self, views: Sequence[nnx.Module]) -> None:
        """Restack per-layer views (layer order) into this stack's Variables."""
        p = self.period
        for q in range(p):
            rows = [nnx.state(views[r * p + q]) for r in range(self.repeats)]
            target = nnx.state(self.blocks[q])
            new = jax.tree.map(lambda t, *vs: t.replace(jnp.stack([v.get_value() for v in vs])), target, *rows,
                               is_leaf=is_variable)
            nnx.update(self.blocks[q], new)

"""Stacked layer parameters for `model.scan_layers` and the per-layer <-> stacked conversions.

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
by index and checkpoints of either layout convert with `stack_flat` / `unstack_flat` (any key of
the form `<prefix>.layers.<i>.<rest>` <-> `<prefix>.stacks.<s>.blocks.<q>.<rest>`, optimizer
moments included).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

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
    """`state` (an nnx.State of stacked Variables) at `index` of the layer axis: an int drops the axis
    (and "layers" from `axes`), a slice keeps it."""

    def one(v):
        axes = v.get_metadata().get("axes")
        if isinstance(index, int) and axes is not None and axes and axes[0] == LAYER_AXIS:
            axes = tuple(axes[1:])
        elif not isinstance(index, int):
            axes = None
        return _with_axes(v, v.get_value()[index], axes)

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

    def connectivity(self, farskip, num_layers: int) -> list[tuple]:
        """Per repeat r: the (attn_input, moe_input) of each of its `period` layers under `farskip`."""
        seg = self.segment
        return [tuple(farskip.layer_inputs(seg.layer(q, r), num_layers) for q in range(seg.period))
                for r in range(seg.repeats)]

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


# --------------------------------------------------------------------------------------------------
# flat-dict conversions (checkpoints, HF import/export)
# --------------------------------------------------------------------------------------------------

_LAYER_KEY = re.compile(r"(^|\.)layers\.(\d+)\.")
_STACK_KEY = re.compile(r"(^|\.)stacks\.(\d+)\.blocks\.(\d+)\.")


def stacked_key(key: str, segments: Sequence[Segment]) -> tuple[str, int]:
    """'p.layers.<i>.rest' -> ('p.stacks.<s>.blocks.<q>.rest', r); keys without a layer index -> (key, -1)."""
    m = _LAYER_KEY.search(key)
    if not m:
        return key, -1
    i = int(m.group(2))
    for s, seg in enumerate(segments):
        if seg.start <= i < seg.stop:
            q, r = seg.locate(i)
            return key[:m.start()] + f"{m.group(1)}stacks.{s}.blocks.{q}." + key[m.end():], r
    raise ValueError(f"layer {i} of {key!r} is outside the model's {segments[-1].stop} layers")


def layer_key(key: str, segments: Sequence[Segment]) -> list[tuple[str, int]]:
    """'p.stacks.<s>.blocks.<q>.rest' -> [('p.layers.<i>.rest', r) for every r of the stack]."""
    m = _STACK_KEY.search(key)
    if not m:
        return [(key, -1)]
    seg, q = segments[int(m.group(2))], int(m.group(3))
    return [(key[:m.start()] + f"{m.group(1)}layers.{seg.layer(q, r)}." + key[m.end():], r)
            for r in range(seg.repeats)]


def is_stacked_layout(keys) -> bool:
    return any(_STACK_KEY.search(k) for k in keys)


def is_layer_layout(keys) -> bool:
    return any(_LAYER_KEY.search(k) for k in keys)


def stack_flat(flat: dict, segments: Sequence[Segment], stack: Callable = jnp.stack) -> dict:
    """{per-layer dotted key: array} -> {stacked key: stack([arrays of its layers])}."""
    groups: dict[str, dict[int, Any]] = {}
    out = {}
    for k, v in flat.items():
        sk, r = stacked_key(k, segments)
        if r < 0:
            out[k] = v
        else:
            groups.setdefault(sk, {})[r] = v
    for sk, rows in groups.items():
        out[sk] = stack([rows[r] for r in range(len(rows))])
    return out


def unstack_flat(flat: dict, segments: Sequence[Segment]) -> dict:
    """{stacked key: array [repeats, ...]} -> {per-layer key: array}."""
    out = {}
    for k, v in flat.items():
        for lk, r in layer_key(k, segments):
            out[lk] = v if r < 0 else v[r]
    return out


def segments_from_keys(shapes: dict) -> tuple[Segment, ...]:
    """The segments of a stacked layout read back from {stacked dotted key: shape} (period = number of
    blocks of the stack, repeats = the leading dim), for a checkpoint written with another layout."""
    info: dict[int, tuple[set, int]] = {}
    for k, shape in shapes.items():
        m = _STACK_KEY.search(k)
        if m:
            qs, rep = info.setdefault(int(m.group(2)), (set(), int(shape[0])))
            qs.add(int(m.group(3)))
    out, start = [], 0
    for s in sorted(info):
        qs, rep = info[s]
        out.append(Segment(start, len(qs), rep))
        start += len(qs) * rep
    return tuple(out)


def tuple_path_key(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def key_tuple_path(key: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in key.split("."))


def per_layer_values(flat_state: dict, segments: Optional[Sequence[Segment]]) -> dict:
    """{per-layer path tuple: fn() -> array} over a flat nnx state {path tuple: Variable} of either
    layout (segments None: already per-layer). A stacked Variable yields one fn per layer that slices
    its row (on device: only that layer's tensor is ever fetched)."""
    out = {}
    for path, var in flat_state.items():
        if segments is None:
            out[tuple(path)] = var.get_value
            continue
        for lk, r in layer_key(tuple_path_key(path), segments):
            out[key_tuple_path(lk)] = var.get_value if r < 0 else (lambda v=var, r=r: v.get_value()[r])
    return out


def stacked_specs(specs: Sequence, segments: Sequence[Segment]) -> dict:
    """{stacked path tuple: [spec of each row r]} for the HF tensor specs of per-layer paths (a spec
    without a layer index maps to [spec] under its own path)."""
    rows: dict[tuple, dict[int, Any]] = {}
    for s in specs:
        sk, r = stacked_key(tuple_path_key(s.path), segments)
        rows.setdefault(key_tuple_path(sk), {})[max(r, 0)] = s
    return {p: [d[r] for r in range(len(d))] for p, d in rows.items()}

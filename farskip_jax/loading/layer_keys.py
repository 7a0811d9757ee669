"""Per-layer <-> stacked keys of checkpoints and HF folders (runtime.scan_layers, model/stacking.py).

A stacked model keeps layer i = start + r * period + q of stack s as row r of block q's parameters;
the per-layer layout names it by index. Any key of the form `<prefix>.layers.<i>.<rest>` maps to
`<prefix>.stacks.<s>.blocks.<q>.<rest>` and row r, optimizer moments included:

    stack_flat / unstack_flat        {key: array} of one layout -> the other (loading/checkpoint.py)
    per_layer_values                 a model state of either layout, per layer (convert/export.py)
    stacked_specs                    HF tensor specs of per-layer paths grouped per stacked path (loading/hf_folder.py)
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional, Sequence

import jax.numpy as jnp

from farskip_jax.model.stacking import Segment

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

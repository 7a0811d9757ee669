"""How one of our parameters is made from HF tensors and back (slice-aware, one tensor at a time).

A `TensorSpec(path, kind, hf, ...)` maps the parameter at `path` of the NNX state (e.g.
("layers", 0, "attn", "q_proj", "w")) to HF tensor(s). Kinds:

    same      ours = hf                                  (norm scales, biases, embeddings, router bias)
    t         ours [in, out] = hf [out, in].T            (nn.Linear weights)
    experts_t ours [E, a, b] = stack_e(hf_e [b, a].T)    (per-expert nn.Linear weights)
    part      ours = hf[..., start:start+n on `axis`]    (a slice of a fused tensor: Llama-4 gate_up)

`read(ckpt, idx)` returns the slice `idx` (tuple of slices over OUR shape) reading only the matching
part of the HF tensors, which is what `jax.make_array_from_callback` asks for per device shard.
`hf_pieces(arr)` is the inverse for export: [(hf_name, array, (axis, start) or None)].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from farskip_jax.errors import CheckpointError


def _norm(idx, shape) -> tuple[slice, ...]:
    idx = tuple(idx) if idx is not None else ()
    idx = idx + (slice(None),) * (len(shape) - len(idx))
    return tuple(slice(*s.indices(n)) for s, n in zip(idx, shape))


@dataclass(frozen=True)
class TensorSpec:
    path: tuple
    kind: str  # same | t | experts_t | part
    hf: tuple[str, ...]  # one name, or one per expert for experts_t
    shape: tuple[int, ...]  # our shape
    axis: int = -1  # part: axis of the fused HF tensor
    start: int = 0  # part: offset along it
    hf_full: Optional[tuple[int, ...]] = field(default=None)  # part: the fused tensor's full shape

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Expected shape of every HF tensor this spec reads."""
        s = self.shape
        if self.kind == "same":
            return {self.hf[0]: s}
        if self.kind == "t":
            return {self.hf[0]: (s[1], s[0])}
        if self.kind == "experts_t":
            return {name: (s[2], s[1]) for name in self.hf}
        if self.kind == "part":
            return {self.hf[0]: self.hf_full}
        raise ValueError(self.kind)

    def check(self, ckpt) -> None:
        for name, want in self.hf_shapes().items():
            got = ckpt.shape(name)
            if tuple(got) != tuple(want):
                raise CheckpointError(
                    f"shape mismatch for {name!r}: expected {tuple(want)} (for {'.'.join(map(str, self.path))}), "
                    f"found {tuple(got)}; the config.json does not describe these weights")

    def read(self, ckpt, idx=None) -> np.ndarray:
        sl = _norm(idx, self.shape)
        if self.kind == "same":
            return ckpt.read(self.hf[0], sl)
        if self.kind == "t":
            return ckpt.read(self.hf[0], (sl[1], sl[0])).T
        if self.kind == "experts_t":
            names = self.hf[sl[0]]
            parts = [ckpt.read(n, (sl[2], sl[1])).T for n in names]
            return np.stack(parts) if parts else np.zeros((0,) + self.shape[1:], ckpt.dtype(self.hf[0]))
        if self.kind == "part":
            ax = self.axis % len(self.shape)
            s = sl[ax]
            sl = sl[:ax] + (slice(s.start + self.start, s.stop + self.start, s.step),) + sl[ax + 1:]
            return ckpt.read(self.hf[0], sl)
        raise ValueError(self.kind)

    def hf_pieces(self, arr: np.ndarray) -> list[tuple[str, np.ndarray, Optional[tuple[int, int]]]]:
        if self.kind == "same":
            return [(self.hf[0], arr, None)]
        if self.kind == "t":
            return [(self.hf[0], arr.T, None)]
        if self.kind == "experts_t":
            return [(n, arr[e].T, None) for e, n in enumerate(self.hf)]
        if self.kind == "part":
            return [(self.hf[0], arr, (self.axis % len(self.shape), self.start))]
        raise ValueError(self.kind)


def same(path, hf, shape) -> TensorSpec:
    return TensorSpec(tuple(path), "same", (hf,), tuple(shape))


def t(path, hf, shape) -> TensorSpec:
    return TensorSpec(tuple(path), "t", (hf,), tuple(shape))


def experts_t(path, names, shape) -> TensorSpec:
    return TensorSpec(tuple(path), "experts_t", tuple(names), tuple(shape))


def part(path, hf, shape, axis, start, full) -> TensorSpec:
    return TensorSpec(tuple(path), "part", (hf,), tuple(shape), axis=axis, start=start, hf_full=tuple(full))

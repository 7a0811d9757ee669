"""Minimal safetensors reading (memory-mapped, sliceable) and streaming writing, bf16 included.

The format: 8-byte little-endian header length N, N bytes of JSON {name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {...}}, then the raw little-endian tensor bytes.
numpy has no bfloat16, so `ml_dtypes` (a JAX dependency) provides it; reading a slice of a
memory-mapped tensor touches only the pages of that slice, so a 100B checkpoint is never loaded whole.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Iterable

import ml_dtypes
import numpy as np

from farskip_jax.errors import CheckpointError

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file


def read_header(path: str) -> dict[str, TensorInfo]:
    """Tensor name -> TensorInfo of one .safetensors file (reads only the header)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise CheckpointError(f"safetensors shard not found: {path}") from None
    except (struct.error, ValueError) as e:
        raise CheckpointError(f"{path} is not a valid safetensors file ({e})") from None
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        if h["dtype"] not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {h['dtype']}")
        out[name] = TensorInfo(path, DTYPES[h["dtype"]], tuple(h["shape"]), 8 + n + h["data_offsets"][0])
    return out


class MappedTensor:
    """A lazily memory-mapped tensor; `[...]` slicing reads only what is asked for."""

    def __init__(self, info: TensorInfo):
        self.info = info
        self.shape = info.shape
        self.dtype = info.dtype

    def __getitem__(self, idx) -> np.ndarray:
        n = int(np.prod(self.shape)) if self.shape else 1
        mm = np.memmap(self.info.file, dtype=self.dtype, mode="r", offset=self.info.offset, shape=(n,))
        arr = mm.reshape(self.shape)[idx]
        return np.array(arr)  # copy the slice out of the mapping


def write_file(path: str, tensors: Iterable[tuple[str, tuple[int, ...], np.dtype]], produce, metadata=None) -> None:
    """Stream a safetensors file: `tensors` lists (name, shape, dtype) in order; `produce(name)` returns
    each array when its turn comes, so only one tensor is in memory at a time."""
    entries, off = {}, 0
    specs = list(tensors)
    for name, shape, dtype in specs:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize if shape else np.dtype(dtype).itemsize
        entries[name] = {"dtype": NAMES[np.dtype(dtype)], "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    header = {"__metadata__": dict(metadata or {"format": "pt"}), **entries}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape, dtype in specs:
            arr = np.ascontiguousarray(produce(name), dtype=dtype)
            if tuple(arr.shape) != tuple(shape):
                raise CheckpointError(f"internal: tensor {name} has shape {arr.shape}, header says {shape}")
            f.write(arr.tobytes())
    os.chmod(path, 0o644)

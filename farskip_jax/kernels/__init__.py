"""Kernels below the model: the op registry and the plain-JAX computations the model selects by name,
plus optional CPU fast paths.

    ops.py          the op registry (matmul, grouped matmul, attention core) a backend fills
    gmm.py          grouped matmul for routed experts: ragged_dot, the tiled / fused SwiGLU walks, einsum
    attention.py    attention cores: naive, blockwise (flash-style), causal_blocks
    cpu/            C++ XLA FFI kernels (grouped GEMM on BLAS / AMX, fused attention), their build and
                    load, and the dispatcher that installs them into ops.py from the config's `kernels:`
    host_memory.py  glibc malloc settings for CPU runs (before JAX starts)

model/ imports this package, never the reverse; GPU/TPU programs never contain the CPU kernels. The
names below are loaded on first use, so `farskip_jax.kernels.host_memory` stays importable before
JAX starts.
"""

from __future__ import annotations

_EXPORTS = ("BACKENDS", "FFI_TARGETS", "install", "installed", "resolve", "process_devices")
_LIBRARY = ("KernelUnavailable", "available", "amx_available")


def __getattr__(name: str):
    if name in _EXPORTS:
        # deferred: kernels.host_memory runs before JAX starts; kernels/cpu/ imports jax
        from farskip_jax.kernels.cpu import dispatch

        return getattr(dispatch, name)
    if name in _LIBRARY:
        # deferred: kernels.host_memory runs before JAX starts; kernels/cpu/ imports jax
        from farskip_jax.kernels.cpu import library

        return getattr(library, name)
    raise AttributeError(f"module 'farskip_jax.kernels' has no attribute {name!r}")

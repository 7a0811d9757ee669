"""Optional CPU fast paths (C++ XLA FFI kernels) behind one small dispatcher, kernels/dispatch.py.

    dispatch.py     named backends, `resolve(cfg.kernels)`, `install(cfg.kernels)` into model/ops.py
    library.py      build (system C++ compiler) and load of csrc/, the BLAS it is given, AMX probe
    gmm.py          grouped matmul / dense matmul through BLAS sgemm or AMX tiles (custom VJPs)
    attention.py    fused attention core (FlashAttention-2 VJP)
    host_memory.py  glibc malloc settings for CPU runs (before JAX starts)
    csrc/           the C++ sources

model/ never imports this package; GPU/TPU programs never contain its kernels. The names below are
loaded on first use, so `farskip_jax.kernels.host_memory` stays importable before JAX starts.
"""

from __future__ import annotations

_EXPORTS = ("BACKENDS", "FFI_TARGETS", "install", "installed", "resolve", "process_devices")
_LIBRARY = ("KernelUnavailable", "available", "amx_available")


def __getattr__(name: str):
    if name in _EXPORTS:
        from farskip_jax.kernels import dispatch

        return getattr(dispatch, name)
    if name in _LIBRARY:
        from farskip_jax.kernels import library

        return getattr(library, name)
    raise AttributeError(f"module 'farskip_jax.kernels' has no attribute {name!r}")

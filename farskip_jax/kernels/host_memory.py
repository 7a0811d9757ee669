"""Keep freed host memory in the process on CPU runs (glibc malloc settings), so big buffers are reused.

Why: XLA:CPU allocates every buffer of a step (expert-weight gradients of hundreds of MB, activations)
with malloc and frees it when the step is done. glibc serves blocks over 32 MiB with a fresh mmap
and unmaps them on free; XLA's worker threads allocate from their own arenas, whose heaps (64 MiB at
most) hand any bigger block to mmap as well. Each step then pays a page fault and the kernel's
zeroing of every page it writes (`clear_page`); docs/cpu_speed.md "Resident host memory" has what
that costs and what this saves.

`keep_freed_memory()` sets, at run time through `mallopt`:
    M_ARENA_MAX = 1         threads share the main arena (no per-thread heaps that fall back to mmap)
    M_MMAP_MAX = 0          big blocks come from the heap instead of mmap
    M_TRIM_THRESHOLD = -1   (read by glibc as SIZE_MAX) freed memory is never given back to the OS
so steady-state steps reuse already-mapped pages. The cost is memory: the process keeps its
high-water mark plus some fragmentation (XLA frees and allocates a step's buffers in a slightly
varying order), flat after a few steps. The trim threshold is unlimited because the largest one
mallopt takes as a positive int, 2 GiB, is less than a step can free at the top of the heap, which
glibc would give back for the next step to fault in again.

Call it before JAX starts its CPU backend (the entry points do; threads created earlier keep their
arenas). `kernels.host_malloc: default` (environment override FARSKIP_HOST_MALLOC=default) leaves
malloc alone. A no-op (returns False) where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

from typing import Optional

from farskip_jax.config import kernels_from_env
from farskip_jax.errors import ConfigError
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8  # glibc malloc.h
_NEVER = -1  # M_TRIM_THRESHOLD: glibc converts it to SIZE_MAX

_applied: bool | None = None


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # glibc only (musl has no mallopt tunables of this kind)
    except (OSError, AttributeError):
        return None
    return libc


def keep_freed_memory(mode: Optional[str] = None) -> bool:
    """Apply the settings above once per process; True when they are in effect.

    mode: kernels.host_malloc of the run's config: `resident` applies them, `default` leaves malloc
    alone; None (before a config is loaded) takes the default section with its environment override
    (config.kernels_from_env: FARSKIP_HOST_MALLOC, a bad value is one ConfigError naming the choices)."""
    global _applied
    if _applied is not None:
        return _applied
    if mode is None:
        mode = kernels_from_env().host_malloc
    if mode not in ("resident", "default"):
        raise ConfigError(f"kernels.host_malloc={mode!r} is not a choice; expected 'resident' or 'default'")
    libc = _glibc() if mode == "resident" else None
    ok = libc is not None
    if ok:
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        for param, value in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _NEVER)):
            ok = bool(libc.mallopt(param, value)) and ok
    _applied = ok
    return ok

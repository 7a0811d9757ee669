"""The model's replaceable computations and the registry a backend fills (the one backend seam).

    matmul(x [m, i], w [i, o] (or [o, i] with transpose_w)) -> [m, o]   every Linear, tied logits, router
    grouped matmul                                                      kernels/gmm.py, by name (runtime.gmm)
    attention core                                                      kernels/attention.py, by name
                                                                        (runtime.attention_impl)

The built-in implementations are plain JAX (XLA's dot; gmm.py's ragged_dot / tiled / einsum;
attention.py's naive / blockwise / causal_blocks). A backend may register more with
`register(op, name, Backend(...))`; kernels/cpu/dispatch.py registers the CPU C++ kernels (`blas`,
`fused_cpu`, the dense BLAS/AMX matmul) when the config's `kernels:` section enables them, and the
overlap analysis registers a grouped-GEMM cost proxy while it traces. model/ never imports a backend:
it asks this registry, by name, whether one is there.

A registered backend names the one platform whose programs may contain it. `matmul` backends are
wrapped in `lax.platform_dependent`, so a program lowered for another platform holds XLA's dot only;
the grouped matmul and attention core are resolved by name for the program's platform (`resolve`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Optional

import jax

MATMUL, GROUPED_MATMUL, ATTENTION_CORE = "matmul", "grouped_matmul", "attention_core"
OPS = (MATMUL, GROUPED_MATMUL, ATTENTION_CORE)


@dataclasses.dataclass(frozen=True)
class Backend:
    """One registered implementation of an op.

    fn: the op's signature (matmul: (x2, w, transpose_w); grouped matmul: (lhs, rhs, group_sizes);
        attention core: (q, k, v, mask, scale)).
    platform: the platform whose programs may contain it ("cpu"); None: any (analysis stand-ins).
    auto(devices) -> bool: whether `auto` picks it in a program on `platform` auto-partitioned over
        `devices` devices (grouped matmul / attention core; a matmul backend decides in `accepts`).
    accepts(*args) -> bool: per call (matmul: dtypes and shapes it handles); XLA's dot otherwise.
    stored_weights: grouped matmul: takes the expert weights as stored (it rounds them itself).
    """

    fn: Callable
    platform: Optional[str] = "cpu"
    auto: Callable[[int], bool] = lambda devices: True
    accepts: Callable[..., bool] = lambda *args: True
    stored_weights: bool = False


_REGISTRY: dict[str, dict[str, Backend]] = {op: {} for op in OPS}


def register(op: str, name: str, backend: Backend) -> None:
    """Add (or replace) backend `name` of `op`; a name of a built-in implementation shadows it."""
    if op not in _REGISTRY:
        raise ValueError(f"unknown op {op!r}; one of {OPS}")
    _REGISTRY[op][name] = backend


def unregister(op: str, name: str) -> None:
    _REGISTRY[op].pop(name, None)


def registered(op: str, name: str) -> Optional[Backend]:
    """The backend registered as `name` for `op`, or None (then the model's own implementation runs)."""
    return _REGISTRY[op].get(name)


def names(op: str) -> tuple[str, ...]:
    return tuple(_REGISTRY[op])


@contextlib.contextmanager
def registered_while(op: str, name: str, backend: Backend):
    """`backend` registered as `name` of `op` inside the block; whatever was there before, after it."""
    before = _REGISTRY[op].get(name)
    register(op, name, backend)
    try:
        yield
    finally:
        if before is None:
            unregister(op, name)
        else:
            register(op, name, before)


def resolve(op: str, name: str, *, key: str, builtins: tuple[str, ...], default: Callable[[str], str],
            platform: Optional[str] = None, devices: int = 1) -> str:
    """The implementation config value `name` (of config key `key`) runs in a program on `platform`
    (default: JAX's default backend) partitioned over `devices` devices.

    `auto`: the first registered backend of that platform whose `auto(devices)` holds, else
    `default(platform)` (a built-in). A registered name is checked against the platform; a built-in
    name is returned as it is. Anything else raises ValueError naming the choices."""
    platform = platform or jax.default_backend()
    extra = _REGISTRY[op]
    if name == "auto":
        for n, b in extra.items():
            if b.platform == platform and b.auto(devices):
                return n
        return default(platform)
    if name in extra:
        b = extra[name]
        if b.platform is not None and b.platform != platform:
            raise ValueError(f"{key}={name} is a {b.platform.upper()} kernel and this program runs on {platform}; "
                             f"use {key}: auto ({default(platform)} there) or a built-in one of {builtins}")
        return name
    if name in builtins:
        return name
    raise ValueError(f"{key}={name!r} is not available here: the built-in choices are {builtins}"
                     + (f", the installed backends {tuple(extra)}" if extra else
                        " and no backend is installed (the CPU kernels come with kernels.enabled: true, "
                        "installed where the model is built: farskip_jax.kernels.install)"))


def matmul(x2: jax.Array, w: jax.Array, transpose_w: bool = False) -> jax.Array:
    """x2 [m, i] @ w [i, o] (or w [o, i] with transpose_w) -> [m, o] in x2.dtype, w rounded to x2.dtype.

    XLA's dot, unless a registered matmul backend accepts these operands: then the program holds
    the backend on its platform and XLA's dot elsewhere (`lax.platform_dependent`, decided when the
    program is lowered)."""

    def xla_dot(x2, w):
        dims = (((1,), (1 if transpose_w else 0,)), ((), ()))
        return jax.lax.dot_general(x2, w.astype(x2.dtype), dims)

    for b in _REGISTRY[MATMUL].values():
        if x2.shape[0] and b.accepts(x2, w, transpose_w):
            kernel = lambda x2, w, b=b: b.fn(x2, w, transpose_w)  # noqa: E731
            return jax.lax.platform_dependent(x2, w, **{b.platform: kernel}, default=xla_dot)
    return xla_dot(x2, w)

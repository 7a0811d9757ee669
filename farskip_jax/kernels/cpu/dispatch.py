"""The dispatcher of the CPU kernels: which backend the model's seam (kernels/ops.py) gets, and when.

    from farskip_jax import kernels
    kernels.install(cfg.kernels)   # parallel/build.config_on does it for every model built from a config

Named backends, each an op of the model's backend seam (kernels/ops.py), registered for CPU programs:

    blas        grouped matmul (runtime.gmm)              kernels/cpu/gmm.gmm: one BLAS sgemm per group part, bf16 on AMX
    fused_cpu   attention core (runtime.attention_impl) kernels/cpu/attention.py: score blocks in cache, FA-2 VJP
    blas_dense  dense matmul (every Linear)           kernels/cpu/gmm.matmul: gmm with one group

`resolve(cfg)` is the one place that knows when they apply:
  - CPU programs only: each is registered for platform "cpu" (the grouped matmul and attention core
    are chosen by name for the program's platform, the dense matmul sits behind
    lax.platform_dependent), so a GPU/TPU program never contains them;
  - one device: a custom call has no partitioning rule, so in a program auto-partitioned over
    several devices XLA would gather its operands and run it replicated; `auto` skips the attention
    core there (the routed experts run per device inside the expert-parallel shard_map), and the
    dense matmul runs only in a process with one device (a traced Linear cannot tell its program's
    partitioning);
  - the library builds here (kernels/cpu/library.py: a C++ compiler and a CBLAS); if not, `auto` keeps
    the plain-JAX implementations with one warning, and an explicit `runtime.gmm: blas` or
    `runtime.attention_impl: fused_cpu` raises KernelUnavailable naming the fix.
The settings come from the config's `kernels:` section (config.KernelsConfig); host memory
(kernels/host_memory.py) is set up by the entry points before JAX starts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from farskip_jax.config import KernelsConfig
from farskip_jax.kernels.cpu import library, attention, gmm
from farskip_jax.kernels.cpu.library import available
from farskip_jax.kernels import ops

# backend name -> the op of kernels/ops.py it implements
BACKENDS = {"blas": ops.GROUPED_MATMUL, "fused_cpu": ops.ATTENTION_CORE, "blas_dense": ops.MATMUL}
# the custom-call targets the library registers (what a program containing a kernel names)
FFI_TARGETS = ("farskip_gmm", "farskip_tgmm", "farskip_gmm_bf16", "farskip_tgmm_bf16", "farskip_attention_fwd",
               "farskip_attention_bwd")
_installed: tuple[str, ...] = ()


def process_devices() -> int:
    """Devices of this process's programs: a model traced here cannot tell whether its program will
    be partitioned, so several devices in the process count as partitioned (the dense matmul)."""
    return jax.device_count()


def _one_device(devices: int) -> bool:
    return devices == 1 and available()


def _dense_accepts(x2: jax.Array, w: jax.Array, transpose_w: bool) -> bool:
    """bf16 rows on AMX (not transposed; K, N multiples of 32), or float32 x and w unless
    kernels.dense_matmul: xla; in a one-device process only."""
    if process_devices() != 1 or not available():
        return False
    if x2.dtype == jnp.bfloat16:
        return not transpose_w and gmm.uses_amx(x2, w[None])
    return x2.dtype == w.dtype == jnp.float32 and library.settings().dense_matmul == "auto"


def resolve(cfg: KernelsConfig) -> dict[str, ops.Backend]:
    """The backends `cfg` installs, by name (none when cfg.enabled is false)."""
    if not cfg.enabled:
        return {}

    return {
        "blas": ops.Backend(gmm.gmm, platform="cpu", auto=_one_device, stored_weights=True),
        "fused_cpu": ops.Backend(attention.fused_attention_core, platform="cpu", auto=_one_device),
        "blas_dense": ops.Backend(gmm.matmul, platform="cpu", accepts=_dense_accepts),
    }


def install(cfg: KernelsConfig) -> tuple[str, ...]:
    """Make `cfg` the process's kernel settings and register its backends in kernels/ops.py (replacing
    any installed before; cfg.enabled false removes them). Returns the names installed. Cheap: the
    library is built and loaded on first use, not here."""
    global _installed
    library.configure(cfg)
    for name in _installed:
        ops.unregister(BACKENDS[name], name)
    chosen = resolve(cfg)
    for name, backend in chosen.items():
        ops.register(BACKENDS[name], name, backend)
    _installed = tuple(chosen)
    return _installed


def installed() -> tuple[str, ...]:
    """The backends of the last install (empty before any)."""
    return _installed

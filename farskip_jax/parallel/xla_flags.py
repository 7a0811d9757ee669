"""XLA flag presets (`mesh.xla_preset`: none | cpu | cuda_hopper | rocm_mi300), applied before JAX starts.

    apply_xla_preset(cfg.mesh.xla_preset)          # in the entry point, before any JAX computation
    apply_xla_preset("cpu", host_devices=8)        # tests / CPU runs with 8 virtual devices

XLA reads XLA_FLAGS once, when the backend starts; later changes are ignored, so applying a preset
after that raises BackendError instead of silently doing nothing. Flags the user already put in
XLA_FLAGS win over the preset's (same flag name). Every flag name here is checked against the
installed jaxlib by tests/test_parallel_xla_flags.py (an unknown flag aborts XLA at start-up).

Why each flag is there is written next to it; FarSkip's whole gain depends on the scheduler placing
the async all-to-alls under independent compute (docs/design.md section 2), so the GPU presets are about
turning that scheduler on and giving it room. Collectives are async (start/done pairs) by default on
GPU; `--xla_gpu_disable_async_collectives` is the switch that would undo that (an empty value does not
parse, so the presets leave it unset).
"""

from __future__ import annotations

import os
import sys
from typing import MutableMapping, Optional

from farskip_jax.errors import BackendError, ConfigError

# (flag, value, why)
_SCHEDULING = [
    ("xla_gpu_enable_latency_hiding_scheduler", "true",
     "LHS moves async collective start/done apart so independent compute runs in between; without it "
     "the all-to-alls of EP run back to back with their consumers and FarSkip's independence is unused"),
    ("xla_gpu_experimental_parallel_collective_overlap_limit", "2",
     "default 1 collective in flight; FarSkip has two at once (combine of layer k-1 and dispatch of "
     "layer k both hide under attention of layer k)"),
    ("xla_gpu_enable_highest_priority_async_stream", "true",
     "run collectives on the high-priority stream so overlapped compute kernels do not starve them"),
    ("xla_gpu_enable_command_buffer", "",
     "no CUDA/HIP graphs: a captured graph fixes the launch order and hides the async collective "
     "streams from LHS's schedule; the launch overhead saved is small next to MoE layer times"),
]

PRESETS: dict[str, list[tuple[str, str, str]]] = {
    "none": [],
    "cpu": [
        ("xla_cpu_enable_fast_math", "false",
         "IEEE semantics, so EP-vs-single-device parity tests can use tight fp32 tolerances"),
    ],
    "cuda_hopper": _SCHEDULING + [
        ("xla_gpu_experimental_use_ragged_dot_fusion", "true",
         "lower ragged_dot (routed-expert grouped matmul) to cuDNN's grouped GEMM fusion where the "
         "installed cuDNN supports it; otherwise XLA keeps its dense expansion (G x the FLOPs)"),
        ("xla_gpu_all_gather_combine_threshold_bytes", "134217728",
         "combine FSDP weight all-gathers up to 128 MiB so few large transfers overlap the layers"),
        ("xla_gpu_reduce_scatter_combine_threshold_bytes", "134217728",
         "same for the FSDP gradient reduce-scatters"),
    ],
    "rocm_mi300": _SCHEDULING + [
        ("xla_gpu_enable_cublaslt", "true",
         "on ROCm this routes GEMMs through hipBLASLt (the `cublaslt` name is shared by both GPU "
         "backends); required by the grouped GEMM below"),
        ("xla_gpu_experimental_use_ragged_dot_grouped_gemm", "true",
         "ragged_dot -> hipBLASLt grouped GEMM on gfx942/gfx950 (bf16/fp16) instead of the dense "
         "expansion over every expert group"),
        ("xla_gpu_all_gather_combine_threshold_bytes", "134217728",
         "combine FSDP weight all-gathers up to 128 MiB so few large transfers overlap the layers"),
        ("xla_gpu_reduce_scatter_combine_threshold_bytes", "134217728",
         "same for the FSDP gradient reduce-scatters"),
    ],
}


def preset_flags(name: str) -> list[str]:
    """The `--flag=value` strings of preset `name`."""
    if name not in PRESETS:
        raise ConfigError(f"mesh.xla_preset={name!r} is unknown; choose one of {sorted(PRESETS)}")
    return [f"--{flag}={value}" for flag, value, _ in PRESETS[name]]


def _flag_name(arg: str) -> str:
    return arg.lstrip("-").split("=", 1)[0]


def merge_flags(existing: str, extra: list[str]) -> str:
    """`existing` XLA_FLAGS plus those of `extra` whose names it does not set already."""
    have = {_flag_name(a) for a in existing.split()}
    return " ".join(existing.split() + [a for a in extra if _flag_name(a) not in have])


def _backend_started() -> bool:
    if "jax" not in sys.modules:
        return False
    # deferred: flags are applied before JAX starts: jax is read only when already imported
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def apply_xla_preset(name: str, *, host_devices: Optional[int] = None,
                     env: Optional[MutableMapping[str, str]] = None) -> str:
    """Add preset `name`'s flags (and `--xla_force_host_platform_device_count` when host_devices is
    given) to XLA_FLAGS in `env` (default os.environ). Returns the new XLA_FLAGS."""
    env = os.environ if env is None else env
    extra = preset_flags(name)
    if host_devices is not None:
        extra.append(f"--xla_force_host_platform_device_count={int(host_devices)}")
    if not extra:
        return env.get("XLA_FLAGS", "")
    if env is os.environ and _backend_started():
        raise BackendError(
            f"XLA flag preset {name!r} must be applied before JAX starts its backend (XLA reads "
            "XLA_FLAGS once); call apply_xla_preset first in the entry point"
        )
    env["XLA_FLAGS"] = merge_flags(env.get("XLA_FLAGS", ""), extra)
    return env["XLA_FLAGS"]

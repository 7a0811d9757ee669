"""Will a CPU run's state fit in this machine's memory? Checked before anything is loaded or written.

On the CPU backend the devices are host memory, so a model too large for the machine dies minutes
later in an out-of-memory traceback (or the kernel's OOM killer). The lower bound checked here counts
only what the step must hold whatever the batch: fp32 master weights, their gradients and AdamW's two
moments (16 bytes per parameter), plus the frozen teacher copy of FCSD (distill.teacher_dtype), split
over the processes. Activations come on top, so passing the check does not promise the run fits.

    need = state_bytes(cfg)                  # bytes, all processes together
    check_host_memory(cfg, "the FCSD run")   # ConfigError when need / processes > MemAvailable
"""

from __future__ import annotations

from typing import Optional

import jax

from farskip_jax.config import Config
from farskip_jax.errors import ConfigError
from farskip_jax.train.flops import total_params

GiB = 2**30
TEACHER_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def state_bytes(cfg: Config) -> int:
    """Bytes of weights + gradients + AdamW moments (fp32), + the frozen teacher under train.mode=distill."""
    n = total_params(cfg)
    teacher = TEACHER_BYTES.get(cfg.distill.teacher_dtype, 4) * n if cfg.train.mode == "distill" else 0
    return 16 * n + teacher


def available_bytes() -> Optional[int]:
    """MemAvailable of /proc/meminfo, or None where it cannot be read (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_host_memory(cfg: Config, what: str, available: Optional[int] = None) -> None:
    """ConfigError when the CPU backend runs `cfg` and its state cannot fit in available host memory."""
    if jax.default_backend() != "cpu":
        return
    have = available_bytes() if available is None else available
    if have is None:
        return
    need = state_bytes(cfg) / max(jax.process_count(), 1)
    if need > have:
        n = total_params(cfg)
        extra = (f" + the {cfg.distill.teacher_dtype} teacher" if cfg.train.mode == "distill" else "")
        raise ConfigError(
            f"{what} needs at least {need / GiB:.1f} GiB of host memory ({n / 1e6:,.0f}M parameters x 16 bytes of fp32 "
            f"weights, gradients and AdamW moments{extra}; activations come on top) but this machine has "
            f"{have / GiB:.1f} GiB available: run it on accelerators, or on CPU with a smaller model "
            "(configs/distill_hf_small.yaml is a runnable small FCSD example)")

"""A quiet JAX start on machines without an NVIDIA GPU that have the CUDA plugin installed.

The dev extra installs jax-cuda12-plugin so that analysis/ can compile GPU programs deviceless. On a
machine without the NVIDIA driver, JAX with that plugin prints noise that reads as a broken install:
- `cudart_stub.cc:31] Could not find cuda drivers on your machine` (each preceded by absl's
  "All log messages before absl::InitializeLog() ..." line): C++ logging of the plugin's libraries,
  three times at `import jax` and once when the plugin starts;
- "Jax plugin configuration error: Exception when calling jax_plugins.xla_cuda12.initialize() ...
  RuntimeError: Unable to load CUDA. Is it installed?": the plugin's CUDA version check, a Python
  traceback when the backends start.

`quiet_jax_start()` runs when farskip_jax is imported. Only where that noise would come (the CUDA
plugin installed, no NVIDIA driver, no TPU runtime, no AMD GPU) it
1. sets `JAX_PLATFORMS=cpu` unless the user set it: the plugin then skips its version check (no
   traceback) but still registers, so deviceless GPU compiles keep working (docs/design.md section 2);
2. imports jax, and starts the plugin, with the C-level stderr captured, and writes back every line
   except the two known noise lines.
Anywhere else it does nothing. `JAX_PLATFORMS` set by the user is always respected.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import sys
import tempfile

_NOISE = (re.compile(r"cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine"),
          re.compile(r"^WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"))


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def noisy_machine() -> bool:
    """True when the CUDA plugin is installed but there is no accelerator it or another runtime needs:
    no NVIDIA driver (/proc/driver/nvidia, /dev/nvidiactl), no AMD GPU (/dev/kfd), no TPU runtime."""
    if not _has_module("jax_plugins.xla_cuda12"):
        return False
    if os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidiactl"):
        return False
    if os.path.exists("/dev/kfd") or _has_module("libtpu"):
        return False
    return True


def drop_noise(text: str) -> str:
    """`text` without the known CUDA-stub lines (every other line kept, in order)."""
    return "".join(line for line in text.splitlines(True) if not any(p.search(line) for p in _NOISE))


@contextlib.contextmanager
def filtered_stderr():
    """Capture file descriptor 2, where C++ logging writes (and Python's sys.stderr when it is the
    process's own), and write it back without the noise. Always fd 2: a harness that replaced
    sys.stderr (pytest's capture) leaves the C-level writes on fd 2."""
    fd = 2
    sys.stderr.flush()
    saved = os.dup(fd)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), fd)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, fd)
            os.close(saved)
            tmp.seek(0)
            kept = drop_noise(tmp.read().decode("utf-8", errors="replace"))
            if kept:
                os.write(fd, kept.encode("utf-8"))


def _quiet_plugin_initialize() -> None:
    """Wrap the CUDA plugin's initialize() (called when JAX starts its backends) in filtered_stderr."""
    plugin = importlib.import_module("jax_plugins.xla_cuda12")
    init = plugin.initialize
    if getattr(init, "_farskip_quiet", False):
        return

    def initialize():
        with filtered_stderr():
            return init()

    initialize._farskip_quiet = True
    plugin.initialize = initialize


def quiet_jax_start() -> bool:
    """Apply the above where the noise would come; True when it did."""
    if not noisy_machine():
        return False
    if "jax" not in sys.modules:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        with filtered_stderr():
            # deferred: this module runs before JAX starts: jax is imported only after JAX_PLATFORMS is set, its stderr filtered
            import jax  # noqa: F401
    else:  # jax imported first (a notebook): its import lines are out already; the backends may not be
        # deferred: this module runs before JAX starts: it imports jax only where jax was already imported
        import jax

        if not os.environ.get("JAX_PLATFORMS") and not jax.config.jax_platforms:
            jax.config.update("jax_platforms", "cpu")
    _quiet_plugin_initialize()
    return True

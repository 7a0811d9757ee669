"""Multi-host start-up: `jax.distributed.initialize` when the config or the environment says so.

    maybe_initialize(cfg.mesh)      # first thing in an entry point, before any device is touched

When it initializes (`mesh.distributed`):
- `off`: never.
- `on`: always; arguments from cfg.mesh (coordinator_address, num_processes, process_id) or, where
  those are unset, from JAX's own detection (JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
  JAX_PROCESS_ID, SLURM, Open MPI, Kubernetes, TPU pods).
- `auto` (default): when cfg.mesh.coordinator_address is set, or JAX_COORDINATOR_ADDRESS is set, or
  a multi-task SLURM / Open MPI launch is detected; otherwise it stays single-process.

On CPU the cross-process collectives go through gloo (the only CPU implementation that works across
processes); that is selected before the backend starts. After initialization `jax.devices()` lists
the devices of every process and `make_mesh` spans them; each process feeds its own rows of the
batch to `shard_batch`.
"""

from __future__ import annotations

import os
from typing import Optional

import jax
from jax._src import xla_bridge

from farskip_jax.config import MeshConfig
from farskip_jax.errors import BackendError, ConfigError


def _launcher_says_multi() -> bool:
    env = os.environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return True
    for key in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        try:
            if int(env.get(key, "1")) > 1:
                return True
        except ValueError:
            pass
    return False


def wants_distributed(mcfg: MeshConfig) -> bool:
    """Whether `maybe_initialize` will call jax.distributed.initialize for this config/environment."""
    if mcfg.distributed == "off":
        return False
    if mcfg.distributed == "on":
        return True
    return mcfg.coordinator_address is not None or _launcher_says_multi()


def _backend_started() -> bool:
    return xla_bridge.backends_are_initialized()


def maybe_initialize(mcfg: Optional[MeshConfig] = None) -> bool:
    """Initialize multi-process JAX if `mcfg` / the environment asks for it. Returns True when JAX
    runs distributed afterwards (also when it already was). Must run before any JAX computation."""
    mcfg = mcfg or MeshConfig()
    if jax.distributed.is_initialized():
        return True
    if not wants_distributed(mcfg):
        return False
    if _backend_started():
        raise BackendError(
            "jax.distributed.initialize must run before JAX touches a device; call "
            "farskip_jax.parallel.maybe_initialize(cfg.mesh) first in the entry point"
        )
    if mcfg.num_processes is not None and mcfg.process_id is not None and not 0 <= mcfg.process_id < mcfg.num_processes:
        raise ConfigError(f"mesh.process_id={mcfg.process_id} must be in [0, mesh.num_processes={mcfg.num_processes})")
    platforms = os.environ.get("JAX_PLATFORMS", "") or str(jax.config.jax_platforms or "")
    if platforms == "" or platforms.startswith("cpu"):
        # CPU-only runs (tests, CI): cross-process collectives need gloo. Harmless on GPU hosts.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = {}
    if mcfg.coordinator_address is not None:
        kwargs["coordinator_address"] = mcfg.coordinator_address
    if mcfg.num_processes is not None:
        kwargs["num_processes"] = mcfg.num_processes
    if mcfg.process_id is not None:
        kwargs["process_id"] = mcfg.process_id
    jax.distributed.initialize(**kwargs)
    return True

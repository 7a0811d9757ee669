"""The device mesh: axes `data`, `fsdp`, `expert`, `tensor`, sized from `MeshConfig`.

    mesh = make_mesh(cfg.mesh)                 # all devices (of every process)
    mesh = make_mesh(MeshConfig(data=2, expert=4), devices=jax.devices()[:8])

Axis order (outermost first) is data, fsdp, expert, tensor: the innermost axes get the nearest
devices (same host / same switch), which is where the heavy traffic is (tensor all-reduces, expert
all-to-alls).

Axis types are `Auto`, chosen deliberately (jax 0.10 `jax.make_mesh` defaults to Explicit):
- the dense part of the model (embedding, attention, shared experts, head) is ordinary array code
  that knows nothing about meshes; with Auto axes GSPMD/Shardy propagate the shardings of the
  parameters and of the batch through it, and insert the FSDP all-gathers / tensor-parallel
  reductions. With Explicit axes every op whose output sharding is ambiguous (an FSDP-sharded
  contraction dim, a reshape of a sharded dim) must be annotated by the model code, which would drag
  the mesh into model/ (docs/design.md section 3: the model never touches a mesh);
- the MoE token exchange, where the schedule matters, is written explicitly in `jax.shard_map`
  (parallel/ep.py): there every collective is ours, visible and named, whatever the axis types.
Inputs still carry their shardings (`shard_batch`, `create_model` place them), so nothing is
silently replicated.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import jax
from jax.sharding import AxisType, Mesh

from farskip_jax.config import MeshConfig
from farskip_jax.errors import ConfigError

MESH_AXES = ("data", "fsdp", "expert", "tensor")
BATCH_AXES = ("data", "fsdp", "expert")  # the axes the batch (tokens) is split over


def resolve_mesh_shape(mcfg: MeshConfig, num_devices: int) -> dict[str, int]:
    """Mesh axis sizes with the one `-1` axis (if any) resolved; the product must be num_devices."""
    sizes = {a: getattr(mcfg, a) for a in MESH_AXES}
    fixed = math.prod(v for v in sizes.values() if v != -1)
    free = [a for a, v in sizes.items() if v == -1]
    if free:
        if num_devices % fixed:
            raise ConfigError(
                f"mesh: the fixed axes {({a: v for a, v in sizes.items() if v != -1})} multiply to {fixed}, "
                f"which does not divide the {num_devices} devices; mesh.{free[0]}=-1 cannot take the rest"
            )
        sizes[free[0]] = num_devices // fixed
    total = math.prod(sizes.values())
    if total != num_devices:
        raise ConfigError(
            f"mesh sizes {sizes} multiply to {total} but there are {num_devices} devices; make the product "
            f"equal the device count (or set one axis, e.g. mesh.data, to -1 to take the rest)"
        )
    return sizes


def make_mesh(mcfg: Optional[MeshConfig] = None, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A 4-axis `Mesh` (data, fsdp, expert, tensor) with Auto axis types over `devices` (default: all)."""
    mcfg = mcfg or MeshConfig()
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_mesh_shape(mcfg, len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def axis_size(mesh: Mesh, axes) -> int:
    """Product of the sizes of mesh axis `axes` (a name, a tuple of names or None)."""
    if axes is None:
        return 1
    if isinstance(axes, str):
        axes = (axes,)
    return math.prod(mesh.shape[a] for a in axes)


def batch_shards(mesh: Mesh) -> int:
    """How many pieces the batch is split into (data x fsdp x expert)."""
    return axis_size(mesh, BATCH_AXES)


def mesh_platform(mesh: Mesh) -> str:
    return mesh.devices.flat[0].platform

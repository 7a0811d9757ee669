"""Parallelism: device mesh, sharding rules, expert-parallel dispatch/combine, multi-host, XLA flags.

Every collective of the project lives here (docs/design.md section 3). Entry points:

    maybe_initialize(cfg.mesh)                  # multi-host: before anything touches a device
    mesh = make_mesh(cfg.mesh)                  # axes data, fsdp, expert, tensor (Auto types)
    model = create_model(cfg, mesh, seed=0)     # sharded params, MoE backend from cfg.runtime.dispatch
    batch = shard_batch(batch, mesh)            # [batch, ...] split over data x fsdp x expert

XLA flag presets (`xla_flags.apply_xla_preset`) must run before JAX initialises its backend.
"""

from farskip_jax.parallel.build import check_mesh, create_model
from farskip_jax.parallel.ep import AllToAllCompute, LocalCompute, RaggedCompute, routed_compute_for
from farskip_jax.parallel.mesh import BATCH_AXES, MESH_AXES, batch_shards, make_mesh
from farskip_jax.parallel.sharding import RULES, batch_sharding, logical_to_spec, shard_batch, shard_model, state_shardings

__all__ = [
    "AllToAllCompute", "BATCH_AXES", "LocalCompute", "MESH_AXES", "RULES", "RaggedCompute", "batch_shards",
    "batch_sharding", "check_mesh", "create_model", "logical_to_spec", "make_mesh", "routed_compute_for",
    "shard_batch", "shard_model", "state_shardings",
]

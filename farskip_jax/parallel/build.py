"""Build a model whose parameters live on the mesh, with the MoE exchange of `cfg.moe.dispatch`.

    mesh = make_mesh(cfg.mesh)
    model = create_model(cfg, mesh, seed=0)
    tokens = shard_batch(tokens_np, mesh)
    logits = nnx.jit(lambda m, t: m(t).logits)(model, tokens)

Parameters are initialised inside one jit whose outputs already carry their shardings (no device
ever holds the whole model). The values depend only on `seed`, not on the mesh (partitionable
threefry), so a model built on 8 devices equals the one built on 1.
"""

from __future__ import annotations

from typing import Optional

import jax
from flax import nnx
from jax.sharding import Mesh

from farskip_jax.config import Config
from farskip_jax.errors import BackendError, ConfigError
from farskip_jax.model import Transformer
from farskip_jax.parallel.ep import RAGGED_ON_CPU, routed_compute_for
from farskip_jax.parallel.mesh import make_mesh, mesh_platform
from farskip_jax.parallel.sharding import state_shardings


def check_mesh(cfg: Config, mesh: Mesh) -> None:
    """Fail early on a config that cannot run on this mesh."""
    ep = mesh.shape.get("expert", 1)
    if cfg.moe.num_experts and ep > 1:
        if cfg.moe.num_experts % ep:
            raise ConfigError(f"moe.num_experts={cfg.moe.num_experts} is not divisible by the mesh's expert axis ({ep})")
        if cfg.moe.dispatch == "local":
            raise ConfigError(f"the mesh has expert={ep}; set moe.dispatch to all_to_all or ragged (got local)")
    if cfg.moe.dispatch == "ragged" and mesh_platform(mesh) == "cpu":
        raise BackendError(RAGGED_ON_CPU)


def create_model(cfg: Config, mesh: Optional[Mesh] = None, seed: int = 0) -> Transformer:
    """A `Transformer` with sharded parameters and the routed-expert backend of cfg.moe.dispatch.

    mesh: default `make_mesh(cfg.mesh)` over all devices."""
    mesh = make_mesh(cfg.mesh) if mesh is None else mesh
    check_mesh(cfg, mesh)
    rc = routed_compute_for(cfg.moe.dispatch, mesh)

    def init() -> Transformer:
        return Transformer(cfg, rngs=nnx.Rngs(seed), routed_compute=rc)

    graphdef, abstract = nnx.split(nnx.eval_shape(init))
    shardings = state_shardings(abstract, mesh)
    state = jax.jit(lambda: nnx.split(init())[1], out_shardings=shardings)()
    return nnx.merge(graphdef, state)

"""Build a model whose parameters live on the mesh, with the MoE exchange of `cfg.runtime.dispatch`.

    mesh = model_mesh(cfg)                     # make_mesh(cfg.mesh), or the FoE mesh (below)
    model = create_model(cfg, mesh, seed=0)
    tokens = shard_batch(tokens_np, mesh)
    logits = nnx.jit(lambda m, t: m(t).logits)(model, tokens)

Parameters are initialised inside one jit whose outputs already carry their shardings (no device
ever holds the whole model). The values depend only on `seed`, not on the mesh (partitionable
threefry), so a model built on 8 devices equals the one built on 1.

Federation of Experts (runtime.num_groups = H > 1) with expert parallelism (mesh.expert > 1) runs on the
5-axis FoE mesh of parallel/foe.py (expert axis split into group x expert, so each group's
all-to-all stays on its own devices): `model_mesh(cfg)` returns it, and `create_model` given a plain
mesh builds the model on the FoE mesh over the same devices (a batch placed on the plain mesh is then
resharded by XLA inside jit; place it with `shard_batch(batch, model_mesh(cfg))` to avoid that).
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh

from farskip_jax import kernels
from farskip_jax.config import Config, replace
from farskip_jax.errors import BackendError, ConfigError
from farskip_jax.model import Transformer
from farskip_jax.kernels.attention import resolve_attention_impl
from farskip_jax.kernels.gmm import resolve_backend
from farskip_jax.parallel.ep import RAGGED_ON_CPU, routed_compute_for
from farskip_jax.parallel.foe import GROUP_AXIS, FoECompute, foe_mesh_from, foe_state_shardings, make_foe_mesh
from farskip_jax.parallel.mesh import make_mesh, mesh_platform
from farskip_jax.parallel.sharding import state_shardings


def is_foe_parallel(cfg: Config, mesh: Mesh) -> bool:
    """True when cfg is a Federation of Experts (num_groups > 1) and the mesh has expert parallelism."""
    ep = mesh.shape.get("expert", 1) * mesh.shape.get(GROUP_AXIS, 1)
    return cfg.runtime.num_groups > 1 and bool(cfg.moe.num_experts) and ep > 1


def model_mesh(cfg: Config, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """The mesh a model of cfg runs on: make_mesh(cfg.mesh), split into the FoE mesh (data, fsdp,
    group, expert, tensor) when is_foe_parallel."""
    mesh = make_mesh(cfg.mesh, devices)
    return foe_mesh_from(mesh, cfg.runtime.num_groups) if is_foe_parallel(cfg, mesh) else mesh


def check_mesh(cfg: Config, mesh: Mesh) -> None:
    """Fail early on a config that cannot run on this mesh."""
    ep = mesh.shape.get("expert", 1) * mesh.shape.get(GROUP_AXIS, 1)
    if cfg.moe.num_experts and ep > 1:
        if cfg.moe.num_experts % ep:
            raise ConfigError(f"moe.num_experts={cfg.moe.num_experts} is not divisible by the mesh's expert axis ({ep})")
        if cfg.runtime.dispatch == "local":
            raise ConfigError(f"the mesh has expert={ep}; set runtime.dispatch to all_to_all or ragged (got local)")
    if cfg.runtime.dispatch == "ragged" and mesh_platform(mesh) == "cpu":
        raise BackendError(RAGGED_ON_CPU)


def routed_compute_on(cfg: Config, mesh: Optional[Mesh]):
    """The RoutedComputeFn of cfg.runtime.dispatch on `mesh` (FoECompute on a FoE mesh)."""
    if mesh is not None and GROUP_AXIS in mesh.shape:
        return FoECompute(mesh, cfg.runtime.dispatch)
    return routed_compute_for(cfg.runtime.dispatch, mesh, cfg.runtime.gpus_per_node)


def placement_mesh(cfg: Config, mesh: Mesh) -> Mesh:
    """The mesh cfg's model is placed on, given `mesh` (checked): for a FoE config with expert
    parallelism the FoE group x expert mesh over the same devices, else `mesh` itself."""
    check_mesh(cfg, mesh)
    if is_foe_parallel(cfg, mesh):
        mesh = foe_mesh_from(mesh, cfg.runtime.num_groups)  # unchanged when it already is one
    if GROUP_AXIS in mesh.shape and cfg.runtime.num_groups < 2:
        raise ConfigError("a FoE mesh (with a 'group' axis) needs runtime.num_groups > 1; "
                          "build the mesh with parallel.build.model_mesh(cfg)")
    return mesh


def state_shardings_on(state, mesh: Mesh):
    """NamedShardings of a model state on `mesh`: parallel/foe.py's rules on a FoE mesh (experts over
    group x expert), the logical-axis rules of parallel/sharding.py otherwise."""
    return (foe_state_shardings if GROUP_AXIS in mesh.shape else state_shardings)(state, mesh)


def config_on(cfg: Config, mesh: Mesh) -> Config:
    """Install cfg.kernels (kernels.install: the CPU kernel backends of the model's seam, kernels/ops.py,
    or none) and return cfg with runtime.gmm=auto and runtime.attention_impl=auto resolved for the mesh's
    platform: a GPU program compiled from a CPU process (deviceless analysis) runs the GPU expert
    backend and attention core, as a GPU run would (the CPU kernels cannot run there). Attention runs
    in the program partitioned over the whole mesh (so on several CPU devices `auto` is the naive
    core, see kernels/cpu/dispatch.py); the routed experts run inside the expert-parallel shard_map, per
    device. Every model built from a config passes here (create_model, analysis, inference layouts):
    it is the one place the kernels are enabled."""
    kernels.install(cfg.kernels)
    platform = mesh_platform(mesh)
    if cfg.runtime.gmm == "auto":
        cfg = replace(cfg, **{"runtime.gmm": resolve_backend("auto", platform)})
    if cfg.runtime.attention_impl == "auto":
        cfg = replace(cfg, **{"runtime.attention_impl": resolve_attention_impl("auto", platform, mesh.size)})
    return cfg


def create_model(cfg: Config, mesh: Optional[Mesh] = None, seed: int = 0) -> Transformer:
    """A `Transformer` with sharded parameters and the routed-expert backend of cfg.runtime.dispatch.

    mesh: default `model_mesh(cfg)` over all devices. FoE with expert parallelism: built on the FoE
    mesh (from this mesh's devices when a plain mesh is given)."""
    mesh = placement_mesh(cfg, model_mesh(cfg) if mesh is None else mesh)
    cfg = config_on(cfg, mesh)
    rc = routed_compute_on(cfg, mesh)

    def init() -> Transformer:
        return Transformer(cfg, rngs=nnx.Rngs(seed), routed_compute=rc)

    graphdef, abstract = nnx.split(nnx.eval_shape(init))
    shardings = state_shardings_on(abstract, mesh)
    state = jax.jit(lambda: nnx.split(init())[1], out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def create_foe_model(cfg: Config, mesh: Optional[Mesh] = None, seed: int = 0) -> Transformer:
    """A FoE `Transformer` with parameters placed on the FoE mesh (values depend only on seed)."""
    if cfg.runtime.num_groups < 2:
        raise ConfigError("create_foe_model needs runtime.num_groups >= 2; use parallel.create_model for num_groups=1")
    mesh = make_foe_mesh(cfg.mesh, cfg.runtime.num_groups) if mesh is None else mesh
    if GROUP_AXIS not in mesh.shape:
        raise ConfigError("create_foe_model needs a mesh from make_foe_mesh (with a 'group' axis)")
    return create_model(cfg, mesh, seed=seed)

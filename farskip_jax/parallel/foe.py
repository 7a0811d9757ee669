"""Expert parallelism for Federation of Experts (model/foe.py): each group's all-to-all stays on the
group's own devices; the cross-group sum is an explicit collective.

    mesh  = make_foe_mesh(cfg.mesh, cfg.moe.num_groups)       # axes data, fsdp, group, expert, tensor
    model = create_foe_model(cfg, mesh, seed=0)       # parallel/build.py
    out   = nnx.jit(lambda m, t: m(t).logits)(model, shard_batch(tokens, mesh))

Mesh. The expert-parallel devices of `cfg.mesh` (size ep) are split into `group` x `expert`: G_m =
min(H, ep) device groups of ep / G_m devices each (group outermost, so a group's devices are
neighbours in the plain mesh's expert axis). Device group g holds FoE groups [g*H/G_m, (g+1)*H/G_m)
and their experts [g*E/G_m, (g+1)*E/G_m), split over its `expert` devices (logical axis "expert" ->
("group", "expert")). Tokens are split over data x fsdp x expert and replicated over `group`: every
device group sees every token of its data shard (the paper's layout: a group routes all tokens to
its own experts). With H >= ep every device holds whole groups and no all-to-all is left at all.

`FoECompute` (the model's routed-compute backend):
  group_routed(x, route, experts, cfg, H) -> ([H, b, s, d], dropped)
      jax.shard_map manual over `group` only; inside, each device group runs the ordinary
      expert-parallel exchange of `cfg.moe.dispatch` (parallel/ep.py: all_to_all or ragged) on its
      own H/G_m groups' "virtual tokens" (model/foe.group_routed) with the group's expert ids, over
      the `expert` axis of this mesh = the devices of its group only.
  group_sum(v [H, ...]) -> [...]
      psum over `group` inside shard_map (the cross-group all-reduce of the paper).
  constrain_groups(v [H, b, s, d])
      places group h's stream on its device group (attention of group h runs there).

Bytes per layer (the paper's single-node formula): with T tokens per data shard, the ordinary
MoE's dispatch all-to-all moves T*k*d rows*width over ep devices, a fraction (ep-1)/ep leaving the
device; FoE's moves the same T*k*d in total but each device group's T*(k/H)*d only over its ep/G_m
devices (fraction (ep/G_m - 1)/(ep/G_m)), plus the cross-group all-reduce of T*d per sum
(2(G_m-1)/G_m of it on the wire).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from farskip_jax.config import MeshConfig
from farskip_jax.errors import ConfigError
from farskip_jax.model.experts import ExpertWeights, RoutedOutput
from farskip_jax.model.router import RouteResult
from farskip_jax.parallel.ep import routed_compute_for
from farskip_jax.parallel.mesh import BATCH_AXES, make_mesh
from farskip_jax.parallel.sharding import RULES, logical_to_spec

GROUP_AXIS = "group"
FOE_MESH_AXES = ("data", "fsdp", GROUP_AXIS, "expert", "tensor")
FOE_RULES = {**RULES, "expert": (GROUP_AXIS, "expert")}
FOE_EXPERT_RULES = {**FOE_RULES, "mlp": None}


def foe_mesh_from(mesh: Mesh, num_groups: int) -> Mesh:
    """The FoE mesh over the devices of a plain 4-axis mesh (parallel/mesh.py), in the same order: its
    expert axis (size ep) split into group (G_m = min(H, ep), outer) x expert (ep / G_m, inner)."""
    if GROUP_AXIS in mesh.shape:
        return mesh
    ep = mesh.shape["expert"]
    gm = min(num_groups, ep)
    if ep % gm or num_groups % gm:
        raise ConfigError(f"moe.num_groups={num_groups} and mesh.expert={ep} must divide one another "
                          f"(e.g. mesh.expert={num_groups} or a multiple of it)")
    d, f, t = mesh.shape["data"], mesh.shape["fsdp"], mesh.shape["tensor"]
    devs = mesh.devices.reshape(d, f, gm, ep // gm, t)
    return Mesh(devs, FOE_MESH_AXES, axis_types=(AxisType.Auto,) * 5)


def make_foe_mesh(mcfg: Optional[MeshConfig], num_groups: int, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """The 5-axis FoE mesh: cfg.mesh (make_mesh's device order) with its expert axis split into (group, expert)."""
    return foe_mesh_from(make_mesh(mcfg, devices), num_groups)


def foe_state_shardings(state, mesh: Mesh):
    """NamedSharding per Variable of `state` with the FoE rules (experts over group x expert)."""

    def one(v):
        shape = tuple(jnp.shape(v.get_value()))
        axes = v.get_metadata().get("axes")
        if axes is None:
            return NamedSharding(mesh, P())
        rules = FOE_EXPERT_RULES if "expert" in axes else FOE_RULES
        return NamedSharding(mesh, logical_to_spec(tuple(axes), shape, mesh, rules))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _on_context_mesh(backend):
    """An ep.py backend (validated on the concrete mesh) re-bound to the context mesh: inside the
    group-manual shard_map, a nested shard_map must name the mesh whose `group` axis is Manual."""
    if not hasattr(backend, "mesh"):
        return backend  # plain function (single device)
    b = copy.copy(backend)
    object.__setattr__(b, "mesh", jax.sharding.get_abstract_mesh())
    return b


@dataclasses.dataclass(frozen=True)
class FoECompute:
    """FoE routed-compute backend on a mesh from `make_foe_mesh` (see module doc)."""

    mesh: Mesh
    dispatch: str = "all_to_all"

    @property
    def device_groups(self) -> int:
        return self.mesh.shape[GROUP_AXIS]

    def group_routed(self, x: jax.Array, route: RouteResult, experts: ExpertWeights, cfg, num_groups: int):
        """x: [b, s, d], route: FoE routing (choices group-major, global expert ids) -> ([H, b, s, d], dropped)."""
        gm, hg = self.device_groups, num_groups
        if hg % gm:
            raise ConfigError(f"moe.num_groups={hg} is not a multiple of the mesh's group axis ({gm})")
        hpm = hg // gm  # FoE groups per device group
        b, s, d = x.shape
        kg = route.indices.shape[-1] // hg
        em = experts.w_gate.shape[0] // gm  # experts per device group

        def per_device_group(v):  # [b, s, H*kg] -> [G_m, hpm*b, s, kg] (group-major virtual tokens)
            return v.reshape(b, s, hg, kg).transpose(2, 0, 1, 3).reshape(gm, hpm * b, s, kg)

        idx = per_device_group(route.indices) - (jnp.arange(gm, dtype=jnp.int32) * em)[:, None, None, None]
        w = per_device_group(route.weights)
        xv = jnp.broadcast_to(x[None, None], (gm, hpm, b, s, d)).reshape(gm, hpm * b, s, d)
        inner = routed_compute_for(self.dispatch, self.mesh)  # exchanges over `expert` = within a group

        def body(xg, ig, wt, w_gate, w_up, w_down):
            r = RouteResult(indices=ig[0], weights=wt[0], aux_loss=None, z_loss=None, load=None)
            out = _on_context_mesh(inner)(xg[0], r, ExpertWeights(w_gate, w_up, w_down), cfg)
            return out.y[None], jax.lax.psum(out.dropped, GROUP_AXIS)

        g = P(GROUP_AXIS)
        fn = jax.shard_map(body, mesh=self.mesh, in_specs=(g,) * 6, out_specs=(g, P()), axis_names={GROUP_AXIS},
                           check_vma=False)
        with jax.named_scope("foe_routed"):
            y, dropped = fn(xv, idx, w, experts.w_gate, experts.w_up, experts.w_down)
        return y.reshape(hg, b, s, d), dropped

    def group_sum(self, v: jax.Array) -> jax.Array:
        """[H, ...] -> [...]: local sum of a device group's groups, then psum over `group`."""
        gm = self.device_groups
        vv = v.reshape(gm, v.shape[0] // gm, *v.shape[1:])
        fn = jax.shard_map(lambda a: jax.lax.psum(a[0].sum(0), GROUP_AXIS), mesh=self.mesh, in_specs=P(GROUP_AXIS),
                           out_specs=P(), axis_names={GROUP_AXIS}, check_vma=False)
        return fn(vv)

    def constrain_groups(self, v: jax.Array) -> jax.Array:
        """v [H, b, s, ...]: group dim over `group`, batch over the token axes."""
        spec = P(GROUP_AXIS, BATCH_AXES, *([None] * (v.ndim - 2)))
        return jax.lax.with_sharding_constraint(v, NamedSharding(self.mesh, spec))

    def __call__(self, x, route: RouteResult, experts: ExpertWeights, cfg) -> RoutedOutput:
        """Plain RoutedComputeFn view (sum over the groups); `route` must be an FoE routing."""
        y, dropped = self.group_routed(x, route, experts, cfg, cfg.num_groups)
        return RoutedOutput(y=self.group_sum(y), dropped=dropped)

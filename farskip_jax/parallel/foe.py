"""Expert parallelism for Federation of Experts (model/foe.py): each group's all-to-all stays on the
group's own devices; the cross-group sum is an explicit collective.

    mesh  = make_foe_mesh(cfg.mesh, cfg.runtime.num_groups)       # axes data, fsdp, group, expert, tensor
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
      expert-parallel exchange of `cfg.runtime.dispatch` (parallel/ep.py: all_to_all or ragged) on its
      own H/G_m groups' "virtual tokens" (as model/foe.SingleDeviceFoE) with the group's expert ids, over
      the `expert` axis of this mesh = the devices of its group only.
  group_sum(v [H, ...]) -> [...]
      psum over `group` inside shard_map (the cross-group all-reduce of the paper).
  constrain_groups(v [H, b, s, d])
      places group h's stream on its device group (attention of group h runs there).

Token-sharded layout (runtime.foe_tokens=sharded, TokenLayout): between the groups'
sub-blocks tokens are split over `group` as well (SHARD_AXES); the sums are `group_scatter`
(reduce-scatter), a group's inputs `gather_groups` (all-gather into a copy per device group), so the
dense parts run once per token. `foe_mesh_from(..., placement="strided")`: group g = ranks r % G_m.
Payloads (runtime.foe_sum_dtype): `reduce_scatter_as` / `all_gather_as` cast to float32 / bfloat16, or
send per-token scaled fp8 (`fp8_reduce_scatter`: an all-to-all of uint8 [.., d + 4] shards and a
local fp32 sum; `fp8_all_gather`; each the other's backward).

Bytes per layer (the paper's single-node formula): with T tokens per data shard, the ordinary
MoE's dispatch all-to-all moves T*k*d rows*width over ep devices, a fraction (ep-1)/ep leaving the
device; FoE's moves the same T*k*d in total but each device group's T*(k/H)*d only over its ep/G_m
devices (fraction (ep/G_m - 1)/(ep/G_m)), plus the cross-group all-reduce of T*d per sum
(2(G_m-1)/G_m of it on the wire).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from farskip_jax.config import MeshConfig
from farskip_jax.errors import ConfigError
from farskip_jax.model.experts import ExpertWeights, RoutedOutput
from farskip_jax.model.foe import FoEBackend, GroupValues
from farskip_jax.model.router import RouteResult
from farskip_jax.parallel.ep import routed_compute_for
from farskip_jax.parallel.mesh import BATCH_AXES, make_mesh
from farskip_jax.parallel.sharding import RULES, logical_to_spec

GROUP_AXIS = "group"
FOE_MESH_AXES = ("data", "fsdp", GROUP_AXIS, "expert", "tensor")
FOE_RULES = {**RULES, "expert": (GROUP_AXIS, "expert")}
FOE_EXPERT_RULES = {**FOE_RULES, "mlp": None}
# token-sharded FoE layout (runtime.foe_tokens=sharded): tokens over the batch axes AND the device groups
SHARD_AXES = (*BATCH_AXES, GROUP_AXIS)


PLACEMENTS = ("contiguous", "strided")
FP8 = "float8_e4m3fn"
FP8_MAX = 448.0  # largest finite float8_e4m3fn


# ---- payloads of the cross-group sums / gathers (runtime.foe_sum_dtype) --------------------------------
# "auto": the values' own dtype; "float32" / "bfloat16": cast before the collective, back after (the
# backward collective then carries the same dtype); FP8: per-row (per token) scaled float8_e4m3fn,
# values and fp32 scale packed into one uint8 buffer [..., d + 4] (one collective, not two). An fp8
# reduce-scatter cannot sum in fp8: it is an all-to-all of the quantised shards and a local fp32 sum
# (the same bytes per device as a reduce-scatter over one GPU per node). Gradients: straight through
# the rounding; the backward collectives (all-gather <-> reduce-scatter) are fp8 too.


def quantize_rows(x: jax.Array) -> jax.Array:
    """x [..., d] -> uint8 [..., d + 4]: float8_e4m3fn of x / scale, scale = amax(|row|) / 448 (fp32,
    as its 4 bytes). Rounding error per element <= 2^-4 |x| + 2^-10 scale (3 mantissa bits;
    subnormal spacing 2^-9 below 2^-6)."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    q = jnp.clip(xf / scale, -FP8_MAX, FP8_MAX).astype(FP8)
    sb = jax.lax.bitcast_convert_type(scale[..., 0], jnp.uint8)  # [..., 4]
    return jnp.concatenate([jax.lax.bitcast_convert_type(q, jnp.uint8), sb], axis=-1)


def dequantize_rows(p: jax.Array) -> jax.Array:
    """uint8 [..., d + 4] (quantize_rows) -> fp32 [..., d]."""
    q = jax.lax.bitcast_convert_type(p[..., :-4], FP8).astype(jnp.float32)
    return q * jax.lax.bitcast_convert_type(p[..., -4:], jnp.float32)[..., None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def fp8_reduce_scatter(a: jax.Array, axis: str) -> jax.Array:
    """psum_scatter(a, axis, scatter_dimension=0, tiled=True) with fp8 payloads (inside shard_map):
    a [n, ...] (n divisible by the axis size G) -> [n / G, ...] in a's dtype."""
    g = jax.lax.psum(1, axis)
    chunks = quantize_rows(a).reshape(g, a.shape[0] // g, *a.shape[1:-1], a.shape[-1] + 4)
    recv = jax.lax.all_to_all(chunks, axis, 0, 0, tiled=True)  # [G, n/G, ...]: chunk from each member
    return dequantize_rows(recv).sum(0).astype(a.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def fp8_all_gather(x: jax.Array, axis: str) -> jax.Array:
    """all_gather(x, axis, axis=0, tiled=True) with fp8 payloads: x [m, ...] -> [G m, ...] in x's dtype."""
    return dequantize_rows(jax.lax.all_gather(quantize_rows(x), axis, axis=0, tiled=True)).astype(x.dtype)


fp8_reduce_scatter.defvjp(lambda a, axis: (fp8_reduce_scatter(a, axis), None),
                          lambda axis, _, ct: (fp8_all_gather(ct, axis),))
fp8_all_gather.defvjp(lambda x, axis: (fp8_all_gather(x, axis), None),
                      lambda axis, _, ct: (fp8_reduce_scatter(ct, axis),))


def reduce_scatter_as(a: jax.Array, axis: str, dtype: str = "auto") -> jax.Array:
    """Tiled reduce-scatter over dim 0 with payload `dtype` (see above); result in a's dtype."""
    if dtype == FP8:
        return fp8_reduce_scatter(a, axis)
    pd = a.dtype if dtype == "auto" else jnp.dtype(dtype)
    return jax.lax.psum_scatter(a.astype(pd), axis, scatter_dimension=0, tiled=True).astype(a.dtype)


def all_gather_as(x: jax.Array, axis: str, dtype: str = "auto") -> jax.Array:
    """Tiled all-gather over dim 0 with payload `dtype`; result in x's dtype."""
    if dtype == FP8:
        return fp8_all_gather(x, axis)
    pd = x.dtype if dtype == "auto" else jnp.dtype(dtype)
    return jax.lax.all_gather(x.astype(pd), axis, axis=0, tiled=True).astype(x.dtype)


def foe_mesh_from(mesh: Mesh, num_groups: int, placement: str = "contiguous") -> Mesh:
    """The FoE mesh over the devices of a plain 4-axis mesh (parallel/mesh.py), in the same order: its
    expert axis (size ep) split into group (G_m = min(H, ep)) x expert (ep / G_m).

    placement "contiguous": device group g = expert ranks [g ep/G_m, (g+1) ep/G_m) (group outer; with
    ep / G_m = GPUs per node a group is a node: its all-to-all stays inside, its sums cross nodes);
    "strided": device group g = ranks r with r % G_m == g (group inner; the G_m devices of a sum are
    neighbours, inside a node when G_m divides the GPUs per node, and a group's all-to-all spans
    the nodes)."""
    if GROUP_AXIS in mesh.shape:
        return mesh
    ep = mesh.shape["expert"]
    gm = min(num_groups, ep)
    if ep % gm or num_groups % gm:
        raise ConfigError(f"runtime.num_groups={num_groups} and mesh.expert={ep} must divide one another "
                          f"(e.g. mesh.expert={num_groups} or a multiple of it)")
    order = foe_device_order(mesh.devices.shape, gm, placement)
    devs = mesh.devices.reshape(-1)[order.reshape(-1)].reshape(order.shape)
    return Mesh(devs, FOE_MESH_AXES, axis_types=(AxisType.Auto,) * 5)


def foe_device_order(plain_shape: Sequence[int], device_groups: int, placement: str = "contiguous") -> np.ndarray:
    """[data, fsdp, group, expert, tensor] array of positions in a plain mesh of shape (data, fsdp,
    expert, tensor) (its devices.flat): which device each FoE mesh position gets (foe_mesh_from).
    The same program placed "strided" instead of "contiguous" runs logical device p on plain
    position foe_device_order(.., "strided").flat[p] (farskip_jax/studies/multinode_scaling.py re-times it)."""
    if placement not in PLACEMENTS:
        raise ConfigError(f"FoE group placement {placement!r} is unknown; choose one of {PLACEMENTS}")
    d, f, ep, t = plain_shape
    gm = device_groups
    ids = np.arange(d * f * ep * t).reshape(d, f, ep, t)
    if placement == "contiguous":
        return ids.reshape(d, f, gm, ep // gm, t)
    return ids.reshape(d, f, ep // gm, gm, t).transpose(0, 1, 3, 2, 4)


def make_foe_mesh(mcfg: Optional[MeshConfig], num_groups: int, devices: Optional[Sequence[jax.Device]] = None,
                  placement: str = "contiguous") -> Mesh:
    """The 5-axis FoE mesh: cfg.mesh (make_mesh's device order) with its expert axis split into (group, expert)
    (`placement`: foe_mesh_from)."""
    return foe_mesh_from(make_mesh(mcfg, devices), num_groups, placement)


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


class TokenLayout(GroupValues):
    """Where the [b, s, d] values between the groups' sub-blocks live (runtime.foe_tokens) on a FoE mesh.

    replicated (the paper's layout): on every device group; the cross-group sum is an all-reduce, the
    dense parts (dense MLP, shared expert, final norm, LM head) run once per device group. sharded:
    split over the device groups too; a cross-group sum is a reduce-scatter, the dense parts run on
    each device's own tokens, and the groups' inputs are all-gathered per device group. The values
    are the same in both (only where they live differs). sum_dtype (runtime.foe_sum_dtype): payload of
    the cross-group collectives."""

    def __init__(self, backend: "FoECompute", sharded: bool, sum_dtype: str = "auto"):
        super().__init__(backend, sum_dtype)
        self.sharded = bool(sharded)

    def sum(self, v: jax.Array) -> jax.Array:
        """[H, ...] -> [...]: all-reduce (replicated) or reduce-scatter (sharded)."""
        if self.sharded:
            return self.backend.group_scatter(v, self.sum_dtype)
        return self.backend.group_sum(v, self.sum_dtype)

    def device_groups(self, x: jax.Array, replicated: bool = False) -> jax.Array:
        """The routed experts' input: x [b, ...] itself (replicated layout), else [G_m, b, ...] each
        device group's own copy (an all-gather of the token shards, or a local copy of a value that
        is already on every device group)."""
        if not self.sharded:
            return x
        return self.backend.copy_groups(x) if replicated else self.backend.gather_groups(x, self.sum_dtype)

    def groups_h(self, x: jax.Array, num_groups: int, replicated: bool = False) -> jax.Array:
        """[H, b, ...]: x for each FoE group (the groups' attention inputs)."""
        if not self.sharded:
            return jnp.broadcast_to(x[None], (num_groups, *x.shape))
        xg = self.device_groups(x, replicated)  # [G_m, b, ...]
        gm = xg.shape[0]
        return jnp.broadcast_to(xg[:, None], (gm, num_groups // gm, *x.shape)).reshape(num_groups, *x.shape)

    def replicated(self, x: jax.Array) -> jax.Array:
        """x pinned group-replicated when sharded (a value computed from replicated inputs)."""
        return self.backend.to_groups(x) if self.sharded else x

    def shards(self, x):
        """x (or None) in the token-sharded layout when sharded (a local slice; free)."""
        return self.backend.to_shards(x) if self.sharded and x is not None else x


@dataclasses.dataclass(frozen=True)
class FoECompute(FoEBackend):
    """FoE routed-compute backend on a mesh from `make_foe_mesh` (see module doc): the model/foe.py
    FoEBackend protocol on a mesh, token-sharded layout included (TokenLayout)."""

    mesh: Mesh
    dispatch: str = "all_to_all"

    def token_layout(self, sharded: bool, sum_dtype: str = "auto") -> TokenLayout:
        return TokenLayout(self, sharded, sum_dtype)

    @property
    def device_groups(self) -> int:
        return self.mesh.shape[GROUP_AXIS]

    def group_routed(self, x: jax.Array, route: RouteResult, experts: ExpertWeights, cfg, num_groups: int):
        """x: [b, s, d] (or [G_m, b, s, d]: each device group's own copy, gather_groups), route: FoE
        routing (choices group-major, global expert ids) -> ([H, b, s, d], dropped)."""
        gm, hg = self.device_groups, num_groups
        if hg % gm:
            raise ConfigError(f"runtime.num_groups={hg} is not a multiple of the mesh's group axis ({gm})")
        hpm = hg // gm  # FoE groups per device group
        b, s, d = x.shape[-3:]
        kg = route.indices.shape[-1] // hg
        em = experts.w_gate.shape[0] // gm  # experts per device group

        def per_device_group(v):  # [b, s, H*kg] -> [G_m, hpm*b, s, kg] (group-major virtual tokens)
            return v.reshape(b, s, hg, kg).transpose(2, 0, 1, 3).reshape(gm, hpm * b, s, kg)

        idx = per_device_group(route.indices) - (jnp.arange(gm, dtype=jnp.int32) * em)[:, None, None, None]
        w = per_device_group(route.weights)
        xg = x if x.ndim == 4 else x[None]
        xv = jnp.broadcast_to(xg[:, None], (gm, hpm, b, s, d)).reshape(gm, hpm * b, s, d)
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

    def group_sum(self, v: jax.Array, dtype: str = "auto") -> jax.Array:
        """[H, ...] -> [...]: local sum of a device group's groups, then psum over `group` (payload
        `dtype`: auto, float32 or bfloat16; fp8 needs the token-sharded layout)."""
        if dtype == FP8:
            raise ConfigError("runtime.foe_sum_dtype=float8_e4m3fn needs runtime.foe_tokens=sharded")
        gm = self.device_groups
        vv = v.reshape(gm, v.shape[0] // gm, *v.shape[1:])
        pd = v.dtype if dtype == "auto" else jnp.dtype(dtype)

        def body(a):
            return jax.lax.psum(a[0].sum(0).astype(pd), GROUP_AXIS).astype(v.dtype)

        fn = jax.shard_map(body, mesh=self.mesh, in_specs=P(GROUP_AXIS),
                           out_specs=P(), axis_names={GROUP_AXIS}, check_vma=False)
        return fn(vv)

    # ---- token-sharded layout (runtime.foe_tokens=sharded, TokenLayout): [b, ...] values between the
    # groups' sub-blocks are split over the batch axes x `group` (SHARD_AXES), so the dense parts run
    # once; a group-replicated view is gathered where a group's attention or experts read it.

    def _check_shardable(self, b: int) -> None:
        n = self.mesh.size // self.mesh.shape["tensor"]
        if b % n:
            raise ConfigError(f"runtime.foe_tokens=sharded splits the batch ({b} rows) over data x fsdp x expert x "
                              f"group = {n} devices; make the batch a multiple of {n} or use "
                              f"runtime.foe_tokens=replicated")

    def group_scatter(self, v: jax.Array, dtype: str = "auto") -> jax.Array:
        """[H, b, ...] -> [b, ...] token-sharded (SHARD_AXES): the cross-group sum as a reduce-scatter
        over `group` (local sum of a device group's groups first; payload `dtype`, reduce_scatter_as)."""
        gm = self.device_groups
        self._check_shardable(v.shape[1])
        vv = v.reshape(gm, v.shape[0] // gm, *v.shape[1:])
        spec = P(GROUP_AXIS, None, BATCH_AXES, *([None] * (v.ndim - 2)))

        def body(a):
            return reduce_scatter_as(a[0].sum(0), GROUP_AXIS, dtype)

        fn = jax.shard_map(body, mesh=self.mesh, in_specs=spec, out_specs=P(SHARD_AXES), check_vma=False)
        return fn(vv)

    def gather_groups(self, x: jax.Array, dtype: str = "auto") -> jax.Array:
        """[b, ...] token-sharded -> [G_m, b, ...]: device group g's own copy of every token of its data
        shard (group dim over `group`, batch over BATCH_AXES): an all-gather over `group`. A copy per
        device group (not one value replicated over them) keeps the backward a reduce-scatter of the
        groups' own cotangents (a replicated value's cotangent would first be all-reduced). Payload
        `dtype` (all_gather_as)."""
        self._check_shardable(x.shape[0])
        x = self.to_shards(x)
        fn = jax.shard_map(lambda a: all_gather_as(a, GROUP_AXIS, dtype)[None], mesh=self.mesh,
                           in_specs=P(SHARD_AXES), out_specs=P(GROUP_AXIS, BATCH_AXES), check_vma=False)
        return fn(x)

    def copy_groups(self, x: jax.Array) -> jax.Array:
        """x [b, ...] already on every device group (e.g. the embedding of the tokens) -> [G_m, b, ...]
        per-group copies (gather_groups' layout) without communication."""
        v = jnp.broadcast_to(x[None], (self.device_groups, *x.shape))
        return jax.lax.with_sharding_constraint(v, NamedSharding(self.mesh, P(GROUP_AXIS, BATCH_AXES)))

    def to_groups(self, x: jax.Array) -> jax.Array:
        """x [b, ...] constrained to the group-replicated layout (batch over BATCH_AXES only): for a
        value computed from group-replicated inputs (the embedding of the tokens), so that XLA does not
        compute it token-sharded and all-gather it back."""
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P(BATCH_AXES)))

    def to_shards(self, x: jax.Array) -> jax.Array:
        """x [b, ...] constrained to the token-sharded layout (a local slice of a group-replicated x)."""
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P(SHARD_AXES)))

    def constrain_groups(self, v: jax.Array) -> jax.Array:
        """v [H, b, s, ...]: group dim over `group`, batch over the token axes."""
        spec = P(GROUP_AXIS, BATCH_AXES, *([None] * (v.ndim - 2)))
        return jax.lax.with_sharding_constraint(v, NamedSharding(self.mesh, spec))

    def __call__(self, x, route: RouteResult, experts: ExpertWeights, cfg) -> RoutedOutput:
        """Plain RoutedComputeFn view (sum over the groups); `route` must be an FoE routing."""
        y, dropped = self.group_routed(x, route, experts, cfg, cfg.num_groups)
        return RoutedOutput(y=self.group_sum(y), dropped=dropped)

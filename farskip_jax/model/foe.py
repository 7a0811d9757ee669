"""Federation of Experts (FoE, arXiv 2605.06206) as a model option: `runtime.num_groups = H > 1`.

Each layer is split into H groups. Group h owns
  - query heads [h*nh/H, (h+1)*nh/H) with their kv heads [h*nkv/H, (h+1)*nkv/H) (the rows of o_proj
    of those heads included),
  - routed experts [h*E/H, (h+1)*E/H) and a router over them only, which picks k/H of them,
  - (under expert parallelism) 1/H of the expert-parallel devices (parallel/foe.py).
The parameter layout is the ordinary one (heads and experts grouped contiguously), so any checkpoint
runs with any num_groups and H = 1 is the ordinary model.

Dataflow of layer k (standard connectivity). With P_k the synchronised post-attention stream,
s_k the shared-expert (or dense-MLP) output, a^h_k / m^h_k group h's attention / routed outputs:

    X^h_{k-1} = P_{k-1} + s_{k-1} + m^h_{k-1}            group h's own representation (X^h_{-1} = emb)
    a^h_k     = Attn_h(norm(X^h_{k-1}))                   group h's heads, its own rows of o_proj
    P_k       = P_{k-1} + s_{k-1} + sum_h m^h_{k-1} + sum_h a^h_k        the cross-group sum
    m^h_k     = MoE_h(norm(P_k)),  s_k = Shared(norm(P_k))               every group reads P_k
    R_k       = P_k + s_k + sum_h m^h_k                   the full stream (goes to the final norm)

Collectives: P_k is ONE cross-group sum per layer, of sum_h (m^h_{k-1} + a^h_k) (the routed sum of
layer k-1 is deferred into it), whenever layers k .. k+skip_distance-1 are standard; next to a FarSkip
layer the routed and attention sums are taken separately (its streams need sum_h m^h alone).

In the vocabulary of the design notes (docs/design.md): the MoE reads `full` (R_{k-1} + a_k), and the `full` attention input of
group h is R_{k-1} minus the OTHER groups' routed outputs of layer k-1. Under FarSkip connectivity a
converted layer's attention reads `partial` / `outdated` (these lack every group's routed output of
layer k-1, so all groups read the same stream) and its MoE reads `outdated` = R_{k-1}; then neither
the cross-group sum nor the intra-group all-to-alls are on the critical path. Every preset,
`layers` set and `skip_distance` works as for the ordinary model (connectivity/streams.py).

Choices where the paper leaves details open (documented, see also docs/foe.md):
  - scoring: each group's router normalises over its own E/H experts (softmax per group); the
    top-k/H weights are normalised within the group when moe.norm_topk_prob. So each group's routed
    output is a convex combination (times routed_scaling_factor) and sum_h m^h carries weight H.
  - load-balance loss: per group ((E/H) * sum_i f_i P_i over the group's experts), averaged over the
    groups; z-loss: per group's logits, averaged. Both reduce to the ordinary ones at H = 1.
  - the routed outputs of the groups are computed as H "virtual tokens" per token (token t of group h
    carries group h's k/H choices); capacity (when set) therefore counts per expert in token order
    exactly like a per-group loop would.
  - dense layers (no routed experts): their MLP output counts as shared; the groups still split the
    attention heads, but all group representations coincide after a dense layer.
  - unsupported with H > 1 (rejected by `check_foe`): MLA attention, q/k norm over all heads,
    group-limited routing (moe.n_group > 1), route_on_input.

Token-sharded layout, runtime.foe_attention=local: where every group reads the same attention input
(FarSkip-converted layers, layer 0) sum_h a^h is the ordinary all-head attention of that input, so it
runs on each device's own tokens: no cross-group sum and no gather for it (a FarSkip layer keeps one
reduce-scatter, of the routed outputs, and one all-gather, of the MoE input; same values).

Code: the group axis lives in the ordinary modules (Router(x, num_groups=H), Attention(x_h,
num_groups=H), Linear.grouped; H = 1 is the ordinary model and traces no group axis). A layer is
`FoEStep`, the ordinary layer (model/layer_step.py) with the group hooks: group attention inputs
carried as [H, b, s, d], the cross-group sums, the deferral of a routed sum into the next attention
sum. Where the experts run and how the groups' values are summed is an `FoEBackend`: `SingleDeviceFoE`
(one program, the routed experts as H "virtual tokens" per token through the model's
RoutedComputeFn), or parallel/foe.FoECompute (group-confined expert parallelism, the cross-group sums
as collectives); where the values between the sub-blocks live is its `token_layout` (`GroupValues`
here: every device holds every token; parallel/foe.TokenLayout: runtime.foe_tokens=sharded).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct
from jax.ad_checkpoint import checkpoint_name

from farskip_jax.config import Config
from farskip_jax.errors import ConfigError
from farskip_jax.model.block import Block, BlockOutput
from farskip_jax.connectivity.streams import Streams, add_present
from farskip_jax.model.experts import ExpertWeights, RoutedComputeFn, local_routed_compute
from farskip_jax.model.layer_step import LayerStep
from farskip_jax.model.router import RouteResult


def check_foe(cfg: Config, num_groups: Optional[int] = None) -> int:
    """Validate the FoE-specific constraints; returns H. Raises ConfigError naming the culprit."""
    m, e = cfg.model, cfg.moe
    h = num_groups or cfg.runtime.num_groups
    if h == 1:
        return 1
    checks = [
        (m.num_kv_heads % h == 0, f"runtime.num_groups={h} must divide model.num_kv_heads={m.num_kv_heads}"),
        (m.num_heads % h == 0, f"runtime.num_groups={h} must divide model.num_heads={m.num_heads}"),
        (not e.num_experts or e.num_experts % h == 0, f"runtime.num_groups={h} must divide moe.num_experts={e.num_experts}"),
        (not e.num_experts or e.top_k % h == 0, f"runtime.num_groups={h} must divide moe.top_k={e.top_k}"),
        (m.attention != "mla", "runtime.num_groups > 1 (Federation of Experts) needs model.attention=gqa (MLA shares "
                               "one latent projection over all heads); set runtime.num_groups=1"),
        (not (m.qk_norm and m.qk_norm_scope == "all_heads"),
         "runtime.num_groups > 1 cannot split a q/k norm taken over all heads; use model.qk_norm_scope=head or num_groups=1"),
        (e.n_group == 1, "runtime.num_groups > 1 with group-limited routing (moe.n_group > 1) is not supported; set moe.n_group=1"),
        (not e.route_on_input, "moe.route_on_input needs top_k=1, which runtime.num_groups > 1 cannot split"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)
    return h


class FoEBackend(abc.ABC):
    """Where a Federation of Experts' routed experts run and how the groups' values are summed.

    group_routed(x [b, s, d] (or [G_m, b, s, d]: each device group's copy, token-sharded layout),
        route (FoE routing: choices group-major, global expert ids), experts, moe cfg, H)
        -> ([H, b, s, d] each group's routed output, dropped [])
    group_sum(v [H, ...], dtype) -> [...]: the cross-group sum (payload dtype runtime.foe_sum_dtype)
    constrain_groups(v [H, b, s, d]): place group h's values where group h runs (default: as is)
    token_layout(sharded, sum_dtype): where the values between the sub-blocks live (GroupValues)."""

    @abc.abstractmethod
    def group_routed(self, x: jax.Array, route: RouteResult, experts: ExpertWeights, cfg, num_groups: int):
        ...

    @abc.abstractmethod
    def group_sum(self, v: jax.Array, dtype: str = "auto") -> jax.Array:
        ...

    def constrain_groups(self, v: jax.Array) -> jax.Array:
        return v

    def token_layout(self, sharded: bool, sum_dtype: str = "auto") -> "GroupValues":
        return GroupValues(self, sum_dtype)


class SingleDeviceFoE(FoEBackend):
    """One program: group h's routed output is the model's RoutedComputeFn on H*b "virtual tokens"
    (token t of group h carries group h's k/H choices); the cross-group sum is a plain sum."""

    def __init__(self, routed_compute: RoutedComputeFn = local_routed_compute):
        self.routed_compute = routed_compute

    def group_routed(self, x, route, experts, cfg, num_groups):
        b, s, d = x.shape
        hg = num_groups
        kg = route.indices.shape[-1] // hg

        def per_group(v):  # [b, s, H*kg] -> [H*b, s, kg]
            return v.reshape(b, s, hg, kg).transpose(2, 0, 1, 3).reshape(hg * b, s, kg)

        r = RouteResult(indices=per_group(route.indices), weights=per_group(route.weights), aux_loss=None,
                        z_loss=None, load=None)
        xr = jnp.broadcast_to(x[None], (hg, b, s, d)).reshape(hg * b, s, d)
        out = self.routed_compute(xr, r, experts, cfg)
        return out.y.reshape(hg, b, s, d).astype(x.dtype), out.dropped

    def group_sum(self, v, dtype="auto"):
        return jnp.sum(v, axis=0)


def foe_backend(blocks: list) -> FoEBackend:
    """The FoEBackend of a model's layers: their routed-compute backend when it is one (parallel/foe.py),
    else SingleDeviceFoE around it (or around the local compute when no layer is MoE)."""
    rc = next((blk.moe.routed_compute for blk in blocks if blk.moe is not None), local_routed_compute)
    return rc if isinstance(rc, FoEBackend) else SingleDeviceFoE(rc)


class GroupValues:
    """Where the [b, s, d] values between the groups' sub-blocks live when every device (group) holds
    every token: the cross-group sum is the backend's group_sum (payload sum_dtype); a group's input
    is the value itself. parallel/foe.TokenLayout is the token-sharded one (runtime.foe_tokens=sharded)."""

    sharded = False

    def __init__(self, backend: FoEBackend, sum_dtype: str = "auto"):
        self.backend, self.sum_dtype = backend, sum_dtype

    def sum(self, v: jax.Array) -> jax.Array:
        """[H, ...] -> [...]."""
        return self.backend.group_sum(v, self.sum_dtype)

    def device_groups(self, x: jax.Array, replicated: bool = False) -> jax.Array:
        """The routed experts' input (token-sharded: each device group's gathered copy)."""
        return x

    def groups_h(self, x: jax.Array, num_groups: int, replicated: bool = False) -> jax.Array:
        """[H, b, ...]: x for each FoE group (the groups' attention inputs)."""
        return jnp.broadcast_to(x[None], (num_groups, *x.shape))

    def replicated(self, x: jax.Array) -> jax.Array:
        return x

    def shards(self, x):
        return x


# --------------------------------------------------------------------------------------------------
# the FoE layer: the ordinary step with the group hooks
# --------------------------------------------------------------------------------------------------


@struct.dataclass
class FoECarry:
    """What an FoE layer hands the next: the streams, sync = R_{k-1} minus every group's routed output
    of layer k-1 (= P_{k-1} + s_{k-1}), and those routed outputs per group m^h_{k-1} [H, b, s, d]."""

    streams: Streams
    sync: jax.Array
    routed_h: Optional[jax.Array] = None

    @property
    def full(self) -> jax.Array:
        return self.streams.full


@dataclasses.dataclass(frozen=True)
class FoEPlan:
    """Static choices of one FoE layer: local (token-local all-head attention, no attention sum),
    pending (the routed sum of layer k-1 joins this layer's attention sum), defer (this layer's routed
    sum is left to the next layer's attention sum)."""

    local: bool
    pending: bool
    defer: bool


class FoEStep(LayerStep):
    """The FoE layer (module doc) in the one layer loop; runs unrolled (scannable False: the per-layer
    deferral of the routed sums and the token-local attention are static per layer). Its BlockOutput
    adds attn_groups / routed_groups [H, b, s, d] (attn_groups None under token-local attention).

    defer=False keeps every routed sum in its own layer (out.routed always set); num_groups: H (default
    runtime.num_groups; 1 runs this dataflow on the ordinary model)."""

    scannable = False

    def __init__(self, model, positions: jax.Array, segment_ids: Optional[jax.Array], farskip, remat: str = "none",
                 cache=None, num_groups: Optional[int] = None, defer: bool = True):
        super().__init__(model, positions, segment_ids, farskip, remat, cache)
        cfg = model.cfg
        self.hg = check_foe(cfg, num_groups)
        self.layout = foe_backend(model.blocks()).token_layout(cfg.runtime.foe_tokens == "sharded", cfg.runtime.foe_sum_dtype)
        self.local_ok = self.layout.sharded and cfg.runtime.foe_attention == "local" and cache is None
        n, d = cfg.model.num_layers, farskip.skip_distance
        kinds = [farskip.layer_inputs(i, n) for i in range(n)]
        # the routed sum of layer i joins layer i+1's attention sum when the next d layers are standard
        self.defer = [defer and i + 1 < n and all(kinds[j] == ("full", "full") for j in range(i + 1, min(i + d, n - 1) + 1))
                      for i in range(n)]
        self.emb = None

    def init(self, h: jax.Array) -> FoECarry:
        self.emb = self.layout.replicated(h)  # group-replicated (the tokens are)
        return FoECarry(streams=Streams.init(self.emb, self.farskip.skip_distance), sync=self.emb)

    def plan(self, block, carry: FoECarry, site) -> FoEPlan:
        i = site.index
        # every group reads the same attention input: run it token-local (runtime.foe_attention=local)
        local = self.local_ok and not (site.kinds[0] == "full" and carry.routed_h is not None)
        return FoEPlan(local=local, pending=i > 0 and self.defer[i - 1], defer=self.defer[i])

    def attention_input(self, carry: FoECarry, site, plan: FoEPlan):
        """Group h's stream [H, b, s, d] (or one [b, s, d] under token-local attention), and the extra
        arrays of the layer: (the routed outputs of layer k-1 whose sum joins this attention sum or None,
        R_{k-1} when it is on every device group or None)."""
        layout, hg, streams = self.layout, self.hg, carry.streams
        on_all = lambda x: x is self.emb  # noqa: E731  the embedding is on every device group: no gather
        kind = site.kinds[0]
        with jax.named_scope("group_gather"):
            if plan.local:
                x = layout.shards(streams.attn_input(kind))
            elif kind == "full" and carry.routed_h is not None:  # group h's own X^h_{k-1}
                x = layout.groups_h(carry.sync, hg, on_all(carry.sync)) + carry.routed_h
            else:
                x = streams.attn_input(kind)
                x = layout.groups_h(x, hg, on_all(x))
        if not plan.local:
            x = layout.backend.constrain_groups(x)
        full_g = streams.full if layout.sharded and on_all(streams.full) else None
        return x, (carry.routed_h if plan.pending else None, full_g)

    def cache_rows(self, x: jax.Array) -> jax.Array:
        """Cache rows H*b (group h's at h*b + j): x [b, ...] tiled over the groups."""
        return jnp.tile(x, (self.hg, 1))

    def attention_of(self, site, plan: FoEPlan):
        hg = self.hg
        if plan.local:
            return None
        if hg > 1:
            return lambda attn, xn, pos, seg, cache: attn(xn, pos, seg, cache, num_groups=hg)

        def one_group(attn, xn, pos, seg, cache):  # H = 1 (tests: this dataflow reduces to the ordinary model)
            a, cache = attn(xn[0], pos, seg, cache)
            return a[None], cache

        return one_group

    def attention_sum(self, a: jax.Array, extra, site, plan: FoEPlan):
        """(sum_h a^h (+ the pending routed outputs): one cross-group sum, a^h)."""
        if plan.local:
            return a, None
        pending = extra[0]
        with jax.named_scope("group_sum"):
            return self.layout.sum(a if pending is None else a + pending), a

    def moe_input(self, x: jax.Array) -> jax.Array:
        return self.layout.shards(x)  # token-sharded: the norms, router and shared experts on the own tokens

    def ffn_options(self, block: Block, extra, site, plan: FoEPlan) -> dict:
        layout, hg, full_g = self.layout, self.hg, extra[1]
        known = site.kinds[1] != "full" and full_g is not None  # the MoE input is already everywhere

        def routed(moe, h, route):
            with jax.named_scope("group_gather"):
                h_in = layout.device_groups(block.ffn_norm(full_g) if known else h, replicated=known)
            m_h, dropped = layout.backend.group_routed(h_in, route, moe.experts.weights(moe.runtime.gmm), moe.runtime, hg)
            m_h = checkpoint_name(m_h, "routed_out")
            m = None
            if not plan.defer:
                with jax.named_scope("group_sum"):
                    m = layout.sum(m_h)
            return m, dropped, m_h

        return dict(routed=routed, num_groups=hg)

    def finish(self, out: BlockOutput, a, held, site, plan) -> BlockOutput:
        return out.replace(attn=a, attn_groups=held)

    def update(self, carry: FoECarry, out: BlockOutput, site) -> FoECarry:
        streams = carry.streams
        sync = add_present(streams.full + out.attn, out.shared)
        streams = streams.update(out.attn, out.shared, out.routed)
        if self.layout.sharded:  # every stream on the own tokens (a group-replicated term is sliced locally)
            streams = jax.tree.map(self.layout.shards, streams)
        return FoECarry(streams=streams, sync=sync, routed_h=out.routed_groups)


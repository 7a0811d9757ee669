"""Federation of Experts (FoE, arXiv 2605.06206) as a model option: `moe.num_groups = H > 1`.

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

In DESIGN.md's vocabulary: the MoE reads `full` (R_{k-1} + a_k), and the `full` attention input of
group h is R_{k-1} minus the OTHER groups' routed outputs of layer k-1. Under FarSkip connectivity a
converted layer's attention reads `partial` / `outdated` (these lack every group's routed output of
layer k-1, so all groups read the same stream) and its MoE reads `outdated` = R_{k-1}; then neither
the cross-group sum nor the intra-group all-to-alls are on the critical path. Every preset,
`layers` set and `skip_distance` works as for the ordinary model (model/connectivity.py).

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

Token-sharded layout, moe.foe_attention=local: where every group reads the same attention input
(FarSkip-converted layers, layer 0) sum_h a^h is the ordinary all-head attention of that input, so it
runs on each device's own tokens: no cross-group sum and no gather for it (a FarSkip layer keeps one
reduce-scatter, of the routed outputs, and one all-gather, of the MoE input; same values).

Code: the group axis lives in the ordinary modules (Router(x, num_groups=H), Attention(x_h,
num_groups=H), Linear.grouped; H = 1 is the ordinary model and traces no group axis). A layer is
`FoEStep`, run by the one layer loop (model/layer_loop.py) like the ordinary `LayerStep`; group
representations are carried as [H, b, s, d]. Where the experts run and how the groups' values are
summed is an `FoEBackend`: `SingleDeviceFoE` (one program, the routed experts as H "virtual tokens"
per token through the model's RoutedComputeFn), or parallel/foe.FoECompute (group-confined expert
parallelism, the cross-group sums as collectives, the token-sharded layout).
"""

from __future__ import annotations

import abc
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.ad_checkpoint import checkpoint_name

from farskip_jax.config import Config, FarSkipConfig
from farskip_jax.errors import ConfigError
from farskip_jax.model.block import REMAT_POLICIES, Block
from farskip_jax.model.connectivity import Streams, add_present, moe_stream
from farskip_jax.model.experts import ExpertWeights, RoutedComputeFn, local_routed_compute
from farskip_jax.model.router import RouteResult


def check_foe(cfg: Config, num_groups: Optional[int] = None) -> int:
    """Validate the FoE-specific constraints; returns H. Raises ConfigError naming the culprit."""
    m, e = cfg.model, cfg.moe
    h = num_groups or e.num_groups
    if h == 1:
        return 1
    checks = [
        (m.num_kv_heads % h == 0, f"moe.num_groups={h} must divide model.num_kv_heads={m.num_kv_heads}"),
        (m.num_heads % h == 0, f"moe.num_groups={h} must divide model.num_heads={m.num_heads}"),
        (not e.num_experts or e.num_experts % h == 0, f"moe.num_groups={h} must divide moe.num_experts={e.num_experts}"),
        (not e.num_experts or e.top_k % h == 0, f"moe.num_groups={h} must divide moe.top_k={e.top_k}"),
        (m.attention != "mla", "moe.num_groups > 1 (Federation of Experts) needs model.attention=gqa (MLA shares "
                               "one latent projection over all heads); set moe.num_groups=1"),
        (not (m.qk_norm and m.qk_norm_scope == "all_heads"),
         "moe.num_groups > 1 cannot split a q/k norm taken over all heads; use model.qk_norm_scope=head or num_groups=1"),
        (e.n_group == 1, "moe.num_groups > 1 with group-limited routing (moe.n_group > 1) is not supported; set moe.n_group=1"),
        (not e.route_on_input, "moe.route_on_input needs top_k=1, which moe.num_groups > 1 cannot split"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)
    return h


# --------------------------------------------------------------------------------------------------
# where the groups' experts run: the backend protocol
# --------------------------------------------------------------------------------------------------


class FoEBackend(abc.ABC):
    """Where a Federation of Experts' routed experts run and how the groups' values are summed.

    group_routed(x [b, s, d] (or [G_m, b, s, d], gather_groups), route (FoE routing: choices
        group-major, global expert ids), experts, moe cfg, H) -> ([H, b, s, d] each group's routed
        output, dropped [])
    group_sum(v [H, ...], dtype) -> [...]: the cross-group sum (payload dtype moe.foe_sum_dtype)
    constrain_groups(v [H, b, s, d]): place group h's values where group h runs (default: as is)
    token_sharding: whether values between sub-blocks can be split over the device groups
        (moe.foe_tokens=sharded); then group_scatter / gather_groups / copy_groups / to_groups /
        to_shards are the reduce-scatter, all-gather and placements of that layout (parallel/foe.py)."""

    token_sharding = False

    @abc.abstractmethod
    def group_routed(self, x: jax.Array, route: RouteResult, experts: ExpertWeights, cfg, num_groups: int):
        ...

    @abc.abstractmethod
    def group_sum(self, v: jax.Array, dtype: str = "auto") -> jax.Array:
        ...

    def constrain_groups(self, v: jax.Array) -> jax.Array:
        return v

    def _unsharded(self, what: str):
        raise ConfigError(f"moe.foe_tokens=sharded needs an expert-parallel FoE mesh ({what} of "
                          f"{type(self).__name__}); set moe.foe_tokens=replicated")

    def group_scatter(self, v: jax.Array, dtype: str = "auto") -> jax.Array:
        self._unsharded("group_scatter")

    def gather_groups(self, x: jax.Array, dtype: str = "auto") -> jax.Array:
        self._unsharded("gather_groups")

    def copy_groups(self, x: jax.Array) -> jax.Array:
        self._unsharded("copy_groups")

    def to_groups(self, x: jax.Array) -> jax.Array:
        self._unsharded("to_groups")

    def to_shards(self, x: jax.Array) -> jax.Array:
        self._unsharded("to_shards")


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


class TokenLayout:
    """Where the [b, s, d] values between the groups' sub-blocks live (moe.foe_tokens).

    replicated (the paper's layout, and every single-device run): on every device group; the
    cross-group sum is an all-reduce, the dense parts (dense MLP, shared expert, final norm, LM
    head) run once per device group. sharded (a backend with token_sharding): split over the device
    groups too; a cross-group sum is a reduce-scatter, the dense parts run on each device's own
    tokens, and the groups' inputs are all-gathered per device group. The values are the same in
    both (only where they live differs). sum_dtype (moe.foe_sum_dtype): payload of the cross-group
    collectives of a parallel backend (a single device has no collective and ignores it)."""

    def __init__(self, backend: FoEBackend, sharded: bool, sum_dtype: str = "auto"):
        self.backend = backend
        self.sharded = bool(sharded) and backend.token_sharding
        self.sum_dtype = sum_dtype

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


# --------------------------------------------------------------------------------------------------
# one FoE layer and its step in the layer loop
# --------------------------------------------------------------------------------------------------


@struct.dataclass
class FoEBlockOutput:
    attn: jax.Array  # [b, s, d] sum_h a^h
    attn_groups: Optional[jax.Array]  # [H, b, s, d] (None under token-local attention)
    shared: Optional[jax.Array]  # [b, s, d]
    routed: Optional[jax.Array]  # [b, s, d] sum_h m^h (None when its sum is deferred)
    routed_groups: Optional[jax.Array]  # [H, b, s, d]
    aux_loss: jax.Array
    z_loss: jax.Array
    load: Optional[jax.Array]
    dropped: jax.Array
    importance: Optional[jax.Array] = None  # [H, E/H] mean router probability per group


def foe_block(block: Block, x_h: jax.Array, full: jax.Array, positions, segment_ids, moe_input: str,
              num_groups: int, layout: TokenLayout, pending_h: Optional[jax.Array] = None,
              defer_routed: bool = False, attention_fn=None, full_groups: Optional[jax.Array] = None,
              local_attention: bool = False) -> FoEBlockOutput:
    """One FoE layer. x_h: [H, b, s, d] group attention inputs; full: [b, s, d] = R_{k-1}.

    pending_h: [H, b, s, d] routed outputs of layer k-1 whose cross-group sum was deferred: they join
    this layer's attention sum (one all-reduce: `attn` is then sum_h (a^h + m^h_{k-1})) and `full`
    must lack them. defer_routed: leave this layer's routed sum to the next layer (`routed` None).
    attention_fn(normalised x_h) -> a_h replaces the groups' attention (KV-cache decoding).
    layout: TokenLayout. Sharded: the sums are reduce-scatters; the norms, router, shared expert and
    dense MLP run on the device's own tokens; the routed experts on each device group's gathered
    copy of the normalised MoE input. full_groups: `full` when it is known to be on every device group
    (the embedding): an outdated MoE input is then copied, not gathered. local_attention: x_h is ONE
    [b, s, d] input that every group reads (token-sharded): the ordinary all-head attention on the
    own tokens = sum_h a^h (no sum; attn_groups None, pending_h must be None)."""
    if local_attention:
        assert pending_h is None, "a deferred routed sum needs the groups' attention sum"
        with jax.named_scope("attention"):
            a, a_h = block.attention(x_h, positions, segment_ids), None
    else:
        with jax.named_scope("attention"):
            xn_h = block.attn_norm(x_h)
            if attention_fn is not None:
                a_h = attention_fn(xn_h)
            elif num_groups > 1:
                a_h = block.attn(xn_h, positions, segment_ids, num_groups)
            else:  # H = 1 (tests: this dataflow reduces to the ordinary model)
                a_h = block.attn(xn_h[0], positions, segment_ids)[None]
            a_h = checkpoint_name(a_h, "attention_out")
        with jax.named_scope("group_sum"):
            a = layout.sum(a_h if pending_h is None else a_h + pending_h)
    x_moe = layout.shards(moe_stream(moe_input, full, a))
    zero = jnp.zeros((), jnp.float32)
    with jax.named_scope("moe" if block.is_moe else "mlp"):
        h = block.ffn_norm(x_moe)  # sharded layout: on the own tokens (router, shared expert once)
        if block.moe is None:
            with jax.named_scope("dense_mlp"):
                s = checkpoint_name(block.mlp(h), "shared_out")
            return FoEBlockOutput(attn=a, attn_groups=a_h, shared=s, routed=None, routed_groups=None,
                                  aux_loss=zero, z_loss=zero, load=None, dropped=jnp.zeros((), jnp.int32))
        moe = block.moe
        with jax.named_scope("router"):
            route = moe.router(h, num_groups)
        with jax.named_scope("group_gather"):
            known = moe_input != "full" and full_groups is not None  # the MoE input is already everywhere
            h_in = layout.device_groups(block.ffn_norm(full_groups) if known else h, replicated=known)
        m_h, dropped = layout.backend.group_routed(h_in, route, moe.experts.weights(moe.cfg.gmm), moe.cfg, num_groups)
        m_h = checkpoint_name(m_h, "routed_out")
        m = None
        if not defer_routed:
            with jax.named_scope("group_sum"):
                m = layout.sum(m_h)
        shared = moe.shared_out(h)
        if shared is not None:
            shared = checkpoint_name(shared, "shared_out")
    return FoEBlockOutput(attn=a, attn_groups=a_h, shared=shared, routed=m, routed_groups=m_h,
                          aux_loss=route.aux_loss, z_loss=route.z_loss, load=route.load, dropped=dropped,
                          importance=route.importance)


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


class FoEStep:
    """The FoE layer in the one layer loop (model/layer_loop.py): step(block, carry, site, side_q) ->
    (carry, FoEBlockOutput, side_q). Runs unrolled (scannable False: the per-layer deferral of the
    routed sums and the token-local attention are static per layer). `attention` / `trace` as
    LayerStep's (the replacement attention takes and returns [H, b, t, d]); trace entries add
    `attn_groups` / `routed_groups` [H, b, s, d] and `attn_in` is [H, b, s, d]."""

    scannable = False

    def __init__(self, model, positions: jax.Array, segment_ids: Optional[jax.Array], farskip: FarSkipConfig,
                 remat: str = "none", attention: Optional[Callable] = None, trace: Optional[list] = None,
                 num_groups: Optional[int] = None):
        cfg = model.cfg
        self.hg = check_foe(cfg, num_groups)
        self.positions, self.segment_ids = positions, segment_ids
        self.remat, self.attention, self.trace = remat, attention, trace
        self.layout = TokenLayout(foe_backend(model.blocks()), cfg.moe.foe_tokens == "sharded", cfg.moe.foe_sum_dtype)
        self.local_ok = self.layout.sharded and cfg.moe.foe_attention == "local" and attention is None and trace is None
        n, d = cfg.model.num_layers, farskip.skip_distance
        kinds = [farskip.layer_inputs(i, n) for i in range(n)]
        # the routed sum of layer i joins layer i+1's attention sum when the next d layers are standard
        self.defer = [trace is None and i + 1 < n and all(kinds[j] == ("full", "full")
                                                          for j in range(i + 1, min(i + d, n - 1) + 1))
                      for i in range(n)]
        self.emb = None

    def init(self, h: jax.Array, farskip: FarSkipConfig) -> FoECarry:
        self.emb = self.layout.replicated(h)  # group-replicated (the tokens are)
        return FoECarry(streams=Streams.init(self.emb, farskip.skip_distance), sync=self.emb)

    def __call__(self, block: Block, carry: FoECarry, site, side_q=None):
        i, (attn_kind, moe_kind) = site.index, site.kinds
        layout, hg, streams = self.layout, self.hg, carry.streams
        on_all = lambda x: x is self.emb  # noqa: E731  the embedding is on every device group: no gather
        pending = carry.routed_h if i > 0 and self.defer[i - 1] else None
        # every group reads the same attention input: run it token-local (moe.foe_attention=local)
        local = self.local_ok and not (attn_kind == "full" and carry.routed_h is not None)
        with jax.named_scope("group_gather"):
            if local:
                x_attn = layout.shards(streams.attn_input(attn_kind))
            elif attn_kind == "full" and carry.routed_h is not None:  # group h's own X^h_{k-1}
                x_attn = layout.groups_h(carry.sync, hg, on_all(carry.sync)) + carry.routed_h
            else:
                x = streams.attn_input(attn_kind)
                x_attn = layout.groups_h(x, hg, on_all(x))
        if not local:
            x_attn = layout.backend.constrain_groups(x_attn)
        full_g = streams.full if layout.sharded and on_all(streams.full) else None
        kw = dict(moe_input=moe_kind, num_groups=hg, layout=layout, defer_routed=self.defer[i],
                  local_attention=local)
        if self.attention is not None:
            fn, get_side = self.attention(block, site, side_q)
            out = foe_block(block, x_attn, streams.full, self.positions, self.segment_ids, pending_h=pending,
                            attention_fn=fn, full_groups=full_g, **kw)
            side_q = get_side()
        elif self.remat == "none":
            out = foe_block(block, x_attn, streams.full, self.positions, self.segment_ids, pending_h=pending,
                            full_groups=full_g, **kw)
        else:  # the model's remat policy, as model/layer_loop.run_block applies it
            gd, st = nnx.split(block)

            def fn(st, xa, f, pe, fg):
                return foe_block(nnx.merge(gd, st), xa, f, self.positions, self.segment_ids, pending_h=pe,
                                 full_groups=fg, **kw)

            out = jax.checkpoint(fn, policy=REMAT_POLICIES[self.remat])(st, x_attn, streams.full, pending, full_g)
        if self.trace is not None:
            self.trace.append(dict(attn_in=x_attn, moe_in=streams.moe_input(moe_kind, out.attn), attn=out.attn,
                                   attn_groups=out.attn_groups, shared=out.shared, routed=out.routed,
                                   routed_groups=out.routed_groups, attn_kind=attn_kind, moe_kind=moe_kind))
        sync = add_present(streams.full + out.attn, out.shared)
        streams = streams.update(out.attn, out.shared, out.routed)
        if layout.sharded:  # every stream on the own tokens (a group-replicated term is sliced locally)
            streams = jax.tree.map(layout.shards, streams)
        return FoECarry(streams=streams, sync=sync, routed_h=out.routed_groups), out, side_q

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
    `score_scope="global"` (argument of `group_route`) instead takes one softmax over all E experts.
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

Single device: group representations are carried as [H, b, s, d]; the attention of all groups runs
as one einsum over the leading H axis with per-group views of the q/k/v/o weights. The routed
compute goes through the model's pluggable `RoutedComputeFn`; a backend that also has
`group_routed(x, route, experts, cfg, H) -> ([H,b,s,d], dropped)` and `group_sum(v [H,...])` (the
group-confined expert-parallel one in parallel/foe.py) is used as such.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.ad_checkpoint import checkpoint_name

from farskip_jax.config import Config, FarSkipConfig
from farskip_jax.errors import ConfigError
from farskip_jax.model.attention import Attention, core_attention, layer_mask
from farskip_jax.model.connectivity import Streams, add_present
from farskip_jax.model.experts import ExpertWeights
from farskip_jax.model.router import RouteResult, Router

if TYPE_CHECKING:  # annotations only: transformer.py imports this module lazily, not the reverse
    from farskip_jax.model.transformer import Transformer
from farskip_jax.model.block import REMAT_POLICIES, Block, ModelOutput


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
# routing: one router per group over its own experts
# --------------------------------------------------------------------------------------------------


def group_route(router: Router, x: jax.Array, num_groups: int, score_scope: str = "group") -> RouteResult:
    """Per-group token-choice routing. x: [b, s, d] -> RouteResult with
      indices [b, s, k] (global expert ids; choices [h*k/H, (h+1)*k/H) are group h's, all in
      [h*E/H, (h+1)*E/H)), weights [b, s, k] (normalised within the group when norm_topk_prob),
      aux_loss / z_loss (per-group, averaged over groups), load [E] (fraction of all b*s*k assignments).
    score_scope: "group" = softmax over the group's own experts; "global" = one softmax over all E."""
    cfg = router.cfg
    hg = num_groups
    logits = jnp.einsum("bsd,de->bse", x.astype(jnp.float32), router.w[...])
    b, s, e = logits.shape
    eg, kg = e // hg, cfg.top_k // hg
    lg = logits.reshape(b, s, hg, eg)
    if cfg.scoring == "softmax":
        scores = jax.nn.softmax(lg if score_scope == "group" else logits, -1).reshape(b, s, hg, eg)
    else:
        scores = jax.nn.sigmoid(lg)
    sel = scores + router.bias[...].reshape(hg, eg) if router.bias is not None else scores
    local = jax.lax.top_k(jax.lax.stop_gradient(sel), kg)[1].astype(jnp.int32)  # [b, s, H, kg]
    w = jnp.take_along_axis(scores, local, axis=-1)
    if cfg.norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    w = w * cfg.routed_scaling_factor
    idx = (local + (jnp.arange(hg, dtype=jnp.int32) * eg)[:, None]).reshape(b, s, hg * kg)
    counts = jnp.sum(jax.nn.one_hot(idx, e, dtype=jnp.float32), axis=(0, 1, 2))  # [E]
    load = counts / idx.size
    frac = counts.reshape(hg, eg) / (b * s * kg)  # fraction of each group's assignments
    probs = scores / (scores.sum(-1, keepdims=True) if cfg.scoring == "sigmoid" or score_scope == "global" else 1.0)
    aux = jnp.mean(eg * jnp.sum(jax.lax.stop_gradient(frac) * probs.mean(axis=(0, 1)), axis=-1))
    z = jnp.mean(jax.nn.logsumexp(lg, axis=-1) ** 2)
    return RouteResult(indices=idx, weights=w.reshape(b, s, hg * kg), aux_loss=aux, z_loss=z, load=load)


def group_routed(routed_compute, x: jax.Array, route: RouteResult, experts: ExpertWeights, cfg, num_groups: int):
    """Routed outputs of each group: ([H, b, s, d], dropped []).

    A FoE-aware backend (has `group_routed`) is called as such; any plain `RoutedComputeFn` gets the
    H*b "virtual tokens" (token t of group h carries group h's k/H choices) in one call."""
    if hasattr(routed_compute, "group_routed"):
        return routed_compute.group_routed(x, route, experts, cfg, num_groups)
    b, s, d = x.shape
    hg = num_groups
    kg = route.indices.shape[-1] // hg

    def per_group(v):  # [b, s, H*kg] -> [H*b, s, kg]
        return v.reshape(b, s, hg, kg).transpose(2, 0, 1, 3).reshape(hg * b, s, kg)

    r = RouteResult(indices=per_group(route.indices), weights=per_group(route.weights), aux_loss=None,
                    z_loss=None, load=None)
    xr = jnp.broadcast_to(x[None], (hg, b, s, d)).reshape(hg * b, s, d)
    out = routed_compute(xr, r, experts, cfg)
    return out.y.reshape(hg, b, s, d).astype(x.dtype), out.dropped


def group_sum(routed_compute, v: jax.Array, dtype: str = "auto") -> jax.Array:
    """The cross-group sum [H, ...] -> [...] (an explicit collective for the parallel backend, with
    payload `dtype` = moe.foe_sum_dtype; a single device has no collective and ignores it)."""
    if hasattr(routed_compute, "group_sum"):
        return routed_compute.group_sum(v, dtype)
    return jnp.sum(v, axis=0)


class TokenLayout:
    """Where the [b, s, d] values between the groups' sub-blocks live (moe.foe_tokens).

    replicated (the paper's layout, and every single-device run): on every device group; the
    cross-group sum is an all-reduce, the dense parts (dense MLP, shared expert, final norm, LM
    head) run once per device group. sharded (a backend with `group_scatter`, parallel/foe.py):
    split over the device groups too; a cross-group sum is a reduce-scatter, the dense parts run on
    each device's own tokens, and `groups(x)` all-gathers the group-replicated view a group's
    attention or experts read. The values are the same in both (only where they live differs).
    sum_dtype (moe.foe_sum_dtype): payload of the cross-group collectives of a parallel backend
    (auto = the values' dtype; a single device has no collective and ignores it)."""

    def __init__(self, backend, sharded: bool, sum_dtype: str = "auto"):
        self.backend = backend
        self.sharded = bool(sharded) and hasattr(backend, "group_scatter")
        self.sum_dtype = sum_dtype

    def sum(self, v: jax.Array) -> jax.Array:
        """[H, ...] -> [...]: all-reduce (replicated) or reduce-scatter (sharded)."""
        if self.sharded:
            return self.backend.group_scatter(v, self.sum_dtype)
        return group_sum(self.backend, v, self.sum_dtype)

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
# attention: group h's heads on group h's input
# --------------------------------------------------------------------------------------------------


def _group_proj(lin, x_h: jax.Array, hg: int) -> jax.Array:
    """Linear lin (w [d, n*hd]) applied per group: x_h [H, b, t, d] -> [H, b, t, n*hd/H] (group h uses
    columns [h*n*hd/H, (h+1)*n*hd/H))."""
    cd = lin.compute_dtype
    w = lin.w[...].astype(cd)
    w = w.reshape(w.shape[0], hg, w.shape[1] // hg)
    y = jnp.einsum("hbtd,dhe->hbte", x_h.astype(cd), w)
    if lin.b is not None:
        y = y + lin.b[...].astype(cd).reshape(hg, 1, 1, -1)
    return y


def group_qkv(attn: Attention, x_h: jax.Array, positions: jax.Array, num_groups: int):
    """x_h: [H, b, t, d] normalised group inputs, positions [b, t] -> q [H*b, t, nh/H, hd] and k, v
    [H*b, t, nkv/H, hd] of group h's heads (groups folded into the batch; rope, q/k norms applied).
    Mirrors Attention.qkv (head-scope q/k norm only: check_foe rejects all_heads)."""
    cfg = attn.cfg
    hg = num_groups
    _, b, t, _ = x_h.shape
    hd = cfg.resolved_head_dim
    nh, nkv = cfg.num_heads // hg, cfg.num_kv_heads // hg
    q = _group_proj(attn.q_proj, x_h, hg).reshape(hg * b, t, nh, hd)
    k = _group_proj(attn.k_proj, x_h, hg).reshape(hg * b, t, nkv, hd)
    v = _group_proj(attn.v_proj, x_h, hg).reshape(hg * b, t, nkv, hd)
    q, k = attn.position_qk(q, k, jnp.tile(positions, (hg, 1)))
    return q, k, v


def group_project_out(attn: Attention, o: jax.Array, x_h: jax.Array, num_groups: int) -> jax.Array:
    """o: [H*b, t, nh/H, hd] core output, x_h: [H, b, t, d] -> a_h [H, b, t, d] through group h's rows
    of o_proj (and its columns of the sigmoid gate). Mirrors AttentionBase.project_out."""
    hg = num_groups
    _, b, t, _ = x_h.shape
    o = o.reshape(hg, b, t, -1)
    if attn.gate_proj is not None:
        o = o * jax.nn.sigmoid(_group_proj(attn.gate_proj, x_h, hg))
    cd = attn.o_proj.compute_dtype
    wo = attn.o_proj.w[...].astype(cd)
    wo = wo.reshape(hg, wo.shape[0] // hg, wo.shape[1])
    return jnp.einsum("hbte,hed->hbtd", o.astype(cd), wo)


def group_attention(attn: Attention, x_h: jax.Array, positions: jax.Array, segment_ids: Optional[jax.Array],
                    num_groups: int) -> jax.Array:
    """x_h: [H, b, t, d] normalised group inputs -> a_h [H, b, t, d], group h's heads through its own
    rows of o_proj (sum_h a_h = ordinary attention when every group reads the same input).
    Mirrors Attention.qkv / __call__ / project_out (GQA with head-scope q/k norm, rope / NoPE,
    q/k L2 norm, temperature tuning, chunked masks, sigmoid gate), groups folded into the batch."""
    hg = num_groups
    with jax.named_scope("attention_qkv"):
        q, k, v = group_qkv(attn, x_h, positions, hg)
    with jax.named_scope("attention_core"):
        pos = jnp.tile(positions, (hg, 1))
        seg = None if segment_ids is None else jnp.tile(segment_ids, (hg, 1))
        o = core_attention(attn.cfg, q, k, v, layer_mask(attn.cfg, attn.layer_idx, pos, seg), attn.scale)
    with jax.named_scope("attention_out"):
        return group_project_out(attn, o, x_h, hg)


# --------------------------------------------------------------------------------------------------
# one layer and the whole forward
# --------------------------------------------------------------------------------------------------


@struct.dataclass
class FoEBlockOutput:
    attn: jax.Array  # [b, s, d] sum_h a^h
    attn_groups: jax.Array  # [H, b, s, d]
    shared: Optional[jax.Array]  # [b, s, d]
    routed: Optional[jax.Array]  # [b, s, d] sum_h m^h
    routed_groups: Optional[jax.Array]  # [H, b, s, d]
    aux_loss: jax.Array
    z_loss: jax.Array
    load: Optional[jax.Array]
    dropped: jax.Array


def foe_block(block: Block, x_h: jax.Array, full: jax.Array, positions, segment_ids, moe_input: str,
              num_groups: int, backend, pending_h: Optional[jax.Array] = None,
              defer_routed: bool = False, attention_fn=None, layout: Optional[TokenLayout] = None,
              full_groups: Optional[jax.Array] = None, local_attention: bool = False) -> FoEBlockOutput:
    """One FoE layer. x_h: [H, b, s, d] group attention inputs; full: [b, s, d] = R_{k-1}.

    pending_h: [H, b, s, d] routed outputs of layer k-1 whose cross-group sum was deferred: they join
    this layer's attention sum (one all-reduce: `attn` is then sum_h (a^h + m^h_{k-1})) and `full`
    must lack them. defer_routed: leave this layer's routed sum to the next layer (`routed` None).
    attention_fn(normalised x_h) -> a_h replaces group_attention (KV-cache decoding, eval/generate.py).
    layout: TokenLayout (default replicated). Sharded: the sums are reduce-scatters; the norms, router,
    shared expert and dense MLP run on the device's own tokens; the routed experts on each device
    group's gathered copy of the normalised MoE input. full_groups: `full` when it is known to be on
    every device group (the embedding): an outdated MoE input is then copied, not gathered.
    local_attention: x_h is ONE [b, s, d] input that every group reads (token-sharded): the ordinary
    all-head attention on the own tokens = sum_h a^h (no sum; attn_groups None, pending_h must be None)."""
    layout = layout or TokenLayout(backend, False)
    if local_attention:
        assert pending_h is None, "a deferred routed sum needs the groups' attention sum"
        with jax.named_scope("attention"):
            a, a_h = block.attention(x_h, positions, segment_ids), None
    else:
        with jax.named_scope("attention"):
            xn_h = block.attn_norm(x_h)
            a_h = (attention_fn(xn_h) if attention_fn is not None
                   else group_attention(block.attn, xn_h, positions, segment_ids, num_groups))
            a_h = checkpoint_name(a_h, "attention_out")
        with jax.named_scope("group_sum"):
            a = layout.sum(a_h if pending_h is None else a_h + pending_h)
    x_moe = layout.shards(full + a if moe_input == "full" else full)
    zero = jnp.zeros((), jnp.float32)
    with jax.named_scope("moe" if block.is_moe else "mlp"):
        if block.moe is None:
            h = block.ffn_norm(x_moe)
            with jax.named_scope("dense_mlp"):
                s = checkpoint_name(block.mlp(h), "shared_out")
            return FoEBlockOutput(attn=a, attn_groups=a_h, shared=s, routed=None, routed_groups=None,
                                  aux_loss=zero, z_loss=zero, load=None, dropped=jnp.zeros((), jnp.int32))
        h = block.ffn_norm(x_moe)  # sharded layout: on the own tokens (router, shared expert once)
        moe = block.moe
        with jax.named_scope("router"):
            route = group_route(moe.router, h, num_groups)
        with jax.named_scope("group_gather"):
            known = moe_input != "full" and full_groups is not None  # the MoE input is already everywhere
            h_in = layout.device_groups(block.ffn_norm(full_groups) if known else h, replicated=known)
        m_h, dropped = group_routed(moe.routed_compute, h_in, route, moe.experts.weights(moe.cfg.gmm), moe.cfg,
                                    num_groups)
        m_h = checkpoint_name(m_h, "routed_out")
        m = None
        if not defer_routed:
            with jax.named_scope("group_sum"):
                m = layout.sum(m_h)
        shared = moe.shared_out(h)
        if shared is not None:
            shared = checkpoint_name(shared, "shared_out")
    return FoEBlockOutput(attn=a, attn_groups=a_h, shared=shared, routed=m, routed_groups=m_h,
                          aux_loss=route.aux_loss, z_loss=route.z_loss, load=route.load, dropped=dropped)


def _backend(blocks: list):
    for blk in blocks:
        if blk.moe is not None:
            return blk.moe.routed_compute
    return None


def foe_forward(model: Transformer, tokens: jax.Array, positions: Optional[jax.Array] = None,
                segment_ids: Optional[jax.Array] = None, *, farskip: Optional[FarSkipConfig] = None,
                return_hidden: bool = False, return_trace: bool = False,
                num_groups: Optional[int] = None, attention_fns=None) -> ModelOutput:
    """The Transformer forward with FoE groups (same outputs as Transformer.__call__; trace entries
    add `attn_groups` / `routed_groups` [H, b, s, d] and `attn_in` is [H, b, s, d]).
    num_groups: default cfg.moe.num_groups (an explicit 1 runs this path as the ordinary model).
    attention_fns: per layer, a replacement for group_attention (foe_block's attention_fn; KV-cache
    decoding passes cached attention here); no remat then."""
    cfg = model.cfg
    hg = check_foe(cfg, num_groups)
    fs = farskip if farskip is not None else cfg.farskip
    blocks = model.blocks()  # per-layer views of stacked parameters under model.scan_layers (unrolled here)
    backend = _backend(blocks)
    n = len(blocks)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    layout = TokenLayout(backend, cfg.moe.foe_tokens == "sharded", cfg.moe.foe_sum_dtype)
    emb = layout.replicated(model.embed(tokens))  # group-replicated (the tokens are)
    streams = Streams.init(emb, fs.skip_distance)
    sync = emb  # R_{k-1} minus every group's routed output of layer k-1 (= P_{k-1} + s_{k-1})
    routed_h = None  # m^h_{k-1} [H, b, s, d]
    kinds = [fs.layer_inputs(i, n) for i in range(n)]
    # the embedding is on every device group already: its group copies need no gather
    on_all = lambda x: x is emb  # noqa: E731
    defer = [not return_trace and i + 1 < n and all(kinds[j] == ("full", "full")
                                                    for j in range(i + 1, min(i + fs.skip_distance, n - 1) + 1))
             for i in range(n)]
    outs, hidden, trace = [], [], []
    for i, block in enumerate(blocks):
        attn_kind, moe_kind = kinds[i]
        pending = routed_h if i > 0 and defer[i - 1] else None
        # every group reads the same attention input: run it token-local (moe.foe_attention=local)
        local = (layout.sharded and cfg.moe.foe_attention == "local" and attention_fns is None and not return_trace
                 and not (attn_kind == "full" and routed_h is not None))
        with jax.named_scope(f"layer_{i}"):
            with jax.named_scope("group_gather"):
                if local:
                    x_attn = layout.shards(streams.attn_input(attn_kind))
                elif attn_kind == "full" and routed_h is not None:
                    x_attn = layout.groups_h(sync, hg, on_all(sync)) + routed_h  # group h's own X^h_{k-1}
                else:
                    x = streams.attn_input(attn_kind)
                    x_attn = layout.groups_h(x, hg, on_all(x))
            if hasattr(backend, "constrain_groups") and not local:  # parallel/foe.py: group h's stream on its devices
                x_attn = backend.constrain_groups(x_attn)
            attn_fn = attention_fns[i] if attention_fns is not None else None
            full_g = streams.full if layout.sharded and on_all(streams.full) else None
            fn = lambda b, xa, f, p, s, pe, fg: foe_block(b, xa, f, p, s, moe_kind, hg, backend, pe,  # noqa: E731
                                                          defer[i], attn_fn, layout, fg, local)
            if cfg.model.remat != "none" and attention_fns is None:
                fn = nnx.remat(fn, policy=REMAT_POLICIES[cfg.model.remat])
            out = fn(block, x_attn, streams.full, positions, segment_ids, pending, full_g)
            if return_trace:
                trace.append(dict(attn_in=x_attn, moe_in=streams.moe_input(moe_kind, out.attn), attn=out.attn,
                                  attn_groups=out.attn_groups, shared=out.shared, routed=out.routed,
                                  routed_groups=out.routed_groups, attn_kind=attn_kind, moe_kind=moe_kind))
            sync = add_present(streams.full + out.attn, out.shared)
            routed_h = out.routed_groups
            streams = streams.update(out.attn, out.shared, out.routed)
            if layout.sharded:  # every stream on the own tokens (a group-replicated term is sliced locally)
                streams = jax.tree.map(layout.shards, streams)
        outs.append((block.is_moe, out))
        if return_hidden:
            hidden.append(streams.full)
    return model.output(streams.full, outs, hidden if return_hidden else None, trace if return_trace else None)

"""The collectives of the tp_ep serving layout (serving/tp_ep.py): tensor-parallel attention,
replicated-activation MoE with experts sharded, each ending in an all-reduce; no all-to-all.

One group of devices is at once the tensor-parallel group of attention and the expert-parallel group
of the MoE (vLLM / SGLang with TP 8 = EP 8 on one node). On the 4-axis mesh (data, fsdp, expert,
tensor) that is `mesh.tensor = 8` (data = fsdp = expert = 1 for the paper's layout):

    attention   heads over `tensor` (GQA: query and kv heads; kv heads replicated when tensor >
                num_kv_heads; MLA: per-head projections, the latent projections replicated), the output
                projection row-parallel, then psum over `tensor`       -> scope `attention_allreduce`
    MoE         every rank holds all tokens (activations replicated), routes them all, runs only its
                own experts (experts over expert x tensor = the EP group; dropless) and psums the
                routed sum over that group                             -> scope `routed_allreduce`
    shared experts  `inference.shared_experts: tensor` (default; the authors' SGLang layout): hidden
                units over `tensor` like a dense MLP, their per-rank partial sum added to another
                all-reduce (TpEpStep): to the attention's where the MoE reads R_{k-1} (FarSkip: one
                all-reduce of a + s, one of r per layer), to the routed one where every attention reads
                the full stream (standard: a, then s + r), else their own (`shared_allreduce`).
                `replicated`: whole on every rank, no collective of their own.

    layer = TpEpLayer(mesh, shared="tensor")      # the Transformer's layer_step on this layout
    model = Transformer(cfg, rngs=..., routed_compute=ReplicatedEPCompute(mesh), layer_step=layer)

The model's layer is the ordinary one (model/layer_step.py) with `TpEpStep`'s hooks: the
tensor-parallel attention (shard_map'd, the layer's own attention code per rank, KV cache included)
and, with tensor-parallel shared experts, the per-rank partial sums added before one all-reduce. So
with FarSkip the compiled program has no path from the attention all-reduce of layer k to the MoE of
layer k (which reads R_{k-1}), nor from the routed all-reduce of layer k to attention of layer k+1
(which reads N_k): XLA may run each all-reduce under the next sub-block (tests/test_inference_layout.py
checks the compiled HLO), provided its all-reduce combiner does not merge the two (serving/tp_ep.py:
the layout's compile options).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from farskip_jax.config import ModelConfig, RuntimeConfig
from farskip_jax.errors import ConfigError
from farskip_jax.model.attention import LayerCache
from farskip_jax.model.experts import ExpertWeights, RoutedOutput, expert_swiglu
from farskip_jax.model.layer_step import LayerStep
from farskip_jax.model.router import RouteResult

TP_AXIS = "tensor"
EP_AXES = ("expert", "tensor")  # the expert-parallel group: every device of a data replica
DATA_AXIS = "data"


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def check_shared_split(hidden: int, tp: int) -> None:
    """ConfigError unless the shared experts' `hidden` units split over mesh.tensor = tp."""
    if hidden % tp:
        raise ConfigError(f"inference.shared_experts=tensor splits the {hidden} hidden units of the shared experts "
                          f"over mesh.tensor={tp}; pick a mesh.tensor that divides them or set "
                          "inference.shared_experts=replicated")


def kv_replicas(m: ModelConfig, tp: int) -> int:
    """How many tensor ranks share one kv head (1 when tensor divides num_kv_heads; GQA only)."""
    if m.attention != "gqa" or m.num_kv_heads % tp == 0:
        return 1
    return tp // m.num_kv_heads


# --------------------------------------------------------------------------------------------------
# MoE: replicated activations, local experts, psum of the routed sum
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ReplicatedEPCompute:
    """RoutedComputeFn of the tp_ep layout (model/experts.py signature). Per device: the T tokens of
    its data replica [T, d] (all of them), their top-k choices; E_l = E / ep local experts
    (global expert e on EP rank e // E_l). The assignments to local experts are sorted first
    (the rest after them, outside the groups), at most T * min(k, E_l) rows go through the grouped
    SwiGLU, the weighted outputs are scattered back to their tokens and psum'd over expert x tensor
    (reduce=False: no psum; y is the per-rank partial sums [ep, b, s, d], for TpEpLayout.allreduce)."""

    mesh: Mesh
    reduce: bool = True

    def __call__(self, x, route: RouteResult, experts: ExpertWeights, cfg: RuntimeConfig) -> RoutedOutput:
        b, s, d = x.shape
        k = route.indices.shape[-1]
        num_e = experts.w_gate.shape[0]
        ep = self.mesh.shape["expert"] * self.mesh.shape[TP_AXIS]
        if num_e % ep:
            raise ConfigError(f"moe.num_experts={num_e} is not divisible by mesh.expert x mesh.tensor = {ep}")
        e_l = num_e // ep
        rows = min(k, e_l)

        def body(xt, idx, w, wg, wu, wd):
            t = xt.shape[0]
            with jax.named_scope("local_dispatch"):
                local = idx.reshape(-1) - jax.lax.axis_index(EP_AXES) * e_l  # [t*k] local expert id
                mine = (local >= 0) & (local < e_l)
                key = jnp.where(mine, local, e_l)
                order = jnp.argsort(key, stable=True)[: t * rows]  # every local assignment fits
                sizes = jnp.bincount(key, length=e_l + 1)[:e_l].astype(jnp.int32)
                xs = jnp.take(xt, order // k, axis=0)
            with jax.named_scope("expert_compute"):
                ys = expert_swiglu(xs, sizes, ExpertWeights(wg, wu, wd), cfg)  # rows past the groups: 0
            with jax.named_scope("local_combine"):
                wl = jnp.where(mine, w.reshape(-1), 0).astype(ys.dtype)[order]
                y = jnp.zeros((t, d), ys.dtype).at[order // k].add(ys * wl[:, None])
            if not self.reduce:
                return y[None]
            with jax.named_scope("routed_allreduce"):
                return jax.lax.psum(y, EP_AXES)

        tok, wsp = P(DATA_AXIS, None), P(EP_AXES, None, None)
        out = tok if self.reduce else P(EP_AXES, DATA_AXIS, None)
        fn = jax.shard_map(body, mesh=self.mesh, in_specs=(tok, tok, tok, wsp, wsp, wsp), out_specs=out,
                           check_vma=False)  # model code inside (gmm) does not track manual axes
        y = fn(x.reshape(b * s, d), route.indices.reshape(b * s, k), route.weights.reshape(b * s, k),
               experts.w_gate, experts.w_up, experts.w_down)
        return RoutedOutput(y=y.reshape(*y.shape[:-2], b, s, d), dropped=jnp.zeros((), jnp.int32))


# --------------------------------------------------------------------------------------------------
# attention: heads over `tensor`, psum after the output projection
# --------------------------------------------------------------------------------------------------


def local_model_config(m: ModelConfig, tp: int) -> ModelConfig:
    """The ModelConfig of one tensor rank's slice of an attention layer (num_heads / tp heads)."""
    h = m.num_heads // tp
    kv = max(m.num_kv_heads // tp, 1) if m.attention == "gqa" else h
    return dataclasses.replace(m, num_heads=h, num_kv_heads=kv, head_dim=m.resolved_head_dim)


@functools.lru_cache(maxsize=None)
def _local_graphdef(cls, m: ModelConfig, runtime: RuntimeConfig, layer_idx: int):
    return nnx.split(nnx.eval_shape(lambda: cls(m, runtime, rngs=nnx.Rngs(0), layer_idx=layer_idx)))[0]


@dataclasses.dataclass(frozen=True)
class TpEpLayer:
    """The tp_ep layer on `mesh` (module doc): calling it builds the layer step of one forward (the
    Transformer's `layer_step`); its collectives are the tensor-parallel attention and the all-reduces
    of partial sums. shared: "tensor" | "replicated" (inference.shared_experts). With "tensor" the
    attention and shared experts leave per-rank partial sums [tp, b, t, d] that TpEpStep all-reduces."""

    mesh: Mesh
    shared: str = "tensor"

    def __call__(self, model, positions, segment_ids, farskip, remat, cache=None) -> "TpEpStep":
        return TpEpStep(self, model, positions, segment_ids, farskip, cache)

    @property
    def partial_attention(self) -> bool:
        return self.shared == "tensor"

    @property
    def tp(self) -> int:
        return self.mesh.shape[TP_AXIS]

    def _split_attention(self, attn):
        """(local graphdef, state, in_specs of the state, fix(state, rank) -> local state)."""
        m, tp = attn.cfg, self.tp
        rep = kv_replicas(m, tp)
        gd_local = _local_graphdef(type(attn), local_model_config(m, tp), attn.runtime, attn.layer_idx)
        state = nnx.state(attn)
        hd = m.resolved_head_dim

        def spec(path, v):
            axes = v.get_metadata().get("axes") or ()
            return P(*[TP_AXIS if a == "heads" or (a == "kv_heads" and rep == 1) else None for a in axes])

        specs = jax.tree_util.tree_map_with_path(spec, state, is_leaf=_is_var)

        def fix(st, rank):
            """Per rank: a row-parallel output bias counts once; replicated kv heads sliced to the rank's."""
            def one(path, v):
                keys = [str(getattr(p, "key", p)) for p in path]
                axes = v.get_metadata().get("axes") or ()
                x = v.get_value()
                if keys[:2] == ["o_proj", "b"]:
                    x = jnp.where(rank == 0, x, jnp.zeros_like(x))
                elif rep > 1 and axes and axes[-1] == "kv_heads":
                    x = jax.lax.dynamic_slice_in_dim(x, (rank // rep) * hd, hd, axis=x.ndim - 1)
                return v.replace(x)
            return jax.tree_util.tree_map_with_path(one, st, is_leaf=_is_var)

        return gd_local, state, specs, fix

    def attention(self, attn, xn: jax.Array, positions: jax.Array, segment_ids: Optional[jax.Array],
                  cache: Optional[LayerCache] = None):
        """Tensor-parallel attention (Block.attend's `attention`): xn [b, t, d] normalised input -> (out
        [b, t, d] after the all-reduce over `tensor`, or the per-rank partial sums [tp, b, t, d] under
        partial_attention; cache): each rank runs its heads through the layer's own attention code
        (model/attention.py), the output projection's partial sum psum'd (scope attention_allreduce).
        cache: a LayerCache sharded by cache_sharding (stacked_cache_sharding with a row: only the
        layer's row enters the shard_map, its new keys / values come back out and are written into
        the stack after the row was read (an optimization barrier orders it), so XLA updates the
        carried stack in place)."""
        gd, state, specs, fix = self._split_attention(attn)
        b3, bspec, kv = P(DATA_AXIS, None, None), P(DATA_AXIS, None), P(DATA_AXIS, None, TP_AXIS, None)
        reduce = not self.partial_attention

        def allreduce(o):
            if not reduce:
                return o[None]
            with jax.named_scope("attention_allreduce"):
                return jax.lax.psum(o, TP_AXIS)

        out_spec = b3 if reduce else PARTIAL_TP
        if cache is None:
            def body(st, xn, pos, seg):
                o, _ = nnx.merge(gd, fix(st, jax.lax.axis_index(TP_AXIS)))(xn, pos, seg)
                return allreduce(o)

            f = jax.shard_map(body, mesh=self.mesh, in_specs=(specs, b3, bspec, None if segment_ids is None else bspec),
                              out_specs=out_spec, check_vma=False)
            return f(state, xn, positions, segment_ids), None

        stacked = cache.row is not None

        def cached(st, xn, pos, kc, vc, start, mask):
            local = nnx.merge(gd, fix(st, jax.lax.axis_index(TP_AXIS)))
            o, c = local(xn, pos, None, LayerCache(kc, vc, start, mask))
            return (allreduce(o), *(c.written if stacked else (c.k, c.v)))

        f = jax.shard_map(cached, mesh=self.mesh, in_specs=(specs, b3, bspec, kv, kv, P(), P(DATA_AXIS, None, None, None)),
                          out_specs=(out_spec, kv, kv), check_vma=False)
        if not stacked:
            o, kc, vc = f(state, xn, positions, cache.k, cache.v, cache.start, cache.mask)
            return o, cache.replace(k=kc, v=vc)
        kc, vc = cache.keys_values()
        o, k, v = jax.lax.optimization_barrier(f(state, xn, positions, kc, vc, cache.start, cache.mask))
        return o, cache.write(k, v)

    def shared_partial(self, moe, x: jax.Array) -> jax.Array:
        """MoEBlock's shared_fn: the shared experts' per-rank partial sums [tp, b, s, d] of x [b, s, d]
        (each rank its hidden units [h/tp]: gate / up columns, down rows), times the Qwen2 gate."""
        check_shared_split(moe.shared.gate.w.shape[-1], self.tp)  # a layout built without check_tp_ep
        gd, st = nnx.split(moe.shared)

        def spec(v):
            return P(*[TP_AXIS if a == "mlp" else None for a in (v.get_metadata().get("axes") or ())])

        def body(st, x):
            return nnx.merge(gd, st)(x)[None]

        with jax.named_scope("shared_experts"):
            y = jax.shard_map(body, mesh=self.mesh, in_specs=(jax.tree.map(spec, st, is_leaf=_is_var),
                                                               P(DATA_AXIS, None, None)),
                              out_specs=PARTIAL_TP, check_vma=False)(st, x)
            if moe.shared_gate is not None:
                y = y * jax.nn.sigmoid(moe.shared_gate(x))
        return y

    def allreduce(self, scope: str, tp_parts: tuple = (), ep_parts: tuple = ()) -> jax.Array:
        """ONE all-reduce (named scope `scope`) of per-rank partial sums -> [b, s, d]: tp_parts
        [tp, b, s, d] are partial over `tensor` (attention, shared experts), ep_parts [ep, b, s, d] over
        expert x tensor (ReplicatedEPCompute(reduce=False)); with both, the sum runs over expert x
        tensor and the tensor partials count on expert rank 0 only."""
        def body(tps, eps):
            t = functools.reduce(jnp.add, [p[0] for p in tps]) if tps else None
            if eps:
                e = functools.reduce(jnp.add, [p[0] for p in eps])
                if t is not None:
                    e = e + jnp.where(jax.lax.axis_index("expert") == 0, t, jnp.zeros_like(t))
                t = e
            with jax.named_scope(scope):
                return jax.lax.psum(t, EP_AXES if eps else TP_AXIS)

        f = jax.shard_map(body, mesh=self.mesh, in_specs=((PARTIAL_TP,) * len(tp_parts), (PARTIAL_EP,) * len(ep_parts)),
                          out_specs=P(DATA_AXIS, None, None), check_vma=False)
        return f(tuple(tp_parts), tuple(ep_parts))


PARTIAL_TP = P(TP_AXIS, DATA_AXIS, None, None)  # per-rank partial sums over `tensor` [tp, b, s, d]
PARTIAL_EP = P(EP_AXES, DATA_AXIS, None, None)  # over expert x tensor [ep, b, s, d]


class TpEpStep(LayerStep):
    """One layer on the tp_ep layout: the ordinary layer with the layout's tensor-parallel attention;
    with tensor-parallel shared experts (TpEpLayout.shared = tensor) attention and shared experts
    leave per-rank partial sums and each all-reduce sums what can travel together (attn_kinds: the
    attention inputs of every layer, FarSkipConfig.layer_inputs):

        MoE reads R_{k-1} and no attention reads `outdated`   allreduce(a + s)  allreduce(r)
        every attention reads the full stream                 allreduce(a)      allreduce(s + r)
        otherwise                                             allreduce(a)  allreduce(s)  allreduce(r)

    (scopes attention_allreduce / routed_allreduce / shared_allreduce; the plan of a layer is which
    sum carries s). The BlockOutput then carries a + s as attn (shared None) or s + r as routed: the
    streams take the same sums, the one-device model's up to the order of additions. Dense layers:
    allreduce(a), their MLP as placed (GSPMD). No remat; the full forward runs its layers unrolled
    (scannable only while decoding), decoding scans a stacked model."""

    def __init__(self, layout: TpEpLayer, model, positions, segment_ids, farskip, cache=None):
        super().__init__(model, positions, segment_ids, farskip, "none", cache)
        self.layout, self.scannable = layout, cache is not None
        n = model.cfg.model.num_layers
        self.attn_kinds = frozenset(farskip.layer_inputs(i, n)[0] for i in range(n))

    def plan(self, block, carry, site) -> Optional[str]:
        """Which all-reduce carries the shared experts' partial sum: attention | routed | shared | None."""
        if not (self.layout.partial_attention and block.is_moe and block.moe.shared is not None):
            return None
        if site.kinds[1] == "outdated" and "outdated" not in self.attn_kinds:
            return "attention"
        return "routed" if self.attn_kinds == {"full"} else "shared"

    def attention_of(self, site, plan):
        return self.layout.attention

    def attention_sum(self, a, extra, site, plan):
        if not self.layout.partial_attention:
            return a, None
        if plan == "attention":
            # XLA:GPU would fuse the add of s (which reads R_{k-1}, so waits for the routed all-reduce of
            # layer k-1) into the output projection's GEMM as its addend: the barrier keeps attention whole
            return None, jax.lax.optimization_barrier(a)
        return self.layout.allreduce("attention_allreduce", tp_parts=(a,)), None

    def ffn_options(self, block, extra, site, plan) -> dict:
        lay = self.layout
        if plan == "attention":
            return dict(shared=lay.shared_partial)
        if plan == "routed":
            def routed(moe, x, route):
                return moe.routed_experts(x, route, ReplicatedEPCompute(lay.mesh, reduce=False))

            def sums(out):
                return out.replace(shared=None, routed=lay.allreduce("routed_allreduce", tp_parts=(out.shared,),
                                                                     ep_parts=(out.routed,)))
            return dict(shared=lay.shared_partial, routed=routed, sums=sums)
        if plan == "shared":
            return dict(shared=lay.shared_partial,
                        sums=lambda out: out.replace(shared=lay.allreduce("shared_allreduce", tp_parts=(out.shared,))))
        return {}

    def finish(self, out, a, held, site, plan):
        if plan == "attention":
            return out.replace(attn=self.layout.allreduce("attention_allreduce", tp_parts=(held, out.shared)), shared=None)
        return out.replace(attn=a)

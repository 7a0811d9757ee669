"""The tp_ep serving layout (`inference.layout: tp_ep`, the paper's inference layout): the model
placed for it, its compile options and the shardings of batches and KV caches. The layer and its
collectives (tensor-parallel attention, replicated-activation MoE, the all-reduces of partial sums)
are parallel/tp_ep.py's.

    layout = TpEpLayout(mesh, shared="tensor")             # mesh = make_mesh(cfg.mesh); layout_for(cfg, mesh)
    model = inference_model(cfg, mesh, st)                 # any state, placed for the layout
    out = model(tokens [b, s])                             # ModelOutput, = the one-device forward
    out = generate(model, prompts, 32, layout=layout)      # serving/generate.py

Placement: attention heads and the KV cache's heads over `tensor` (kv heads replicated when tensor >
num_kv_heads: one cache slot per rank), routed experts over expert x tensor, shared experts' hidden
units over `tensor` (inference.shared_experts=tensor) or replicated, router and norms replicated, dense
MLP layers, embedding and LM head over `tensor` through GSPMD; batch rows over `data` only
(independent replicas); fsdp must be 1. XLA's all-reduce combiners would merge the two independent
all-reduces of a FarSkip layer back into one (seen on XLA:CPU): programs of this layout compile with
`TpEpLayout.compiler_options()` (`forward_fn`, serving/generate.make_decode_fn pass it to jax.jit).
Deviceless lowering for GPUs: `abstract_inference_model` (serving/programs.py builds the prefill /
decode programs).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from farskip_jax.config import Config, FarSkipConfig, ModelConfig
from farskip_jax.errors import ConfigError
from farskip_jax.model.transformer import Transformer
from farskip_jax.parallel.build import config_on
from farskip_jax.parallel.sharding import RULES, abstract_state, logical_to_spec, placed_model
from farskip_jax.parallel.tp_ep import (DATA_AXIS, EP_AXES, TP_AXIS, ReplicatedEPCompute, TpEpLayer,
                                        check_shared_split, kv_replicas)

# XLA's all-reduce combiners merge independent all-reduces into one. Under FarSkip the attention
# all-reduce of layer k and the routed all-reduce of layer k ARE independent, so XLA merges them
# (seen on XLA:CPU): attention of layer k+1 then waits for the routed sum again and the overlap
# FarSkip made possible is gone. Programs of this layout compile with them off.
NO_COMBINER_PASSES = "cpu-all-reduce-combiner,all-reduce-combiner,gpu-all-reduce-combiner"


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def check_tp_ep(cfg: Config, mesh: Mesh) -> None:
    """Fail early (ConfigError naming the key and the fix) on what the tp_ep layout cannot split."""
    m, e = cfg.model, cfg.moe
    tp, ep = mesh.shape[TP_AXIS], mesh.shape["expert"] * mesh.shape[TP_AXIS]
    if mesh.shape["fsdp"] != 1:
        raise ConfigError(f"inference.layout=tp_ep keeps whole weights per tensor rank; set mesh.fsdp=1 "
                          f"(got {mesh.shape['fsdp']}) and put the devices on mesh.tensor")
    if cfg.runtime.num_groups > 1:
        raise ConfigError("inference.layout=tp_ep does not run a Federation of Experts (runtime.num_groups > 1); "
                          "use inference.layout=foe (one group per GPU) or training")
    if m.num_heads % tp:
        raise ConfigError(f"inference.layout=tp_ep splits the model.num_heads={m.num_heads} attention heads over "
                          f"mesh.tensor={tp}; pick a mesh.tensor that divides the heads")
    if m.attention == "gqa" and m.num_kv_heads % tp and tp % m.num_kv_heads:
        raise ConfigError(f"inference.layout=tp_ep needs mesh.tensor={tp} and model.num_kv_heads={m.num_kv_heads} "
                          "to divide one another (kv heads are split, or replicated when tensor > kv heads)")
    if m.qk_norm and m.qk_norm_scope == "all_heads" and tp > 1:
        raise ConfigError("model.qk_norm_scope=all_heads normalises over every head, which tensor-parallel "
                          "attention splits; inference.layout=tp_ep cannot run it (use inference.layout=training)")
    if e.num_experts:
        if e.num_experts % ep:
            raise ConfigError(f"inference.layout=tp_ep splits moe.num_experts={e.num_experts} over mesh.expert x "
                              f"mesh.tensor = {ep} devices; pick sizes whose product divides the experts")
        if cfg.runtime.capacity_factor is not None:
            raise ConfigError("inference.layout=tp_ep is dropless; set runtime.capacity_factor=null")
        if cfg.inference.shared_experts == "tensor" and e.num_shared_experts:
            check_shared_split(e.resolved_shared_hidden, tp)


def tp_ep_rules(m: ModelConfig, tp: int) -> tuple[dict, dict]:
    """(rules, expert rules) of parallel/sharding.logical_to_spec for the tp_ep layout."""
    rules = {**RULES, "embed": None, "kv_heads": TP_AXIS if kv_replicas(m, tp) == 1 else None}
    return rules, {**rules, "expert": EP_AXES, "mlp": None}


def tp_ep_state_shardings(state, mesh: Mesh, cfg: Config):
    """NamedSharding per Variable of a model state for the tp_ep layout (module doc). Shared experts
    (path .../moe/shared/...): hidden units over `tensor` (inference.shared_experts=tensor) or
    replicated; the Qwen2 shared gate is replicated."""
    rules, expert_rules = tp_ep_rules(cfg.model, mesh.shape[TP_AXIS])
    split_shared = cfg.inference.shared_experts == "tensor"

    def one(path, v):
        keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
        axes = v.get_metadata().get("axes")
        shape = tuple(jnp.shape(v.get_value()))
        if axes is None or ("moe" in keys and ("shared_gate" in keys or ("shared" in keys and not split_shared))):
            return NamedSharding(mesh, P())
        r = expert_rules if "expert" in axes else rules
        return NamedSharding(mesh, logical_to_spec(tuple(axes), shape, mesh, r))

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=_is_var)


@dataclasses.dataclass(frozen=True)
class TpEpLayout:
    """The tp_ep serving layout on `mesh` (module doc): the model's layer (parallel/tp_ep.TpEpLayer),
    its routed backend, compile options and the shardings of batches and KV caches.
    shared: "tensor" | "replicated" (inference.shared_experts)."""

    mesh: Mesh
    shared: str = "tensor"

    @property
    def layer(self) -> TpEpLayer:
        """The Transformer's layer_step on this layout."""
        return TpEpLayer(self.mesh, self.shared)

    @property
    def tp(self) -> int:
        return self.mesh.shape[TP_AXIS]

    def routed_compute(self) -> ReplicatedEPCompute:
        return ReplicatedEPCompute(self.mesh)

    @staticmethod
    def compiler_options() -> dict:
        """Compile options of this layout's programs (`jax.jit(..., compiler_options=...)`, or
        `.compile(compiler_options=...)` of a deviceless lowering): the all-reduce combiners off."""
        return {"xla_disable_hlo_passes": NO_COMBINER_PASSES}

    def forward_fn(self, graphdef, farskip: Optional[FarSkipConfig] = None):
        """jitted fn(state, tokens [b, s]) -> logits [b, s, V] f32 (the full forward on this layout;
        graphdef of a model from inference_model)."""
        def fn(state, tokens):
            return nnx.merge(graphdef, state)(tokens, farskip=farskip).logits
        return jax.jit(fn, compiler_options=self.compiler_options())

    def batch_sharding(self, ndim: int) -> NamedSharding:
        """[batch, ...] arrays: rows over `data`, replicated over expert and tensor."""
        return NamedSharding(self.mesh, P(DATA_AXIS, *([None] * (ndim - 1))))

    def cache_sharding(self) -> NamedSharding:
        """KV cache entries [b, L, heads, dim]: rows over `data`, heads over `tensor` (each rank its own)."""
        return NamedSharding(self.mesh, P(DATA_AXIS, None, TP_AXIS, None))

    def stacked_cache_sharding(self) -> NamedSharding:
        """Stacked KV cache entries [repeats, b, L, heads, dim] (runtime.scan_layers): the layer axis
        unsharded, the rest as cache_sharding."""
        return NamedSharding(self.mesh, P(None, DATA_AXIS, None, TP_AXIS, None))

    def cache_heads(self, m: ModelConfig, heads: int) -> int:
        """Global head dim of a cache entry whose one-device head count is `heads`: kv heads replicated
        over tensor ranks get one slot per rank."""
        return heads * kv_replicas(m, self.tp)


# --------------------------------------------------------------------------------------------------
# building / placing a model for the layout
# --------------------------------------------------------------------------------------------------


def _tp_ep_graph(cfg: Config, mesh: Mesh):
    """(graphdef, abstract state, cfg on the mesh) of cfg's tp_ep model."""
    check_tp_ep(cfg, mesh)
    cfg = config_on(cfg, mesh)
    rc, layer = ReplicatedEPCompute(mesh), TpEpLayer(mesh, shared=cfg.inference.shared_experts)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), routed_compute=rc,
                                                                   layer_step=layer)))
    return graphdef, state, cfg


def inference_model(cfg: Config, mesh: Mesh, state):
    """A Transformer of cfg for the tp_ep layout on `mesh`: the ReplicatedEPCompute backend, the tp_ep
    layer and parameters placed by tp_ep_state_shardings. state: a model state from any layout or
    device (an nnx.State, or the {params, bias, rest} dict of loading/load.py), resharded onto this
    one. Fresh parameters: `nnx.state(parallel.build.create_model(cfg))`."""
    graphdef, abstract, cfg = _tp_ep_graph(cfg, mesh)
    return placed_model(graphdef, abstract, state, lambda st: tp_ep_state_shardings(st, mesh, cfg))


def layout_for(cfg: Config, mesh: Optional[Mesh]) -> Optional[TpEpLayout]:
    """TpEpLayout when cfg.inference.layout is tp_ep (a mesh is then required), else None."""
    if cfg.inference.layout != "tp_ep":
        return None
    if mesh is None:
        raise ConfigError("inference.layout=tp_ep needs a device mesh (parallel.make_mesh(cfg.mesh))")
    check_tp_ep(cfg, mesh)
    return TpEpLayout(mesh, shared=cfg.inference.shared_experts)


def abstract_inference_model(cfg: Config, mesh: Mesh):
    """(graphdef, state) of cfg's tp_ep model with every leaf a ShapeDtypeStruct carrying its
    NamedSharding: nothing is materialised, so programs for compile-only GPU devices (a mesh over
    analysis.deviceless.gpu_devices) lower on a CPU host (serving/programs.py builds them)."""
    graphdef, state, cfg = _tp_ep_graph(cfg, mesh)
    return graphdef, abstract_state(state, tp_ep_state_shardings(state, mesh, cfg))

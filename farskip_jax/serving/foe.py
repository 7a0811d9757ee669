"""Federation of Experts at inference (`inference.layout: foe`, the FoE paper's serving setting):
H = runtime.num_groups groups over one node's GPUs, no all-to-all, one cross-group sum per layer.

Mesh: the FoE mesh of parallel/foe.py (data, fsdp, group, expert, tensor) built from cfg.mesh; with
mesh.expert = H (the paper's setting: H = GPUs) every GPU holds one group:

    attention   the group's query / kv heads, their rows of o_proj and their KV-cache rows
                (`heads`, `kv_heads` over `group`; cache rows H*b, group h's rows on group h)
    MoE         the group's router and its E/H routed experts; every GPU routes every token of its
                data replica to its own experts (tokens over data, replicated over `group`)
    shared experts, dense MLPs   hidden units over `group` (GSPMD sums their partial outputs: one
                all-reduce each, which runs beside the routed experts)
    embedding, LM head   vocabulary over `group` (as tp_ep splits it over `tensor`)
    norms       replicated
    per layer   standard: ONE all-reduce over `group`, of sum_h (m^h_{k-1} + a^h_k) (scope
                `group_sum`; the routed sum of layer k-1 rides in layer k's attention sum), on the
                critical path; next to a FarSkip layer the attention sum (`group_sum`) and the routed
                sum (`moe/group_sum`) are two all-reduces, neither read by the sub-block after it, so
                XLA may run each under the next sub-block (model/foe.py has the dataflow)

With one group per GPU the routed experts run locally (runtime.dispatch=local: sort + grouped GEMM of the
group's T * k / H rows); mesh.expert = n * H puts a group's experts on n GPUs (runtime.dispatch=all_to_all:
group-confined all-to-alls, parallel/foe.py).
Programs of this layout compile with the all-reduce combiners off (`compiler_options`), as tp_ep's:
XLA:CPU's combiner otherwise merges FarSkip's two independent sums of a layer back into one.

    mesh = foe_inference_mesh(cfg)                    # or foe_mesh_from(any plain mesh, H)
    layout = FoELayout(mesh)
    model = foe_inference_model(cfg, mesh, st)         # any state, placed for the layout
    out = generate(model, prompts, 32, layout=layout)  # serving/generate.py: = the one-device model
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from farskip_jax.config import Config, ModelConfig
from farskip_jax.errors import ConfigError
from farskip_jax.model.foe import check_foe
from farskip_jax.model.transformer import Transformer
from farskip_jax.parallel.build import config_on
from farskip_jax.parallel.foe import FOE_EXPERT_RULES, FOE_RULES, GROUP_AXIS, FoECompute, foe_mesh_from
from farskip_jax.parallel.mesh import BATCH_AXES, make_mesh
from farskip_jax.parallel.sharding import abstract_state, logical_to_spec, placed_model
from farskip_jax.serving.tp_ep import NO_COMBINER_PASSES

# attention heads over the device groups (each GPU its group's heads), the rest as FoE training
SERVING_RULES = {**FOE_RULES, "heads": (GROUP_AXIS, "tensor"), "kv_heads": (GROUP_AXIS, "tensor"),
                 "mlp": (GROUP_AXIS, "tensor"), "vocab": (GROUP_AXIS, "tensor")}
SERVING_EXPERT_RULES = {**FOE_EXPERT_RULES, "heads": (GROUP_AXIS, "tensor"), "kv_heads": (GROUP_AXIS, "tensor")}
ROWS = (GROUP_AXIS, *BATCH_AXES)  # cache rows h*b + j: group-major, then the batch axes


def check_foe_inference(cfg: Config, mesh: Optional[Mesh] = None) -> int:
    """ConfigError unless cfg can run inference.layout=foe (on `mesh`); returns H."""
    h = cfg.runtime.num_groups
    if h < 2 or not cfg.moe.num_experts:
        raise ConfigError(f"inference.layout=foe needs a Federation of Experts: runtime.num_groups >= 2 and routed "
                          f"experts (got num_groups={h}, num_experts={cfg.moe.num_experts})")
    check_foe(cfg)
    ep = cfg.mesh.expert if mesh is None else mesh.shape.get("expert", 1) * mesh.shape.get(GROUP_AXIS, 1)
    if ep % h:
        raise ConfigError(f"inference.layout=foe puts the {h} groups on the mesh.expert={ep} devices; "
                          f"set mesh.expert to a multiple of runtime.num_groups={h} (the paper: mesh.expert = GPUs = H)")
    if cfg.runtime.dispatch == "local" and ep != h:
        raise ConfigError(f"runtime.dispatch=local under inference.layout=foe needs one group per device (mesh.expert = "
                          f"runtime.num_groups = {h}, got mesh.expert={ep}); with several devices per group set "
                          "runtime.dispatch=all_to_all")
    if cfg.mesh.tensor != 1 or cfg.mesh.fsdp != 1:
        raise ConfigError("inference.layout=foe splits heads and experts by group, not by tensor or fsdp: "
                          f"set mesh.tensor=1 mesh.fsdp=1 (got {cfg.mesh.tensor}, {cfg.mesh.fsdp})")
    if cfg.runtime.foe_tokens != "replicated":
        raise ConfigError("inference.layout=foe replicates each token over the groups; set runtime.foe_tokens=replicated")
    return h


def foe_inference_mesh(cfg: Config, devices=None) -> Mesh:
    """The FoE mesh of cfg.mesh over `devices` (default all)."""
    check_foe_inference(cfg)
    return foe_mesh_from(make_mesh(cfg.mesh, devices), cfg.runtime.num_groups)


def serving_state_shardings(state, mesh: Mesh):
    """NamedSharding per Variable: experts and heads over the device groups, the rest replicated."""

    def one(v):
        axes = v.get_metadata().get("axes")
        if axes is None:
            return NamedSharding(mesh, P())
        rules = SERVING_EXPERT_RULES if "expert" in axes else SERVING_RULES
        return NamedSharding(mesh, logical_to_spec(tuple(axes), tuple(v.get_value().shape), mesh, rules))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


@dataclasses.dataclass(frozen=True)
class FoELayout:
    """The foe inference layout on a FoE mesh: shardings of batches and caches for serving/generate.py.
    Attention and the layer step are the model's own (FoEStep with the FoECompute backend)."""

    mesh: Mesh

    @staticmethod
    def compiler_options() -> dict:
        return {"xla_disable_hlo_passes": NO_COMBINER_PASSES}

    def batch_sharding(self, ndim: int) -> NamedSharding:
        """[batch, ...] arrays: rows over the batch axes, replicated over `group`."""
        return NamedSharding(self.mesh, P(BATCH_AXES, *([None] * (ndim - 1))))

    def cache_sharding(self) -> NamedSharding:
        """KV cache entries [H*b, L, kv/H, dim]: group h's rows (h*b + j) on device group h."""
        return NamedSharding(self.mesh, P(ROWS, None, None, None))

    def stacked_cache_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(None, ROWS, None, None, None))

    def cache_heads(self, m: ModelConfig, heads: int) -> int:
        return heads


def _foe_graph(cfg: Config, mesh: Mesh):
    if GROUP_AXIS not in mesh.shape:
        raise ConfigError("inference.layout=foe needs a FoE mesh (serving.foe.foe_inference_mesh)")
    check_foe_inference(cfg, mesh)
    cfg = config_on(cfg, mesh)
    rc = FoECompute(mesh, cfg.runtime.dispatch)
    return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), routed_compute=rc)))


def foe_inference_model(cfg: Config, mesh: Mesh, state):
    """A FoE Transformer of cfg placed for the foe layout on `mesh`. state: an nnx.State or the
    {params, bias, rest} dict of loading/load.py, from any layout or device."""
    graphdef, abstract = _foe_graph(cfg, mesh)
    return placed_model(graphdef, abstract, state, lambda st: serving_state_shardings(st, mesh))


def abstract_foe_inference_model(cfg: Config, mesh: Mesh):
    """(graphdef, state) of cfg's foe-layout model, every leaf a ShapeDtypeStruct with its sharding
    (deviceless lowering for compile-only GPUs, serving/programs.py)."""
    graphdef, state = _foe_graph(cfg, mesh)
    return graphdef, abstract_state(state, serving_state_shardings(state, mesh))

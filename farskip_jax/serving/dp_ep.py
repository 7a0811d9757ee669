"""The dp_ep serving layout (`inference.layout: dp_ep`, SGLang's large-scale expert parallelism): the
model placed for it and the shardings of batches and KV caches. The layer (data-parallel attention,
local shared experts) is parallel/dp_ep.py's; the MoE exchange is the training's (parallel/ep.py,
`runtime.dispatch`: all_to_all, hierarchical = node-deduplicated as DeepEP, ragged on GPUs).

    layout = DpEpLayout(mesh, dispatch="all_to_all")        # mesh = make_mesh(cfg.mesh): mesh.expert = EP
    model = dp_ep_model(cfg, mesh, st)                      # any state, placed for the layout
    out = generate(model, prompts, 32, layout=layout)       # serving/generate.py: = the one-device model

Placement: routed experts over `expert` (E / EP per device), everything else whole on every device;
batch rows and KV-cache rows over data x expert (each device its own requests; the rows of a batch
must split evenly over the devices, per micro-batch under two-batch overlap). mesh.fsdp and
mesh.tensor must be 1. Dropless (runtime.capacity_factor null) generation equals the one-device model;
with a capacity factor the all-to-all buffers hold that many slots per (source, expert), as in
training, and rows past them are dropped (the analysis programs use 1.0: analysis/dp_ep_report.py).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from farskip_jax.config import Config, ModelConfig
from farskip_jax.errors import ConfigError
from farskip_jax.model.transformer import Transformer
from farskip_jax.parallel.build import check_mesh, config_on, routed_compute_on
from farskip_jax.parallel.dp_ep import DpEpLayer
from farskip_jax.parallel.mesh import BATCH_AXES
from farskip_jax.parallel.sharding import abstract_state, placed_model, state_shardings


def check_dp_ep(cfg: Config, mesh: Optional[Mesh] = None) -> None:
    """ConfigError unless cfg can run inference.layout=dp_ep (on `mesh`)."""
    shape = dict(mesh.shape) if mesh is not None else {"fsdp": cfg.mesh.fsdp, "tensor": cfg.mesh.tensor}
    if shape.get("fsdp", 1) != 1 or shape.get("tensor", 1) != 1:
        raise ConfigError("inference.layout=dp_ep runs attention data parallel and the experts over mesh.expert: "
                          f"set mesh.fsdp=1 mesh.tensor=1 (got {shape.get('fsdp')}, {shape.get('tensor')})")
    if cfg.runtime.num_groups > 1:
        raise ConfigError("inference.layout=dp_ep serves one expert pool; a Federation of Experts "
                          f"(runtime.num_groups={cfg.runtime.num_groups}) runs with inference.layout=foe")
    if mesh is not None:
        check_mesh(cfg, mesh)


@dataclasses.dataclass(frozen=True)
class DpEpLayout:
    """The dp_ep layout on `mesh` (module doc): the model's layer, its routed backend (runtime.dispatch;
    gpus_per_node: runtime.gpus_per_node for `hierarchical`), compile options and shardings."""

    mesh: Mesh
    dispatch: str = "all_to_all"
    gpus_per_node: Optional[int] = None

    @property
    def layer(self) -> DpEpLayer:
        return DpEpLayer(self.mesh)

    @staticmethod
    def compiler_options() -> dict:
        return {}

    def batch_sharding(self, ndim: int) -> NamedSharding:
        """[batch, ...] arrays: rows over data x fsdp x expert."""
        return NamedSharding(self.mesh, P(BATCH_AXES, *([None] * (ndim - 1))))

    def cache_sharding(self) -> NamedSharding:
        """KV cache entries [b, L, heads, dim]: each device its own rows, every head."""
        return self.batch_sharding(4)

    def stacked_cache_sharding(self) -> NamedSharding:
        """Stacked entries [repeats, b, L, heads, dim] (runtime.scan_layers): rows as cache_sharding."""
        return NamedSharding(self.mesh, P(None, BATCH_AXES, None, None, None))

    def cache_heads(self, m: ModelConfig, heads: int) -> int:
        return heads


def layout_of(cfg: Config, mesh: Mesh) -> DpEpLayout:
    """The DpEpLayout of cfg on `mesh` (checked)."""
    check_dp_ep(cfg, mesh)
    return DpEpLayout(mesh, cfg.runtime.dispatch, cfg.runtime.gpus_per_node)


def _dp_ep_graph(cfg: Config, mesh: Mesh):
    """(graphdef, abstract state) of cfg's dp_ep model."""
    check_dp_ep(cfg, mesh)
    cfg = config_on(cfg, mesh)
    rc = routed_compute_on(cfg, mesh)
    return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), routed_compute=rc,
                                                        layer_step=DpEpLayer(mesh))))


def dp_ep_model(cfg: Config, mesh: Mesh, state):
    """A Transformer of cfg for the dp_ep layout on `mesh`. state: an nnx.State or the {params, bias,
    rest} dict of loading/load.py, from any layout or device, resharded onto this one."""
    graphdef, abstract = _dp_ep_graph(cfg, mesh)
    return placed_model(graphdef, abstract, state, lambda st: state_shardings(st, mesh))


def abstract_dp_ep_model(cfg: Config, mesh: Mesh):
    """(graphdef, state) of cfg's dp_ep model, every leaf a ShapeDtypeStruct with its sharding
    (deviceless lowering for compile-only GPUs, serving/programs.py)."""
    graphdef, state = _dp_ep_graph(cfg, mesh)
    return graphdef, abstract_state(state, state_shardings(state, mesh))

"""The programs the overlap report compiles: the real model's forward and train step, abstractly.

    mesh = analysis_mesh(cfg, gpu_devices("h100_sxm", 8))
    fn, args = forward_program(cfg, mesh, batch=8, seq=4096)       # jitted, ShapeDtypeStructs
    fn, args = train_program(cfg, mesh, batch=8, seq=4096)

Nothing is materialised: the parameters are `nnx.eval_shape` of the model with the shardings of
`parallel.sharding.state_shardings`, the tokens a [batch, seq] int32 ShapeDtypeStruct split over
data x fsdp x expert, so programs for compile-only GPU devices can be lowered on a CPU host.

The train step is loss -> grad -> SGD update (cross entropy + router aux/z losses, as in
train/step.py); the optimizer's elementwise update does not change what overlaps the all-to-alls.
"""

from __future__ import annotations

from typing import Optional, Sequence
import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from farskip_jax.config import Config
from farskip_jax.kernels import ops
from farskip_jax.model import Transformer
from farskip_jax.parallel.mesh import BATCH_AXES
from farskip_jax.errors import ConfigError
from farskip_jax.parallel.build import config_on, model_mesh, routed_compute_on, state_shardings_on
from farskip_jax.parallel.ep import AllToAllCompute


def analysis_mesh(cfg: Config, devices: Sequence) -> Mesh:
    """The mesh of cfg.mesh over the given (compile-only) devices; the FoE mesh (group x expert,
    parallel/foe.py) for runtime.num_groups > 1 with expert parallelism, as in training."""
    return model_mesh(cfg, devices=list(devices))


def abstract_model(cfg: Config, mesh: Mesh, ep_options: Optional[dict] = None):
    """(graphdef, state) with every leaf a ShapeDtypeStruct carrying its NamedSharding.

    ep_options: fields of the all_to_all backend to set (parallel/ep.AllToAllCompute): `chunks`
    (exchange each device's tokens in that many chunks: MaxText's num_moe_token_chunks) and
    `dispatch_dtype` (e.g. "float8_e4m3fn": the dispatch payload in fp8, as DeepSeek-V3 trains)."""
    cfg = config_on(cfg, mesh)  # the GPU gmm backend in a GPU program
    rc = routed_compute_on(cfg, mesh)  # FoECompute on a FoE mesh
    if ep_options:
        if not isinstance(rc, AllToAllCompute):
            raise ConfigError(f"ep_options={ep_options} need runtime.dispatch=all_to_all on a plain (non-FoE) mesh; "
                              f"got {type(rc).__name__}")
        rc = dataclasses.replace(rc, **ep_options)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), routed_compute=rc)))
    shardings = state_shardings_on(state, mesh)
    is_var = lambda x: isinstance(x, nnx.Variable)

    def one(v, s):
        x = v.get_value() if hasattr(v, "get_value") else v[...]
        return v.replace(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s))

    return graphdef, jax.tree.map(one, state, shardings, is_leaf=is_var)


def _tokens(mesh: Mesh, batch: int, seq: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=NamedSharding(mesh, P(BATCH_AXES, None)))


def forward_program(cfg: Config, mesh: Mesh, batch: int, seq: int, ep_options: Optional[dict] = None):
    """jit(forward)(state, tokens) -> logits, with connectivity cfg.farskip."""
    graphdef, state = abstract_model(cfg, mesh, ep_options)
    fs = cfg.farskip

    def forward(state, tokens):
        out = nnx.merge(graphdef, state)(tokens, farskip=fs)
        return out.logits, out.aux_loss

    return jax.jit(forward), (state, _tokens(mesh, batch, seq))


def train_program(cfg: Config, mesh: Mesh, batch: int, seq: int, lr: float = 1e-3, ep_options: Optional[dict] = None):
    """jit(step)(params, rest, tokens) -> (new params, loss): CE + aux/z loss, grad, SGD update."""
    graphdef, state = abstract_model(cfg, mesh, ep_options)
    fs = cfg.farskip
    params, rest = nnx.split_state(state, nnx.Param, ...)

    def loss_fn(params, rest, tokens):
        out = nnx.merge(graphdef, params, rest)(tokens, farskip=fs)
        logp = jax.nn.log_softmax(out.logits[:, :-1], axis=-1)
        ce = -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
        return ce + cfg.runtime.aux_loss_weight * out.aux_loss + cfg.runtime.z_loss_weight * out.z_loss

    def step(params, rest, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, rest, tokens)
        new = jax.tree.map(lambda p, g: p - lr * g.astype(p.dtype), params, grads)
        return new, loss

    return jax.jit(step, donate_argnums=(0,)), (params, rest, _tokens(mesh, batch, seq))


def grouped_gemm_cost_proxy(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Stands in for the `ragged_dot` grouped matmul in an ANALYSIS compile: one dense [M, K] x [K, N]
    dot (the useful FLOPs of a grouped GEMM) of lhs with the group-summed weights (every weight read
    once, as a grouped GEMM reads them; its gradient writes a [G, K, N] weight gradient), float32
    accumulation, lhs.dtype out. Values are wrong; costs, shapes, dtypes and dependencies (on lhs,
    rhs and group_sizes) are a grouped GEMM's."""
    rhs = rhs.astype(lhs.dtype)
    w = rhs.sum(0) + jnp.zeros((), rhs.dtype) * group_sizes.sum().astype(rhs.dtype)
    return jnp.dot(lhs, w, preferred_element_type=jnp.float32).astype(lhs.dtype)


def grouped_gemm_proxy():
    """A context: while it is open, the grouped matmul `ragged_dot` of the model's backend seam
    (kernels/ops.py; what runtime.gmm resolves to on GPU) is the cost proxy above, for any platform.

    Why: a deviceless compile has no grouped GEMM library (cuDNN / hipBLASLt), so XLA expands
    ragged_dot into a dense dot over every local expert plus a G-times larger masked copy of its
    input: E/EP times the FLOPs and bytes, priced so by both cost models (32x for DeepSeek-V3 at EP
    8, 8x at EP 32, which would bias any comparison across EP sizes). Trace (and lower) inside the
    block; use only for programs that are compiled and analysed, never run."""
    return ops.registered_while(ops.GROUPED_MATMUL, "ragged_dot", ops.Backend(grouped_gemm_cost_proxy, platform=None))

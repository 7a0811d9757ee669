"""MoE block: router + routed experts (through a pluggable exchange) + shared experts.

    MoEOutput = MoEBlock(x: [batch, seq, d_model])
      shared [b, s, d] or None   shared-expert output (FarSkip's "no-routed" part)
      routed [b, s, d]           weighted routed-expert output (crosses the all-to-alls under EP)
      aux_loss, z_loss []        router losses; load [E]; dropped [] assignments; importance [E]

Shared and routed are returned separately because the two residual streams need them apart
(docs/design.md section 1). Named scopes: router, dispatch/expert_compute/combine (in the exchange),
shared_experts.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.ad_checkpoint import checkpoint_name

from farskip_jax.config import ModelConfig, MoEConfig, RuntimeConfig
from farskip_jax.model.experts import RoutedComputeFn, RoutedExperts, local_routed_compute
from farskip_jax.model.layers import Linear, SwiGLU, dtype_of
from farskip_jax.model.router import Router


@struct.dataclass
class MoEOutput:
    shared: Optional[jax.Array]
    routed: Optional[jax.Array]
    aux_loss: jax.Array
    z_loss: jax.Array
    load: jax.Array
    dropped: jax.Array
    importance: Optional[jax.Array] = None
    routed_groups: Optional[jax.Array] = None  # what a layout's routed hook keeps apart (FoE: per group)


class MoEBlock(nnx.Module):
    def __init__(self, mcfg: ModelConfig, cfg: MoEConfig, runtime: RuntimeConfig, *, rngs: nnx.Rngs,
                 routed_compute: Optional[RoutedComputeFn] = None):
        self.cfg, self.runtime = cfg, runtime
        pd, cd = dtype_of(runtime.param_dtype), dtype_of(runtime.compute_dtype)
        self.router = Router(mcfg.d_model, cfg, rngs=rngs, std=mcfg.init_std)
        self.experts = RoutedExperts(mcfg.d_model, cfg.expert_hidden, cfg.num_experts, rngs=rngs,
                                     std=mcfg.init_std, param_dtype=pd, compute_dtype=cd)
        if cfg.num_shared_experts > 0:
            self.shared = SwiGLU(mcfg.d_model, cfg.resolved_shared_hidden, rngs=rngs, std=mcfg.init_std,
                                 param_dtype=pd, compute_dtype=cd)
        else:
            self.shared = None
        # Qwen2-MoE: the shared output is scaled by sigmoid(x @ w) with w: [d_model, 1]
        self.shared_gate = Linear(mcfg.d_model, 1, axes=("embed", None), rngs=rngs, std=mcfg.init_std,
                                  param_dtype=pd, compute_dtype=cd) if cfg.shared_gate and self.shared is not None else None
        self.routed_compute = routed_compute or local_routed_compute

    def __call__(self, x: jax.Array, routed: Optional[Callable] = None, shared: Optional[Callable] = None,
                 num_groups: int = 1) -> MoEOutput:
        """x [b, s, d] -> MoEOutput. A layout may replace the routed experts, `routed(self, x, route) ->
        (routed [b, s, d] or None, dropped, routed_groups or None)` (default `routed_experts`), and
        the shared experts, `shared(self, x)` (default `shared_out`); num_groups: the router's
        (Federation of Experts)."""
        with jax.named_scope("router"):
            route = self.router(x, num_groups)
        x_routed = x
        if self.cfg.route_on_input:  # Llama-4: expert(w * x) instead of w * expert(x) (top_k == 1)
            x_routed = (x * route.weights.astype(x.dtype)).astype(x.dtype)
            route = route.replace(weights=jnp.ones_like(route.weights))
        y, dropped, groups = (routed or MoEBlock.routed_experts)(self, x_routed, route)
        s = (shared or MoEBlock.shared_out)(self, x)
        return MoEOutput(shared=s, routed=None if y is None else y.astype(x.dtype), aux_loss=route.aux_loss,
                         z_loss=route.z_loss, load=route.load, dropped=dropped, importance=route.importance,
                         routed_groups=groups)

    def routed_experts(self, x: jax.Array, route, compute: Optional[RoutedComputeFn] = None):
        """(the routed experts' weighted sum [b, s, d], named routed_out, dropped [], None) through
        `compute` (default the block's routed compute) on x cast to the compute dtype."""
        out = (compute or self.routed_compute)(x.astype(self.experts.compute_dtype), route,
                                               self.experts.weights(self.runtime.gmm), self.runtime)
        return checkpoint_name(out.y, "routed_out"), out.dropped, None

    def shared_out(self, x: jax.Array) -> Optional[jax.Array]:
        """Shared-expert output [b, s, d] (Qwen2-MoE: times its sigmoid gate), or None without shared experts."""
        if self.shared is None:
            return None
        with jax.named_scope("shared_experts"):
            out = self.shared(x)
            return out * jax.nn.sigmoid(self.shared_gate(x)) if self.shared_gate is not None else out

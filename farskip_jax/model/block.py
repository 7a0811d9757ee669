"""One pre-norm layer (`Block`): its two halves and the one remat wrapper, plus the results a forward
returns (`BlockOutput`, `ModelOutput`) and the remat policies (`REMAT_POLICIES`).

    a, cache = block.attend(x [b, s, d], positions [b, s], segment_ids, cache=None, attention=None)
    out = block.ffn(x_moe [b, s, d], routed=None, shared=None, num_groups=1, sums=None)
    out.attn / out.shared / out.routed [b, s, d] (shared None without shared experts, routed None on
    dense layers); aux_loss, z_loss [], load [E] or None, dropped [].
    out, cache = remat(block, "minimal", fn, *args)           # fn(block, *args) under the policy

The layer body is `Block.layer`, written once: attention on the stream the layer step chose, the
stream the MoE reads (R_{k-1} + a_k or R_{k-1}), the FFN; what a layout changes in between (its
attention, where partial sums go, the MoE's input) are hooks of the layer step (model/layer_step.py).
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.ad_checkpoint import checkpoint_name

from farskip_jax.config import Config
from farskip_jax.connectivity.layer_sets import MOE_KINDS
from farskip_jax.model.attention import Attention, KVCache, LayerCache
from farskip_jax.model.experts import RoutedComputeFn
from farskip_jax.model.layers import RMSNorm, SwiGLU, dtype_of
from farskip_jax.model.mla import MLAttention
from farskip_jax.model.moe import MoEBlock


@struct.dataclass
class BlockOutput:
    """A layer's outputs (keyword-built; the order of the fields is the order of a remat's outputs)."""

    attn: Optional[jax.Array] = None  # [b, s, d]
    attn_groups: Optional[jax.Array] = None  # Federation of Experts: [H, b, s, d] each group's attention
    shared: Optional[jax.Array] = None  # [b, s, d] shared experts or dense MLP; None without
    routed: Optional[jax.Array] = None  # [b, s, d]; None on dense layers (FoE: when its sum is deferred)
    routed_groups: Optional[jax.Array] = None  # FoE: [H, b, s, d] each group's routed output
    aux_loss: Optional[jax.Array] = None
    z_loss: Optional[jax.Array] = None
    load: Optional[jax.Array] = None  # [E]; None on dense layers
    dropped: Optional[jax.Array] = None
    importance: Optional[jax.Array] = None  # [E] mean router probability (router.balance_loss); None: dense


@struct.dataclass
class ModelOutput:
    logits: jax.Array
    aux_loss: jax.Array
    z_loss: jax.Array
    load: Optional[jax.Array]
    dropped: jax.Array
    hidden: Optional[tuple] = None
    final: Optional[jax.Array] = None  # [b, s, d] final-normed full stream (forward with logits=False)
    cache: Optional[KVCache] = None  # the KV cache after the forward (decoding), or None


class Block(nnx.Module):
    """One pre-norm layer. Its halves take their input stream from the caller."""

    def __init__(self, cfg: Config, layer_idx: int, *, rngs: nnx.Rngs, routed_compute: Optional[RoutedComputeFn] = None):
        m = cfg.model
        pd, cd = dtype_of(cfg.runtime.param_dtype), dtype_of(cfg.runtime.compute_dtype)
        self.layer_idx = layer_idx
        self.attn_norm = RMSNorm(m.d_model, eps=m.norm_eps, param_dtype=pd)
        attn_cls = MLAttention if m.attention == "mla" else Attention
        self.attn = attn_cls(m, cfg.runtime, rngs=rngs, layer_idx=layer_idx)
        self.ffn_norm = RMSNorm(m.d_model, eps=m.norm_eps, param_dtype=pd)
        self.is_moe = bool(cfg.moe.num_experts) and m.is_moe_layer(layer_idx)
        if self.is_moe:
            self.moe = MoEBlock(m, cfg.moe, cfg.runtime, rngs=rngs, routed_compute=routed_compute)
            self.mlp = None
        else:
            self.moe = None
            self.mlp = SwiGLU(m.d_model, m.mlp_hidden, rngs=rngs, std=m.init_std, param_dtype=pd, compute_dtype=cd)

    def attend(self, x: jax.Array, positions: jax.Array, segment_ids: Optional[jax.Array],
               cache: Optional[LayerCache] = None, attention: Optional[Callable] = None):
        """Scope `attention`: norm, then self.attn (or `attention(attn, xn, positions, segment_ids, cache)
        -> (out, cache)`, a layout's way to run it) -> (out named attention_out, cache)."""
        with jax.named_scope("attention"):
            xn = self.attn_norm(x)
            if attention is None:
                a, cache = self.attn(xn, positions, segment_ids, cache)
            else:
                a, cache = attention(self.attn, xn, positions, segment_ids, cache)
            return checkpoint_name(a, "attention_out"), cache

    def ffn(self, x: jax.Array, routed: Optional[Callable] = None, shared: Optional[Callable] = None,
            num_groups: int = 1, sums: Optional[Callable] = None) -> BlockOutput:
        """Scope `moe` (or `mlp` on a dense layer): norm, then the MoE (MoEBlock's routed / shared /
        num_groups) or dense MLP on the input stream x [b, s, d]; sums(out) -> out: what a layout adds
        inside the scope (its all-reduces of partial sums)."""
        with jax.named_scope("moe" if self.is_moe else "mlp"):
            h = self.ffn_norm(x)
            zero = jnp.zeros((), jnp.float32)
            if self.moe is None:
                with jax.named_scope("dense_mlp"):
                    s = checkpoint_name(self.mlp(h), "shared_out")
                out = BlockOutput(attn=None, shared=s, routed=None, aux_loss=zero, z_loss=zero, load=None,
                                  dropped=jnp.zeros((), jnp.int32))
            else:
                o = self.moe(h, routed=routed, shared=shared, num_groups=num_groups)
                out = BlockOutput(attn=None, shared=None if o.shared is None else checkpoint_name(o.shared, "shared_out"),
                                  routed=o.routed, aux_loss=o.aux_loss, z_loss=o.z_loss, load=o.load,
                                  dropped=o.dropped, importance=o.importance, routed_groups=o.routed_groups)
            return out if sums is None else sums(out)

    def layer(self, step, x: jax.Array, full: jax.Array, extra, site, plan, cache: Optional[LayerCache]):
        """The layer body: attention on the stream x, the stream the MoE reads (site.kinds[1]: `full` =
        R_{k-1} + a_k, `outdated` = R_{k-1}, with R_{k-1} = `full`), the FFN on it ->
        (BlockOutput, cache). `step` (model/layer_step.LayerStep) supplies what a layout changes: the
        attention, where its sum goes, the MoE's input and options, how the outputs join."""
        a, cache = self.attend(x, step.positions, step.segment_ids, cache, step.attention_of(site, plan))
        a, held = step.attention_sum(a, extra, site, plan)
        if site.kinds[1] not in MOE_KINDS:
            raise ValueError(f"unknown moe input {site.kinds[1]!r}; expected one of {MOE_KINDS}")
        x_moe = step.moe_input(full + a if site.kinds[1] == "full" else full)
        out = self.ffn(x_moe, **step.ffn_options(self, extra, site, plan))
        return step.finish(out, a, held, site, plan), cache


def remat(block: Block, policy: str, fn: Callable, *args):
    """fn(block, *args) under the remat policy `policy` (runtime.remat: none | minimal | dots | full;
    jax.checkpoint over the block's state and args): the one place a layer is rematerialised."""
    if policy == "none":
        return fn(block, *args)
    gd, st = nnx.split(block)

    def run(st, *args):
        return fn(nnx.merge(gd, st), *args)

    return jax.checkpoint(run, policy=REMAT_POLICIES[policy])(st, *args)


REMAT_POLICIES = {
    "full": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "minimal": jax.checkpoint_policies.save_only_these_names("attention_out", "shared_out", "routed_out"),
}

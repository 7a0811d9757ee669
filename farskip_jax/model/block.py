"""One pre-norm layer (`Block`) and the results a forward returns (`BlockOutput`, `ModelOutput`),
plus the remat policies (`REMAT_POLICIES`).

    out = Block(cfg, layer_idx, rngs=rngs)(x_attn [b, s, d], full [b, s, d], positions [b, s],
                                           segment_ids, moe_input="full" | "outdated")
    out.attn / out.shared / out.routed [b, s, d] (shared None without shared experts, routed None on
    dense layers); aux_loss, z_loss [], load [E] or None, dropped [].
The MoE input is `connectivity.moe_stream(moe_input, full, attn)`; which stream attention reads is the
caller's (model/layer_loop.py).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.ad_checkpoint import checkpoint_name

from farskip_jax.config import Config
from farskip_jax.model.connectivity import moe_stream
from farskip_jax.model.attention import Attention
from farskip_jax.model.experts import RoutedComputeFn
from farskip_jax.model.layers import RMSNorm, SwiGLU, dtype_of
from farskip_jax.model.mla import MLAttention
from farskip_jax.model.moe import MoEBlock


@struct.dataclass
class BlockOutput:
    attn: jax.Array
    shared: Optional[jax.Array]
    routed: Optional[jax.Array]
    aux_loss: jax.Array
    z_loss: jax.Array
    load: Optional[jax.Array]
    dropped: jax.Array
    importance: Optional[jax.Array] = None  # [E] mean router probability (router.balance_loss); None: dense


@struct.dataclass
class ModelOutput:
    logits: jax.Array
    aux_loss: jax.Array
    z_loss: jax.Array
    load: Optional[jax.Array]
    dropped: jax.Array
    hidden: Optional[tuple] = None
    trace: Optional[tuple] = None
    final: Optional[jax.Array] = None  # [b, s, d] final-normed full stream (forward with logits=False)
    side: Optional[tuple] = None  # the per-layer side state after the forward (KV cache), or None


class Block(nnx.Module):
    """One pre-norm layer. Its sub-blocks take their input stream from the caller."""

    def __init__(self, cfg: Config, layer_idx: int, *, rngs: nnx.Rngs, routed_compute: Optional[RoutedComputeFn] = None):
        m = cfg.model
        pd, cd = dtype_of(m.param_dtype), dtype_of(m.compute_dtype)
        self.layer_idx = layer_idx
        self.attn_norm = RMSNorm(m.d_model, eps=m.norm_eps, param_dtype=pd)
        attn_cls = MLAttention if m.attention == "mla" else Attention
        self.attn = attn_cls(m, rngs=rngs, layer_idx=layer_idx)
        self.ffn_norm = RMSNorm(m.d_model, eps=m.norm_eps, param_dtype=pd)
        self.is_moe = bool(cfg.moe.num_experts) and m.is_moe_layer(layer_idx)
        if self.is_moe:
            self.moe = MoEBlock(m, cfg.moe, rngs=rngs, routed_compute=routed_compute)
            self.mlp = None
        else:
            self.moe = None
            self.mlp = SwiGLU(m.d_model, m.mlp_hidden, rngs=rngs, std=m.init_std, param_dtype=pd, compute_dtype=cd)

    def attention(self, x: jax.Array, positions: jax.Array, segment_ids: Optional[jax.Array]) -> jax.Array:
        return checkpoint_name(self.attn(self.attn_norm(x), positions, segment_ids), "attention_out")

    def ffn(self, x: jax.Array, shared_fn=None, routed_compute: Optional[RoutedComputeFn] = None) -> BlockOutput:
        """The MoE (or dense MLP) on its input stream x [b, s, d]; shared_fn / routed_compute: MoEBlock's."""
        h = self.ffn_norm(x)
        zero = jnp.zeros((), jnp.float32)
        if self.moe is None:
            with jax.named_scope("dense_mlp"):
                s = checkpoint_name(self.mlp(h), "shared_out")
            return BlockOutput(attn=None, shared=s, routed=None, aux_loss=zero, z_loss=zero, load=None,
                               dropped=jnp.zeros((), jnp.int32))
        o = self.moe(h, shared_fn=shared_fn, routed_compute=routed_compute)
        shared = None if o.shared is None else checkpoint_name(o.shared, "shared_out")
        return BlockOutput(attn=None, shared=shared, routed=checkpoint_name(o.routed, "routed_out"),
                           aux_loss=o.aux_loss, z_loss=o.z_loss, load=o.load, dropped=o.dropped,
                           importance=o.importance)

    def __call__(self, x_attn: jax.Array, full: jax.Array, positions: jax.Array, segment_ids: Optional[jax.Array],
                 moe_input: str = "full", attention_fn=None) -> BlockOutput:
        """attention_fn(normalised x_attn) -> [b, s, d] replaces self.attn (KV-cache decoding)."""
        with jax.named_scope("attention"):
            a = (self.attention(x_attn, positions, segment_ids) if attention_fn is None
                 else attention_fn(self.attn_norm(x_attn)))
        x_moe = moe_stream(moe_input, full, a)
        with jax.named_scope("moe" if self.is_moe else "mlp"):
            out = self.ffn(x_moe)
        return out.replace(attn=a)


REMAT_POLICIES = {
    "full": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "minimal": jax.checkpoint_policies.save_only_these_names("attention_out", "shared_out", "routed_out"),
}

"""The FarSkip MoE transformer: embedding, L blocks joined by the residual streams, final norm, logits.

    out = Transformer(cfg, rngs=nnx.Rngs(0))(tokens [b, s], positions=None, segment_ids=None,
                                              farskip=None, return_hidden=False, return_trace=False)
    out.logits [b, s, vocab] float32; out.aux_loss / z_loss [] (means over MoE layers);
    out.load [num_moe_layers, E]; out.dropped []; out.hidden (full stream after each layer);
    out.trace (per layer: the attention and MLP inputs and the a/shared/routed outputs).

Connectivity is an argument of the call (default `cfg.farskip`), not of the parameters: the same
weights run under every connectivity, which is what FCSD distillation needs (teacher = standard).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.ad_checkpoint import checkpoint_name

from farskip_jax.config import Config, FarSkipConfig
from farskip_jax.model.attention import Attention
from farskip_jax.model.mla import MLAttention
from farskip_jax.model.connectivity import Streams
from farskip_jax.model.experts import RoutedComputeFn
from farskip_jax.model.layers import Embed, Linear, RMSNorm, SwiGLU, dtype_of
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


@struct.dataclass
class ModelOutput:
    logits: jax.Array
    aux_loss: jax.Array
    z_loss: jax.Array
    load: Optional[jax.Array]
    dropped: jax.Array
    hidden: Optional[tuple] = None
    trace: Optional[tuple] = None


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

    def ffn(self, x: jax.Array) -> BlockOutput:
        h = self.ffn_norm(x)
        zero = jnp.zeros((), jnp.float32)
        if self.moe is None:
            with jax.named_scope("dense_mlp"):
                s = checkpoint_name(self.mlp(h), "shared_out")
            return BlockOutput(attn=None, shared=s, routed=None, aux_loss=zero, z_loss=zero, load=None,
                               dropped=jnp.zeros((), jnp.int32))
        o = self.moe(h)
        shared = None if o.shared is None else checkpoint_name(o.shared, "shared_out")
        return BlockOutput(attn=None, shared=shared, routed=checkpoint_name(o.routed, "routed_out"),
                           aux_loss=o.aux_loss, z_loss=o.z_loss, load=o.load, dropped=o.dropped)

    def __call__(self, x_attn: jax.Array, full: jax.Array, positions: jax.Array, segment_ids: Optional[jax.Array],
                 moe_input: str = "full", attention_fn=None) -> BlockOutput:
        """attention_fn(normalised x_attn) -> [b, s, d] replaces self.attn (KV-cache decoding)."""
        with jax.named_scope("attention"):
            a = (self.attention(x_attn, positions, segment_ids) if attention_fn is None
                 else attention_fn(self.attn_norm(x_attn)))
        x_moe = full + a if moe_input == "full" else full
        with jax.named_scope("moe" if self.is_moe else "mlp"):
            out = self.ffn(x_moe)
        return out.replace(attn=a)


REMAT_POLICIES = {
    "full": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "minimal": jax.checkpoint_policies.save_only_these_names("attention_out", "shared_out", "routed_out"),
}


class Transformer(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs, routed_compute: Optional[RoutedComputeFn] = None):
        m = cfg.model
        pd, cd = dtype_of(m.param_dtype), dtype_of(m.compute_dtype)
        self.cfg = cfg
        if cfg.moe.num_groups > 1:  # Federation of Experts: fail early on what it cannot split (model/foe.py)
            from farskip_jax.model.foe import check_foe
            check_foe(cfg)
        self.embed = Embed(m.vocab_size, m.d_model, rngs=rngs, std=m.init_std, param_dtype=pd, compute_dtype=cd)
        self.layers = nnx.List([Block(cfg, i, rngs=rngs, routed_compute=routed_compute) for i in range(m.num_layers)])
        self.final_norm = RMSNorm(m.d_model, eps=m.norm_eps, param_dtype=pd)
        self.lm_head = None if m.tie_embeddings else Linear(
            m.d_model, m.vocab_size, axes=("embed", "vocab"), rngs=rngs, std=m.init_std, param_dtype=pd, compute_dtype=cd)

    def _run_block(self, block: Block, x_attn, full, positions, segment_ids, moe_input: str,
                   attention_fn=None) -> BlockOutput:
        if self.cfg.model.remat == "none" or attention_fn is not None:
            return block(x_attn, full, positions, segment_ids, moe_input, attention_fn)
        fn = nnx.remat(lambda b, xa, f, p, s: b(xa, f, p, s, moe_input), policy=REMAT_POLICIES[self.cfg.model.remat])
        return fn(block, x_attn, full, positions, segment_ids)

    def __call__(self, tokens: jax.Array, positions: Optional[jax.Array] = None, segment_ids: Optional[jax.Array] = None,
                 *, farskip: Optional[FarSkipConfig] = None, return_hidden: bool = False,
                 return_trace: bool = False, attention_fns=None) -> ModelOutput:
        """attention_fns: per layer, fn(normalised attention input) -> attention output replacing the
        layer's own attention (KV-cache decoding, eval/generate.py); no remat then."""
        if self.cfg.moe.num_groups > 1:  # Federation of Experts groups (model/foe.py)
            from farskip_jax.model.foe import foe_forward
            return foe_forward(self, tokens, positions, segment_ids, farskip=farskip, return_hidden=return_hidden,
                               return_trace=return_trace, attention_fns=attention_fns)
        fs = farskip if farskip is not None else self.cfg.farskip
        n = len(self.layers)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        h = self.embed(tokens)
        streams = Streams.init(h, fs.skip_distance)
        outs, hidden, trace = [], [], []
        for i, block in enumerate(self.layers):
            attn_kind, moe_kind = fs.layer_inputs(i, n)
            with jax.named_scope(f"layer_{i}"):
                x_attn = streams.attn_input(attn_kind)
                out = self._run_block(block, x_attn, streams.full, positions, segment_ids, moe_kind,
                                      None if attention_fns is None else attention_fns[i])
                if return_trace:
                    trace.append(dict(attn_in=x_attn, moe_in=streams.moe_input(moe_kind, out.attn), attn=out.attn,
                                      shared=out.shared, routed=out.routed, attn_kind=attn_kind, moe_kind=moe_kind))
                streams = streams.update(out.attn, out.shared, out.routed)
            outs.append((block.is_moe, out))
            if return_hidden:
                hidden.append(streams.full)
        return self.output(streams.full, outs, hidden if return_hidden else None, trace if return_trace else None)

    def output(self, full: jax.Array, outs: list, hidden: Optional[list], trace: Optional[list]) -> ModelOutput:
        """Final norm of the FULL stream, logits, and the router statistics of `outs` [(is_moe, BlockOutput)]:
        aux/z losses averaged over MoE layers, load stacked [n_moe, E], dropped summed over layers."""
        x = self.final_norm(full)
        logits = self.embed.attend(x) if self.lm_head is None else self.lm_head(x)
        moe = [o for is_moe, o in outs if is_moe]
        mean = lambda xs: jnp.mean(jnp.stack(xs)) if xs else jnp.zeros((), jnp.float32)  # noqa: E731
        return ModelOutput(logits=logits.astype(jnp.float32), aux_loss=mean([o.aux_loss for o in moe]),
                           z_loss=mean([o.z_loss for o in moe]),
                           load=jnp.stack([o.load for o in moe]) if moe else None,
                           dropped=jnp.sum(jnp.stack([o.dropped for _, o in outs])),
                           hidden=tuple(hidden) if hidden is not None else None,
                           trace=tuple(trace) if trace is not None else None)

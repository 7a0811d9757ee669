"""The FarSkip MoE transformer: embedding, L blocks joined by the residual streams, final norm, logits.

    out = Transformer(cfg, rngs=nnx.Rngs(0))(tokens [b, s], positions=None, segment_ids=None,
                                              farskip=None, cache=None, return_hidden=False, logits=True)
    out.logits [b, s, vocab] float32; out.aux_loss / z_loss [] (means over MoE layers);
    out.load [num_moe_layers, E]; out.dropped []; out.hidden (full stream after each layer).
    logits=False: out.logits None and out.final [b, s, d] = final_norm(full stream), for losses that
    compute the logits in chunks from `unembed()`. cache (attention.KVCache, decoding): the new
    tokens' keys / values are written into it and attention reads every slot; out.cache is it updated.

Connectivity is an argument of the call (default `cfg.farskip`), not of the parameters: the same
weights run under every connectivity, which is what FCSD distillation needs (teacher = standard).

The layers run through the one layer loop (model/layer_loop.py): unrolled, or under
`runtime.scan_layers` as one `jax.lax.scan` per stack of alike layers and run of equal connectivity
(model/stacking.py, docs/scan.md). Each layer is a step (model/layer_step.py): `layer_step`, given
at construction, builds it per call: LayerStep for the ordinary model, foe.FoEStep for a Federation
of Experts (runtime.num_groups > 1), a serving layout's own (parallel/tp_ep.TpEpLayer).

Two-batch overlap (`runtime.micro_batches: 2`): the batch's rows are split into interleaved
micro-batches that run through every layer side by side without depending on each other (one step
per micro-batch; layer_loop.run_layers), so XLA can run one's attention and shared experts under the
other's all-to-alls / all-reduces; the layer outputs and router statistics are merged, so the values
equal the plain forward's (dropless MoE: a capacity counts per micro-batch).
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from farskip_jax.config import Config, FarSkipConfig
from farskip_jax.errors import ConfigError
from farskip_jax.model.attention import KVCache
from farskip_jax.model.block import Block, ModelOutput
from farskip_jax.model.experts import RoutedComputeFn
from farskip_jax.model.foe import FoEStep, check_foe
from farskip_jax.model.layer_loop import merge_rows, run_layers, split_rows
from farskip_jax.model.layer_step import LayerStep
from farskip_jax.model.layers import Embed, Linear, RMSNorm, dtype_of
from farskip_jax.model.stacking import LayerStack, plan_segments


class Transformer(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs, routed_compute: Optional[RoutedComputeFn] = None,
                 layer_step: Optional[Callable] = None):
        """routed_compute: the MoE blocks' token exchange (parallel/ep.py; default one program);
        layer_step(model, positions, segment_ids, farskip, remat, cache) -> the layer step of one call
        (micro-batch): default LayerStep, or FoEStep with runtime.num_groups > 1."""
        m = cfg.model
        pd, cd = dtype_of(cfg.runtime.param_dtype), dtype_of(cfg.runtime.compute_dtype)
        self.cfg = cfg
        if cfg.runtime.num_groups > 1:  # Federation of Experts: fail early on what it cannot split
            check_foe(cfg)
        self.layer_step = layer_step or (FoEStep if cfg.runtime.num_groups > 1 else LayerStep)
        self.embed = Embed(m.vocab_size, m.d_model, rngs=rngs, std=m.init_std, param_dtype=pd, compute_dtype=cd)
        blocks = [Block(cfg, i, rngs=rngs, routed_compute=routed_compute) for i in range(m.num_layers)]
        if cfg.runtime.scan_layers:  # same initial values as the unrolled model, stacked (model/stacking.py)
            self.stacks = nnx.List([LayerStack(seg, blocks[seg.start:seg.stop]) for seg in plan_segments(cfg)])
        else:
            self.layers = nnx.List(blocks)
        self.final_norm = RMSNorm(m.d_model, eps=m.norm_eps, param_dtype=pd)
        self.lm_head = None if m.tie_embeddings else Linear(
            m.d_model, m.vocab_size, axes=("embed", "vocab"), rngs=rngs, std=m.init_std, param_dtype=pd, compute_dtype=cd)

    @property
    def scanned(self) -> bool:
        return self.cfg.runtime.scan_layers

    def blocks(self) -> list:
        """Per-layer Blocks in layer order: `self.layers` itself, or under scan_layers views whose
        Variables are slices of the stacked ones (writes reach the stacks only through `write_blocks`)."""
        if not self.scanned:
            return list(self.layers)
        out = []
        for st in self.stacks:
            out.extend(st.layer(q, r) for r in range(st.repeats) for q in range(st.period))
        return out

    def write_blocks(self, blocks: list) -> None:
        """Put per-layer views from `blocks()` (modified in place) back into the stacks; no-op unrolled."""
        if not self.scanned:
            return
        for st in self.stacks:
            st.write_layers(blocks[st.start:st.start + st.period * st.repeats])

    def __call__(self, tokens: jax.Array, positions: Optional[jax.Array] = None, segment_ids: Optional[jax.Array] = None,
                 *, farskip: Optional[FarSkipConfig] = None, cache: Optional[KVCache] = None,
                 return_hidden: bool = False, logits: bool = True) -> ModelOutput:
        """tokens [b, s] -> ModelOutput (module docstring)."""
        fs = farskip if farskip is not None else self.cfg.farskip
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        m = self.cfg.runtime.micro_batches
        if m > 1 and tokens.shape[0] % m:
            raise ConfigError(f"runtime.micro_batches={m} (two-batch overlap) splits the batch into {m} equal "
                              f"micro-batches, but it has {tokens.shape[0]} rows; use a multiple of {m} rows "
                              "(per device) or runtime.micro_batches=1")
        h = self.embed(tokens)
        caches = [None] * m
        if cache is not None:
            caches = [cache.replace(layers=lay, key_positions=kp) for lay, kp in
                      zip(cache.layers if m > 1 else [cache.layers], split_rows(cache.key_positions, m))]
        steps, carries = [], []
        for h_j, pos_j, seg_j, c_j in zip(split_rows(h, m), split_rows(positions, m), split_rows(segment_ids, m), caches):
            steps.append(self.layer_step(self, pos_j, seg_j, fs, self.cfg.runtime.remat, c_j))
            carries.append(steps[-1].init(h_j))
        scan = self.scanned and steps[0].scannable and (cache is None or cache.scan)
        entries = None if cache is None else [c.layers for c in caches]
        res = run_layers(self, carries if m > 1 else carries[0], steps if m > 1 else steps[0], fs, scan=scan,
                         weights="sliced" if cache is None else "indexed",
                         entries=None if entries is None else (entries if m > 1 else entries[0]), hidden=return_hidden)
        full = merge_rows([c.full for c in res.carry]) if m > 1 else res.carry.full
        out = self.output(full, res.outs, res.hidden, logits=logits)
        return out if cache is None else out.replace(cache=cache.replace(layers=res.entries))

    def unembed(self) -> tuple[jax.Array, bool]:
        """(w, transposed) of the output projection: logits = final @ w (w [d, V]) or final @ w.T for
        tied embeddings (w = the embedding table [V, d]); computed in runtime.compute_dtype."""
        if self.lm_head is None:
            return self.embed.table[...], True
        return self.lm_head.w[...], False

    def output(self, full: jax.Array, outs: list, hidden: Optional[list], logits: bool = True) -> ModelOutput:
        """Final norm of the FULL stream, logits (or the normed stream with logits=False), and the router
        statistics of `outs` [(is_moe, BlockOutput)]: aux/z losses averaged over MoE layers, load
        stacked [n_moe, E], dropped summed over layers."""
        x = self.final_norm(full)
        lg = None
        if logits:
            lg = (self.embed.attend(x) if self.lm_head is None else self.lm_head(x)).astype(jnp.float32)
        moe = [o for is_moe, o in outs if is_moe]
        mean = lambda xs: jnp.mean(jnp.stack(xs)) if xs else jnp.zeros((), jnp.float32)  # noqa: E731
        return ModelOutput(logits=lg, aux_loss=mean([o.aux_loss for o in moe]),
                           z_loss=mean([o.z_loss for o in moe]),
                           load=jnp.stack([o.load for o in moe]) if moe else None,
                           dropped=jnp.sum(jnp.stack([o.dropped for _, o in outs])),
                           hidden=tuple(hidden) if hidden is not None else None, final=None if logits else x)

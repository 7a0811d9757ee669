"""The FarSkip MoE transformer: embedding, L blocks joined by the residual streams, final norm, logits.

    out = Transformer(cfg, rngs=nnx.Rngs(0))(tokens [b, s], positions=None, segment_ids=None,
                                              farskip=None, return_hidden=False, return_trace=False)
    out.logits [b, s, vocab] float32; out.aux_loss / z_loss [] (means over MoE layers);
    out.load [num_moe_layers, E]; out.dropped []; out.hidden (full stream after each layer);
    out.trace (per layer: the attention and MLP inputs and the a/shared/routed outputs).

Connectivity is an argument of the call (default `cfg.farskip`), not of the parameters: the same
weights run under every connectivity, which is what FCSD distillation needs (teacher = standard).

Scan over layers (`model.scan_layers`, docs/scan.md). The blocks live in stacks of alike layers
(model/stacking.py: parameters with a leading "layers" axis; `self.stacks` instead of
`self.layers`). Each stack's repeats are split into maximal runs of EQUAL connectivity
(FarSkipConfig.layer_inputs of every layer of one repeat) and each run of two or more is one
`jax.lax.scan` whose body has that connectivity as static Python: the carry is the `Streams`
(full, no_routed, no_moe and the last d routed / shared outputs, zero-padded to a fixed length:
`Streams.padded`, exact since x + 0 == x). Connectivity is deliberately NOT scanned data: a
`select` between streams inside the body would make attention of layer k depend on the routed
output of layer k-1 (a data dependency through the select's unused operand), which is exactly what
FarSkip removes to let the combine all-to-all of k-1 overlap attention of k. A converted-layer set
that changes kind inside a stack therefore costs one more scan (sliced stacked parameters), not a
dependency. Remat policies wrap each layer inside the scan body. Per-layer results come out of the
scan stacked (router statistics; the full stream for return_hidden). `return_trace`, per-layer
`attention_fns` (KV-cache decoding) and FoE (moe.num_groups > 1) run the unrolled loop over
`blocks()`, per-layer views sliced out of the stacks: same function, no scan.

Connectivity annealing (FCSD, train/annealing.py): `connectivity_mix=alpha` [num_layers] makes each
converted sub-block read its FarSkip stream plus (1 - alpha) times what FarSkip removes
(Streams.attn_input / moe_input with keep = 1 - alpha). None leaves the program above
untouched (no keep term is traced); under scan_layers the alpha of each repeat is scanned
data next to the stacked parameters, the connectivity kinds stay static. Not for FoE.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from farskip_jax.config import Config, FarSkipConfig
from farskip_jax.errors import ConfigError
from farskip_jax.model.block import REMAT_POLICIES, Block, BlockOutput, ModelOutput
from farskip_jax.model.connectivity import Streams
from farskip_jax.model.experts import RoutedComputeFn
from farskip_jax.model.layers import Embed, Linear, RMSNorm, dtype_of
from farskip_jax.model.stacking import LayerStack, connectivity_runs, plan_segments, scan_scope, slice_state, stable_carry


class Transformer(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs, routed_compute: Optional[RoutedComputeFn] = None):
        m = cfg.model
        pd, cd = dtype_of(m.param_dtype), dtype_of(m.compute_dtype)
        self.cfg = cfg
        if cfg.moe.num_groups > 1:  # Federation of Experts: fail early on what it cannot split (model/foe.py)
            from farskip_jax.model.foe import check_foe
            check_foe(cfg)
        self.embed = Embed(m.vocab_size, m.d_model, rngs=rngs, std=m.init_std, param_dtype=pd, compute_dtype=cd)
        blocks = [Block(cfg, i, rngs=rngs, routed_compute=routed_compute) for i in range(m.num_layers)]
        if m.scan_layers:  # same initial values as the unrolled model, stacked (model/stacking.py)
            self.stacks = nnx.List([LayerStack(seg, blocks[seg.start:seg.stop]) for seg in plan_segments(cfg)])
        else:
            self.layers = nnx.List(blocks)
        self.final_norm = RMSNorm(m.d_model, eps=m.norm_eps, param_dtype=pd)
        self.lm_head = None if m.tie_embeddings else Linear(
            m.d_model, m.vocab_size, axes=("embed", "vocab"), rngs=rngs, std=m.init_std, param_dtype=pd, compute_dtype=cd)

    def _run_block(self, block: Block, x_attn, full, positions, segment_ids, moe_input: str,
                   attention_fn=None, moe_keep=None) -> BlockOutput:
        """moe_keep: the annealing weight (1 - alpha, a traced scalar) of an outdated MoE input, or None."""
        if self.cfg.model.remat == "none" or attention_fn is not None:
            if moe_keep is None:
                return block(x_attn, full, positions, segment_ids, moe_input, attention_fn)
            return block(x_attn, full, positions, segment_ids, moe_input, attention_fn, moe_keep=moe_keep)
        policy = REMAT_POLICIES[self.cfg.model.remat]
        if moe_keep is None:
            fn = nnx.remat(lambda b, xa, f, p, s: b(xa, f, p, s, moe_input), policy=policy)
            return fn(block, x_attn, full, positions, segment_ids)
        fn = nnx.remat(lambda b, xa, f, p, s, k: b(xa, f, p, s, moe_input, moe_keep=k), policy=policy)
        return fn(block, x_attn, full, positions, segment_ids, moe_keep)

    @property
    def scanned(self) -> bool:
        return self.cfg.model.scan_layers

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
                 *, farskip: Optional[FarSkipConfig] = None, return_hidden: bool = False,
                 return_trace: bool = False, attention_fns=None,
                 connectivity_mix: Optional[jax.Array] = None) -> ModelOutput:
        """attention_fns: per layer, fn(normalised attention input) -> attention output replacing the
        layer's own attention (KV-cache decoding, eval/generate.py); no remat then.
        Under model.scan_layers the stacks run as scans; return_trace and attention_fns run the
        unrolled loop over per-layer views of the stacked parameters instead (module docstring).
        connectivity_mix: [num_layers] float alpha in [0, 1] (connectivity annealing, FCSD): each
        converted sub-block reads its FarSkip stream plus (1 - alpha) times what FarSkip removes from
        it (alpha 1 = FarSkip bitwise, 0 = standard); unconverted layers ignore it. Traced data: a new
        value never recompiles. None = the plain code path (unchanged program)."""
        mix = None if connectivity_mix is None else self._check_mix(connectivity_mix)
        if self.cfg.moe.num_groups > 1:  # Federation of Experts groups (model/foe.py)
            from farskip_jax.model.foe import foe_forward
            return foe_forward(self, tokens, positions, segment_ids, farskip=farskip, return_hidden=return_hidden,
                               return_trace=return_trace, attention_fns=attention_fns)
        fs = farskip if farskip is not None else self.cfg.farskip
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        h = self.embed(tokens)
        streams = Streams.init(h, fs.skip_distance)
        if self.scanned and not return_trace and attention_fns is None:
            return self._scanned(streams, positions, segment_ids, fs, return_hidden, mix=mix)
        blocks = self.blocks()
        n = len(blocks)
        outs, hidden, trace = [], [], []
        for i, block in enumerate(blocks):
            attn_kind, moe_kind = fs.layer_inputs(i, n)
            # annealing: keep = 1 - alpha on converted layers; None (the plain program) otherwise
            keep = None if mix is None or (attn_kind, moe_kind) == ("full", "full") else 1.0 - mix[i]
            with jax.named_scope(f"layer_{i}"):
                x_attn = streams.attn_input(attn_kind, keep)
                out = self._run_block(block, x_attn, streams.full, positions, segment_ids, moe_kind,
                                      None if attention_fns is None else attention_fns[i],
                                      keep if moe_kind == "outdated" else None)
                if return_trace:
                    trace.append(dict(attn_in=x_attn, moe_in=streams.moe_input(moe_kind, out.attn, keep),
                                      attn=out.attn, shared=out.shared, routed=out.routed, attn_kind=attn_kind,
                                      moe_kind=moe_kind))
                streams = streams.update(out.attn, out.shared, out.routed)
            outs.append((block.is_moe, out))
            if return_hidden:
                hidden.append(streams.full)
        return self.output(streams.full, outs, hidden if return_hidden else None, trace if return_trace else None)

    def teacher_forced(self, trace: tuple, positions: jax.Array, segment_ids: Optional[jax.Array] = None, *,
                       farskip: Optional[FarSkipConfig] = None) -> list:
        """Every layer run once on inputs built from ANOTHER pass's outputs (teacher forcing; FCSD's
        local reconstruction loss, train/local_distill.py). trace: the `trace` of a forward (per layer
        dict of attn_in [b, s, d] (layer 0: the embedding), attn, shared, routed [b, s, d] or None).
        Layer i's attention reads `farskip`'s attention input of the streams that the trace's outputs
        of layers < i make; its MoE/MLP reads that input of those streams and the trace's attention
        output of layer i (`full` = R_{i-1} + a_i of the trace, `outdated` = R_{i-1}). The layers do not
        feed each other, so each one's error is its own. Returns per layer its BlockOutput (attn, shared,
        routed of this model). Unrolled over `blocks()` (scan_layers: per-layer views); each layer under
        the model's remat policy (`model.remat`)."""
        if self.cfg.moe.num_groups > 1:
            raise ConfigError("teacher-forced layers (distill.local_weight) are not implemented for Federation of "
                              "Experts (moe.num_groups > 1); set distill.local_weight: 0 or moe.num_groups: 1")
        fs = farskip if farskip is not None else self.cfg.farskip
        blocks = self.blocks()
        n = len(blocks)
        if len(trace) != n:
            raise ValueError(f"teacher_forced: the trace has {len(trace)} layers, the model {n}")

        def run(b, x_attn, x_moe, p, s):
            return b.ffn(x_moe).replace(attn=b.attention(x_attn, p, s))

        if self.cfg.model.remat != "none":  # the model's remat policy, per layer
            run = nnx.remat(run, policy=REMAT_POLICIES[self.cfg.model.remat])
        streams = Streams.init(trace[0]["attn_in"], fs.skip_distance)
        outs = []
        for i, (block, t) in enumerate(zip(blocks, trace)):
            attn_kind, moe_kind = fs.layer_inputs(i, n)
            with jax.named_scope(f"forced_layer_{i}"):
                outs.append(run(block, streams.attn_input(attn_kind), streams.moe_input(moe_kind, t["attn"]),
                                positions, segment_ids))
            streams = streams.update(t["attn"], t["shared"], t["routed"])
        return outs

    def _check_mix(self, mix) -> jax.Array:
        """connectivity_mix as float32 [num_layers], or a ConfigError (FoE; a wrong shape)."""
        n = self.cfg.model.num_layers
        if self.cfg.moe.num_groups > 1:
            raise ConfigError("connectivity annealing (distill.anneal / distill.progressive, connectivity_mix) is not "
                              "implemented for Federation of Experts (moe.num_groups > 1); use distill.anneal: none "
                              "and distill.progressive: false, or moe.num_groups: 1")
        if tuple(jnp.shape(mix)) != (n,):
            raise ConfigError(f"connectivity_mix must have shape [num_layers] = [{n}] (alpha per layer), "
                              f"got {tuple(jnp.shape(mix))}")
        return jnp.asarray(mix, jnp.float32)

    def _scanned(self, streams: Streams, positions, segment_ids, fs: FarSkipConfig, return_hidden: bool,
                 mix: Optional[jax.Array] = None) -> ModelOutput:
        """The stacks in layer order; each stack's repeats split into runs of equal (static)
        connectivity; a run of >= 2 repeats is one jax.lax.scan, a run of 1 is called directly."""
        n = self.cfg.model.num_layers
        remat = self.cfg.model.remat
        outs, hidden = [], []
        for s, st in enumerate(self.stacks):
            seg = st.segment
            graphdefs, states, is_moe = st.split_blocks()
            kinds = st.connectivity(fs, n)
            for r0, r1 in connectivity_runs(kinds):
                if mix is None:
                    body = _stack_body(graphdefs, kinds[r0], positions, segment_ids, remat, return_hidden,
                                       pad=r1 - r0 > 1)
                    x_of = lambda r: [slice_state(x, r) for x in states]  # noqa: E731
                else:  # alpha of each layer of each repeat rides along as scanned data: [repeats, period]
                    body = _stack_body(graphdefs, kinds[r0], positions, segment_ids, remat, return_hidden,
                                       pad=r1 - r0 > 1, mixed=True)
                    rows = mix[np.asarray([[seg.layer(q, r) for q in range(seg.period)] for r in range(r0, r1)])]
                    x_of = lambda r, rows=rows, r0=r0: ([slice_state(x, r) for x in states],  # noqa: E731
                                                        rows[r - r0] if isinstance(r, int) else rows)
                # stacking.scan_scope: analysis/loop_schedule.py names
                # block q of iteration k `layer_{first + k * period + q}` when it unrolls the loop
                with jax.named_scope(f"stack_{s}"), jax.named_scope(scan_scope(seg.layer(0, r0), seg.period)):
                    if r1 - r0 == 1:
                        streams, (stats, hid) = body(streams, x_of(r0))
                        stats, hid = [[y] for y in stats], [[y] for y in hid]
                    else:
                        xs = x_of(slice(r0, r1))
                        carry = stable_carry(body, streams.padded(), x_of(r0))
                        streams, (ys, hys) = jax.lax.scan(body, carry, xs)
                        unstack = lambda t, j: jax.tree.map(lambda y: y[j], t)  # noqa: E731
                        stats = [[unstack(ys[q], j) for j in range(r1 - r0)] for q in range(seg.period)]
                        hid = [[None if hys[q] is None else hys[q][j] for j in range(r1 - r0)]
                               for q in range(seg.period)]
                for j in range(r1 - r0):
                    for q in range(seg.period):
                        outs.append((is_moe[q], stats[q][j]))
                        hidden.append(hid[q][j])
        return self.output(streams.full, outs, hidden if return_hidden else None, None)

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


def _stack_body(graphdefs, kinds, positions, segment_ids, remat: str, return_hidden: bool, pad: bool,
                mixed: bool = False):
    """Scan body over one repeat of a stack: (streams, [state of block q]) -> (streams, (stats, hidden)).
    stats[q]: layer q's BlockOutput without its activations (aux/z loss, load, dropped); hidden[q]:
    the full stream after it (None unless return_hidden). pad: keep the carry in Streams.padded form.
    mixed (connectivity annealing): the body takes ([state of block q], alpha [period]) instead."""

    def body(streams: Streams, states):
        alphas = None
        if mixed:
            states, alphas = states
        stats, hid = [], []
        for q, (gd, st) in enumerate(zip(graphdefs, states)):
            attn_kind, moe_kind = kinds[q]
            keep = None if alphas is None or (attn_kind, moe_kind) == ("full", "full") else 1.0 - alphas[q]

            def run_plain(st, x_attn, full, gd=gd, moe_kind=moe_kind):
                return nnx.merge(gd, st)(x_attn, full, positions, segment_ids, moe_kind)

            def run_mixed(st, x_attn, full, k, gd=gd, moe_kind=moe_kind):
                return nnx.merge(gd, st)(x_attn, full, positions, segment_ids, moe_kind, moe_keep=k)

            run = run_plain if keep is None else run_mixed
            if remat != "none":  # the policy applies inside the scan body, per layer
                run = jax.checkpoint(run, policy=REMAT_POLICIES[remat])
            with jax.named_scope(f"layer_q{q}"):
                if keep is None:
                    out = run(st, streams.attn_input(attn_kind), streams.full)
                else:
                    out = run(st, streams.attn_input(attn_kind, keep), streams.full,
                              keep if moe_kind == "outdated" else None)
                streams = streams.update(out.attn, out.shared, out.routed)
            if pad:
                streams = streams.padded()
            stats.append(out.replace(attn=None, shared=None, routed=None))
            hid.append(streams.full if return_hidden else None)
        return streams, (stats, hid)

    return body

"""The one layer loop: every forward of the model runs its layers through `run_layers`.

    res = run_layers(model, carry, step, farskip, scan=True, weights="sliced", entries=None, hidden=False)
    res.carry (after the last layer), res.outs [(is_moe, BlockOutput)] in layer order,
    res.hidden [full stream after each layer] or None, res.entries (the updated cache entries) or None

A *step* runs ONE layer on the carried state (model/layer_step.py: the layer, written once):

    step(block, carry, site, entry) -> (carry, BlockOutput, entry)

`carry` is the step's pytree with a `full` field (connectivity/streams.Streams for the ordinary model;
model/foe.py adds the groups' pending outputs); `site` (LayerSite) says which layer it is: its index
and static connectivity kinds, and where it sits in the model's stacks; `entry` is the layer's KV-cache
entry (decoding) or None.

Layers are visited group by group: a group is one LayerStack of a model with `runtime.scan_layers`
(model/stacking.py: `period` blocks with parameters stacked over `repeats`) or one unstacked Block
(period 1, repeats 1, no layer axis). A group's repeats are split into maximal runs of EQUAL static
connectivity (FarSkipConfig.layer_inputs of every layer of one repeat). With `scan`, a run of two or
more repeats of a stack is one `jax.lax.scan` whose body runs the period's blocks with that
connectivity as static Python. Connectivity is deliberately NOT scanned data: a `select` between
streams inside the body would make attention of layer k depend on the routed output of layer k-1,
which is exactly what FarSkip removes. The scan's carry is `step.scan_carry(carry, kinds)`: the
Streams padded to a fixed structure and pruned to what later layers read (x + 0 == x: exact).

Weights of a scan: `sliced` (training, evaluation) scans over the stacked parameters of the run as
data; `indexed` (decoding) scans over layer indices and indexes the whole stacked weights inside the
body, so no layer's weights are copied out of a stack (a run of one repeat is scanned too).
Without `scan` (or for a run of one repeat under `sliced`) the layers run unrolled, a stack's layers
as per-layer views (LayerStack.layer).

Cache entries (`entries`): per group, per block q of its period, the (k, v) entry the step reads
and returns for each layer (a stack's entry has a leading layer axis; the step gets the row as
`site.row`; an unstacked layer's entry has none and `site.row` is None). A scan carries its group's
entries, so an in-place update of one row never copies the rest.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from farskip_jax.config import FarSkipConfig
from farskip_jax.model.router import balance_loss
from farskip_jax.model.stacking import Segment, connectivity_runs, scan_scope, slice_state, stable_carry


@dataclasses.dataclass(frozen=True)
class LayerSite:
    """Where a layer runs. index: its layer index (a traced scalar inside an indexed scan, None inside a
    sliced one, whose layers are alike: model/stacking.layer_signature); kinds: its static
    (attn_input, moe_input); stack / q: its group and block within the group's period; row: its row of
    the group's stacked layer axis (int, traced in a scan, None for an unstacked layer)."""

    index: Any
    kinds: tuple
    stack: int
    q: int
    row: Any


@dataclasses.dataclass
class LoopResult:
    carry: Any
    outs: list
    hidden: Optional[list]
    entries: Optional[tuple]


def layer_groups(model) -> list:
    """[(Segment, [block of each q] or None, LayerStack or None)] in layer order: an unstacked model's
    layers are groups of one Block each; a stacked model's groups are its LayerStacks."""
    if getattr(model, "scanned", False):
        return [(st.segment, None, st) for st in model.stacks]
    return [(Segment(i, 1, 1), [blk], None) for i, blk in enumerate(model.layers)]


def split_rows(x: Optional[jax.Array], m: int) -> list:
    """x [b, ...] -> m interleaved micro-batches [b/m, ...] (micro-batch j = rows j, j+m, j+2m, ...):
    with the batch sharded over devices, each device's rows split locally (b/m per device even)."""
    if x is None or m == 1:
        return [x] * m
    y = x.reshape(x.shape[0] // m, m, *x.shape[1:])
    return [y[:, j] for j in range(m)]


def merge_rows(xs: list) -> Optional[jax.Array]:
    """The inverse of split_rows: m micro-batches [b/m, ...] -> [b, ...]."""
    if len(xs) == 1 or xs[0] is None:
        return xs[0]
    return jnp.stack(xs, axis=1).reshape(-1, *xs[0].shape[1:])


def merge_outputs(outs: list, num_groups: int = 1):
    """One layer's BlockOutput of the whole batch from those of its m equal micro-batches: activations
    re-interleaved, expert load and importance averaged (the balance loss recomputed from them, as
    the whole batch gives it), z-loss averaged, drops summed."""
    if len(outs) == 1:
        return outs[0]
    m = len(outs)
    acts = {k: merge_rows([getattr(o, k) for o in outs]) for k in ("attn", "shared", "routed")}
    if outs[0].load is None:  # dense layer: no router statistics
        return outs[0].replace(**acts, dropped=sum(o.dropped for o in outs))
    load = sum(o.load for o in outs) / m
    imp = sum(o.importance for o in outs) / m
    return outs[0].replace(**acts, load=load, importance=imp, aux_loss=balance_loss(load, imp, num_groups),
                           z_loss=sum(o.z_loss for o in outs) / m, dropped=sum(o.dropped for o in outs))


def run_layers(model, carry, step: Callable, farskip: FarSkipConfig, *, scan: bool = True, weights: str = "sliced",
               entries: Optional[tuple] = None, hidden: bool = False) -> LoopResult:
    """Run every layer of `model` through `step` (module docstring). scan: run stacks as scans where
    possible; weights: "sliced" | "indexed"; entries: per group, per block, the cache entries (or None);
    hidden: collect the full stream after each layer.

    Micro-batches (runtime.micro_batches = m > 1, two-batch overlap): `carry` and `step` are lists of m
    (one per micro-batch, in split_rows order) and `entries` a list of m; every layer runs each
    micro-batch's step in turn (scopes `layer_{i}/mb{j}`), so nothing of micro-batch j depends on
    another's, and its outputs are merged (merge_outputs). res.carry / res.entries are then lists too."""
    multi = isinstance(step, (list, tuple))
    steps, carries = (list(step), list(carry)) if multi else ([step], [carry])
    sides = (list(entries) if multi else [entries]) if entries is not None else None
    m = len(steps)
    n = model.cfg.model.num_layers
    groups_h = model.cfg.runtime.num_groups
    attn_kinds = [farskip.layer_inputs(i, n)[0] for i in range(n)]
    outs, hid = [], []
    new_side = [[] for _ in range(m)] if sides is not None else None

    def run(blk, site, carries, g_side):
        """One layer on every micro-batch -> (carries, merged BlockOutput)."""
        per = []
        for j in range(m):
            with jax.named_scope(f"mb{j}") if m > 1 else contextlib.nullcontext():
                sq = None if g_side is None else g_side[j][site.q]
                carries[j], out, sq = steps[j](blk, carries[j], site, sq)
            if g_side is not None:
                g_side[j][site.q] = sq
            per.append(out)
        return carries, merge_outputs(per, groups_h)

    for s, (seg, blocks, stack) in enumerate(layer_groups(model)):
        kinds = [tuple(farskip.layer_inputs(seg.layer(q, r), n) for q in range(seg.period)) for r in range(seg.repeats)]
        g_side = None if sides is None else [list(sd[s]) for sd in sides]
        for r0, r1 in connectivity_runs(kinds):
            scanned = stack is not None and scan and (r1 - r0 > 1 or weights == "indexed")
            if not scanned:
                for r in range(r0, r1):
                    for q in range(seg.period):
                        i = seg.layer(q, r)
                        blk = blocks[q] if stack is None else stack.layer(q, r)
                        site = LayerSite(index=i, kinds=kinds[r][q], stack=s, q=q, row=None if stack is None else r)
                        with jax.named_scope(f"layer_{i}"):
                            carries, out = run(blk, site, carries, g_side)
                        outs.append((blk.is_moe, out))
                        hid.append(merge_rows([c.full for c in carries]) if hidden else None)
                continue
            later = set(attn_kinds[seg.layer(0, r0):])  # read by this run or any later layer
            body = _scan_body(stack, kinds[r0], steps, s, weights, later, hidden, g_side is not None, run)
            xs = (jnp.arange(r0, r1, dtype=jnp.int32) if weights == "indexed"
                  else [slice_state(st, slice(r0, r1)) for st in stack.split_blocks()[1]])
            x0 = jnp.int32(r0) if weights == "indexed" else [slice_state(st, r0) for st in stack.split_blocks()[1]]
            with jax.named_scope(f"stack_{s}"), jax.named_scope(scan_scope(seg.layer(0, r0), seg.period)):
                init = (tuple(st.scan_carry(c, later) for st, c in zip(steps, carries)),
                        None if g_side is None else tuple(tuple(gs) for gs in g_side))
                init = stable_carry(body, init, x0)
                (cs, gs), (ys, hys) = jax.lax.scan(body, init, xs)
            carries = list(cs)
            if g_side is not None:
                g_side = [list(x) for x in gs]
            for k in range(r1 - r0):
                for q in range(seg.period):
                    outs.append((stack.blocks[q].is_moe, jax.tree.map(lambda y: y[k], ys[q])))
                    hid.append(None if hys[q] is None else hys[q][k])
        if sides is not None:
            for j in range(m):
                new_side[j].append(tuple(g_side[j]))
    res_side = None if sides is None else [tuple(x) for x in new_side]
    return LoopResult(carry=carries if multi else carries[0], outs=outs, hidden=hid if hidden else None,
                      entries=(res_side if multi else res_side[0]) if sides is not None else None)


def _scan_body(stack, kinds: tuple, steps: list, s: int, weights: str, later: set, hidden: bool, has_side: bool,
               run: Callable):
    """Scan body over one repeat of a stack: ((carries, sides), x) -> ((carries, sides), (stats, hidden)).
    x: the repeat's sliced states (weights "sliced") or its row index ("indexed")."""
    graphdefs, states, _ = stack.split_blocks()

    def body(c, x):
        carries, side = c
        carries = list(carries)
        side = None if side is None else [list(sd) for sd in side]
        stats, hid = [], []
        for q, gd in enumerate(graphdefs):
            if weights == "indexed":
                blk, row = nnx.merge(gd, slice_state(states[q], x)), x
            else:
                blk, row = nnx.merge(gd, x[q]), None
            index = stack.segment.layer(q, 0) + x * stack.period if weights == "indexed" else None
            site = LayerSite(index=index, kinds=kinds[q], stack=s, q=q, row=row)
            with jax.named_scope(f"layer_q{q}"):
                carries, out = run(blk, site, carries, side)
            carries = [st.scan_carry(cj, later) for st, cj in zip(steps, carries)]
            stats.append(out.replace(attn=None, shared=None, routed=None))
            hid.append(merge_rows([cj.full for cj in carries]) if hidden else None)
        return (tuple(carries), None if side is None else tuple(tuple(sd) for sd in side)), (stats, hid)

    return body

"""Picture of the two streams for one layer: compute ops (by scope) and all-to-alls, several
schedules stacked (standard above farskip).

    plot_layer_timelines([(label, schedule, report), ...], layer=3, direction="fwd", path="t.png")

Each panel has two lanes on XLA's modelled time axis: `compute` (one bar per op, coloured by the
part of the layer it belongs to) and `all-to-all` (one bar per collective from its start for its
modelled duration; the part not covered by compute is drawn hatched = exposed).
"""

from __future__ import annotations

from typing import Optional, Sequence

from farskip_jax.analysis.hlo import Schedule
from farskip_jax.analysis.report import OverlapReport
from farskip_jax.analysis.scopes import COARSE, layer_of, scope_of

COLORS = {"attention": "#4C72B0", "moe": "#DD8452", "shared": "#55A868", "other": "#8C8C8C",
          "dispatch": "#C44E52", "combine": "#8172B3",
          "attention all-reduce": "#1F3B73", "routed all-reduce": "#8B3A0F"}


def _layer_span(rep: OverlapReport, layer: int, direction: str) -> tuple[float, float]:
    """From the first start to the last done of the token all-to-alls of `layer` in `direction`."""
    sel = [s for s in rep.stats if s.layer == layer and s.direction == direction]
    if not sel:
        raise ValueError(f"no all-to-all of layer {layer} ({direction}) in report {rep.label!r}")
    big = max(s.bytes for s in sel)
    sel = [s for s in sel if s.bytes >= 0.1 * big]  # the token exchanges, not small metadata ones
    return min(s.t_start for s in sel), max(max(s.t_done, s.t_start + s.duration) for s in sel)


def plot_layer_timelines(items: Sequence[tuple[str, Schedule, OverlapReport]], layer: int, direction: str = "fwd",
                         path: Optional[str] = None, margin: float = 0.6, role_of=None, lane: str = "all-to-all"):
    """One panel per (label, schedule, report); returns the matplotlib figure (saved when path).
    role_of(stat) -> the collective's colour key (default its dispatch/combine role; e.g. "attention
    all-reduce" for the serving programs' reports, analysis/inference_report.py); `lane` names the
    collective lane."""
    role_of = role_of or (lambda s: s.role)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(items), 1, figsize=(13, 2.2 * len(items) + 0.6), squeeze=False)
    for ax, (label, sched, rep) in zip(axes[:, 0], items):
        t0, t1 = _layer_span(rep, layer, direction)
        pad = margin * (t1 - t0)
        lo, hi = t0 - pad, t1 + pad
        for o in sched.ops:
            if o.kind != "compute" or o.duration <= 0 or o.end < lo or o.start > hi:
                continue
            sc = scope_of(o.op_name)
            color = COLORS.get(COARSE.get(sc, sc if sc in COLORS else "other"), COLORS["other"])
            alpha = 1.0 if layer_of(o.op_name) == layer else 0.45
            ax.broken_barh([(o.start, o.duration)], (1.1, 0.8), facecolors=color, alpha=alpha, edgecolor="none")
        for s in rep.stats:
            if s.t_start > hi or s.t_start + s.duration < lo:
                continue
            role = role_of(s)
            color = COLORS.get(role, COLORS["other"])
            ax.broken_barh([(s.t_start, s.hidden)], (0.1, 0.8), facecolors=color, edgecolor="black", lw=0.4)
            ax.broken_barh([(s.t_start + s.hidden, s.exposed)], (0.1, 0.8), facecolors="white", edgecolor=color,
                           hatch="///", lw=0.8)
            ax.text(s.t_start, 0.5, f" {role[:4]} L{s.layer} {s.direction}", va="center", fontsize=7)
        tot = rep.totals(direction)
        ax.set_title(f"{label}: layer {layer} {direction} — {lane}s {100 * tot['hidden_frac']:.1f}% hidden, "
                     f"step {rep.step_time / 1000:.2f} ms", fontsize=9, loc="left")
        ax.set_yticks([0.5, 1.5], [lane, "compute"])
        ax.set_xlim(lo, hi)
        ax.set_xlabel("modelled time (us)")
    handles = [matplotlib.patches.Patch(color=c, label=k) for k, c in COLORS.items()]
    handles.append(matplotlib.patches.Patch(facecolor="white", edgecolor="black", hatch="///", label="exposed"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    if path:
        fig.savefig(path, dpi=120)
    return fig

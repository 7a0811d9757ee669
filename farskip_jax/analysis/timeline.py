"""Picture of the two streams for one layer: compute ops (by scope) and all-to-alls, several
schedules stacked (standard above farskip).

    plot_layer_timelines([(label, schedule, report), ...], layer=3, direction="fwd", path="t.png")

Each panel has two lanes on the modelled time axis: `compute` (one bar per op, coloured by the part
of the layer it belongs to, faded for other layers) and `all-to-all` (one bar per collective from its
start for its modelled duration; the part not covered by compute is drawn hatched = exposed), labelled
where the bar has room. The legend names only the colours the figure uses.
"""

from __future__ import annotations

from typing import Optional, Sequence

from farskip_jax.analysis.hlo import Schedule
from farskip_jax.analysis.report import OverlapReport
from farskip_jax.analysis.scopes import COARSE, layer_of, scope_of

COLORS = {"attention": "#4C72B0", "moe": "#DD8452", "shared": "#55A868", "other": "#8C8C8C",
          "dispatch": "#C44E52", "combine": "#8172B3",
          "attention all-reduce": "#1F3B73", "routed all-reduce": "#8B3A0F"}
FADED = 0.45  # alpha of the compute of other layers


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
    # deferred: matplotlib's backend is chosen when a figure is drawn, not at import
    import matplotlib

    matplotlib.use("Agg")
    # deferred: pyplot loads after that backend choice
    import matplotlib.pyplot as plt

    width_in = 13.0
    fig, axes = plt.subplots(len(items), 1, figsize=(width_in, 2.2 * len(items) + 0.6), squeeze=False)
    used: dict = {}  # legend key -> colour of what the figure shows (listed in COLORS order)
    faded = False
    for ax, (label, sched, rep) in zip(axes[:, 0], items):
        t0, t1 = _layer_span(rep, layer, direction)
        pad = margin * (t1 - t0)
        lo, hi = t0 - pad, t1 + pad
        for o in sched.ops:
            if o.kind != "compute" or o.duration <= 0 or o.end < lo or o.start > hi:
                continue
            sc = scope_of(o.op_name)
            key = COARSE.get(sc, sc if sc in COLORS else "other")
            key = key if key in COLORS else "other"
            mine = layer_of(o.op_name) == layer
            faded |= not mine
            used.setdefault(key, COLORS[key])
            ax.broken_barh([(o.start, o.duration)], (1.1, 0.8), facecolors=COLORS[key], alpha=1.0 if mine else FADED,
                           edgecolor="none")
        # collective labels: inside the visible axis, only where the bar leaves room and no earlier label is
        per_char = 0.6 * 7 / 72 * (hi - lo) / (0.85 * width_in)  # data units per character of a 7 pt label
        label_end = lo
        for s in sorted(rep.stats, key=lambda s: s.t_start):
            if s.t_start > hi or s.t_start + s.duration < lo:
                continue
            role = role_of(s)
            color = COLORS.get(role, COLORS["other"])
            used.setdefault(role if role in COLORS else "other", color)
            ax.broken_barh([(s.t_start, s.hidden)], (0.1, 0.8), facecolors=color, edgecolor="black", lw=0.4)
            ax.broken_barh([(s.t_start + s.hidden, s.exposed)], (0.1, 0.8), facecolors="white", edgecolor=color,
                           hatch="///", lw=0.8)
            text = f"{role[:4]} L{s.layer}"  # the direction is in the panel's title
            x0 = max(s.t_start, lo)
            room = min(s.t_start + max(s.duration, s.hidden + s.exposed), hi) - x0
            need = (len(text) + 1) * per_char
            if room >= need and x0 >= label_end:
                ax.text(x0, 0.5, " " + text, va="center", fontsize=7, clip_on=True)
                label_end = x0 + need
        tot = rep.totals(direction)
        ax.set_title(f"{label}: layer {layer} {direction} — {lane}s {100 * tot['hidden_frac']:.1f}% hidden, "
                     f"step {rep.step_time / 1000:.2f} ms", fontsize=9, loc="left")
        ax.set_yticks([0.5, 1.5], [lane, "compute"])
        ax.set_xlim(lo, hi)
        ax.set_xlabel("modelled time (us)")
    handles = [matplotlib.patches.Patch(color=c, label=k) for k, c in COLORS.items() if k in used]
    if faded:
        handles.append(matplotlib.patches.Patch(facecolor=COLORS["attention"], alpha=FADED,
                                                label="faded = other layers"))
    handles.append(matplotlib.patches.Patch(facecolor="white", edgecolor="black", hatch="///", label="exposed"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.45 / (2.2 * len(items) + 0.6), 1, 1))
    if path:
        fig.savefig(path, dpi=120)
    return fig

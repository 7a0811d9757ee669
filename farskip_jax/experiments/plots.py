"""Figures and tables of the notebooks' experiments (matplotlib; every function returns the figure
or a markdown string so a notebook displays it and a script can save it).

    fig = plot_val_curves(records)                      # ablation.RunRecord list: mean over seeds + min/max band
    zoom_last(ax, records, frac=0.5)                    # that panel: the last half of training, both axes
    md = ablation_table(summarize(records), overlap, paired=paired_differences(records))
    fig = plot_paired_differences(paired)               # variant - standard per seed, mean, interval, detectable
    fig = plot_quality_vs_speed(paired, overlap)        # that difference vs the exposed all-to-all fraction
    fig = plot_recovery(fcsd_records, teacher_tokens)    # FCSD: val loss / KL / top-1 vs distillation tokens
"""

from __future__ import annotations

import io
from typing import Mapping, Optional, Sequence

import numpy as np


def _plt():
    # deferred: matplotlib's backend is chosen when a figure is drawn, not at import
    import matplotlib

    if matplotlib.get_backend().lower() not in ("module://matplotlib_inline.backend_inline", "inline"):
        matplotlib.use("Agg")
    # deferred: pyplot loads after that backend choice
    import matplotlib.pyplot as plt

    return plt


def plot_val_curves(records: Sequence, labels: Optional[Mapping[str, str]] = None, ax=None,
                    title: str = "validation loss during pretraining"):
    """One line per variant: mean validation loss over seeds vs step, shaded between min and max."""
    plt = _plt()
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(8, 4.5))
    by: dict = {}
    for r in records:
        by.setdefault(r.variant, []).append(r)
    for name, rs in by.items():
        steps = sorted(set.intersection(*(set(r.steps) for r in rs)))
        if not steps:
            continue
        ys = np.array([[dict(zip(r.steps, r.val_loss))[s] for s in steps] for r in rs])
        lab = (labels or {}).get(name, name) + (f" ({len(rs)} seeds)" if len(rs) > 1 else "")
        line, = ax.plot(steps, ys.mean(0), "o-", ms=3, label=lab)
        if len(rs) > 1:
            ax.fill_between(steps, ys.min(0), ys.max(0), color=line.get_color(), alpha=0.15)
    ax.set(xlabel="training step", ylabel="validation loss (nats/token)", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if fig is not None:
        fig.tight_layout()
    return fig if fig is not None else ax.figure


def zoom_last(ax, records: Sequence, frac: float = 0.5, pad: float = 0.05) -> None:
    """Show the last `frac` of training only: the x axis from that step on, the y axis to the range the
    curves take there (the tails differ by a few hundredths; the first steps would hide them)."""
    tail, last = [], max((r.steps[-1] for r in records if r.steps), default=None)
    if last is None:
        return
    cut = last * (1 - frac)
    for r in records:
        tail += [v for s, v in zip(r.steps, r.val_loss) if s >= cut]
    if tail:
        lo, hi = float(np.min(tail)), float(np.max(tail))
        d = max(hi - lo, 1e-3) * pad
        ax.set_ylim(lo - d, hi + d)
        ax.set_xlim(cut - (last - cut) * pad, last + (last - cut) * pad)


def _label(labels, name: str) -> str:
    return (labels or {}).get(name, name)


def ablation_table(summary: Sequence[dict], overlap: Optional[Mapping[str, dict]] = None,
                   labels: Optional[Mapping[str, str]] = None, paired: Optional[Sequence] = None) -> str:
    """Markdown: variant | seeds | final val loss mean ± std | min – max | vs standard (means) [| paired
    difference to the reference with its interval, relative, smallest detectable] [| exposed a2a |
    hidden / bound | step time]. `paired`: ablation.paired_differences rows."""
    head = "| variant | seeds | final val loss (mean ± std) | min – max | vs standard |"
    sep = "|---|---|---|---|---|"
    pair = {p.variant: p for p in (paired or ())}
    if paired:
        lvl = f"{100 * paired[0].level:.0f}%"
        head += f" paired difference, nats [{lvl} interval] | relative | detectable (power {paired[0].power:.0%}) |"
        sep += "---|---|---|"
    if overlap:
        head += " exposed all-to-all | hidden / bound | modelled fwd time |"
        sep += "---|---|---|"
    lines = [head, sep]
    for r in summary:
        vs = f"{100 * r['vs_ref']:+.2f}%" if r.get("vs_ref") is not None else "–"
        line = (f"| {_label(labels, r['variant'])} | {r['seeds']} | {r['mean']:.4f} ± {r['std']:.4f} | "
                f"{r['min']:.4f} – {r['max']:.4f} | {vs} |")
        if paired:
            p = pair.get(r["variant"])
            if p is None:
                line += " reference | – | – |"
            elif p.n < 2:
                line += f" {p.mean:+.4f} (1 pair: no interval) | {100 * p.rel_mean:+.2f}% | – |"
            else:
                line += (f" {p.mean:+.4f} [{p.ci[0]:+.4f}, {p.ci[1]:+.4f}]{' *' if p.resolved else ''} | "
                         f"{100 * p.rel_mean:+.2f}% | ±{p.detectable:.4f} ({100 * p.rel_detectable:.1f}%) |")
        if overlap:
            o = overlap.get(r["variant"])
            if o is None:
                line += " – | – | – |"
            else:
                of_bound = o["hidden_frac"] / o["bound_frac"] if o["bound_frac"] else 1.0
                line += f" {100 * o['exposed_frac']:.1f}% | {100 * of_bound:.0f}% | {o['step_time_us'] / 1000:.3f} ms |"
        lines.append(line)
    return "\n".join(lines)


def plot_paired_differences(paired: Sequence, labels: Optional[Mapping[str, str]] = None, ax=None):
    """One row per variant: its final-loss difference to the reference for every seed (dots), their
    mean with its interval (bar), and the band of differences the runs could not detect (shaded)."""
    plt = _plt()
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(11, 0.6 * len(paired) + 2.0))
    for i, p in enumerate(paired):
        y = len(paired) - 1 - i
        if np.isfinite(p.detectable):
            ax.fill_betweenx([y - 0.35, y + 0.35], -p.detectable, p.detectable, color="0.85", lw=0,
                             label="not detectable by these runs" if i == 0 else None)
        ax.plot(p.diffs, [y] * p.n, "o", color="C0", ms=4, alpha=0.6, label="one seed (pair)" if i == 0 else None)
        if np.all(np.isfinite(p.ci)):
            ax.errorbar([p.mean], [y], xerr=[[p.mean - p.ci[0]], [p.ci[1] - p.mean]], fmt="D", color="C3",
                        capsize=4, label=f"mean, {100 * p.level:.0f}% interval" if i == 0 else None)
        else:
            ax.plot([p.mean], [y], "D", color="C3")
    ax.axvline(0.0, color="black", lw=0.8)
    ax.set_yticks(range(len(paired)), [f"{_label(labels, p.variant)} ({p.n} seeds)" for p in reversed(paired)])
    ref = paired[0].reference if paired else "reference"
    ax.set(xlabel=f"final validation loss minus {ref}'s, same seed (nats; < 0 = better)",
           title=f"paired differences to {ref}")
    ax.set_ylim(-0.6, len(paired) - 0.4)
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.45 if len(paired) < 3 else -0.18), ncol=3,
              frameon=False)
    if fig is not None:
        fig.tight_layout()
    return fig if fig is not None else ax.figure


def plot_quality_vs_speed(paired: Sequence, overlap: Mapping[str, dict],
                          labels: Optional[Mapping[str, str]] = None, ax=None):
    """Scatter: exposed all-to-all fraction (x) vs the paired final-loss difference to the reference
    (y, mean with its interval; the reference at 0). One colour and marker per variant, named in the
    legend (no text on the points: close points would overlap)."""
    plt = _plt()
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(10, 4.5))
    markers = "osD^vP*Xh"
    ref = paired[0].reference if paired else None
    if ref is not None and ref in overlap:
        ax.plot([100 * overlap[ref]["exposed_frac"]], [0.0], "k*", ms=11, label=f"{_label(labels, ref)} (reference)")
    for i, p in enumerate(paired):
        o = overlap.get(p.variant)
        if o is None:
            continue
        x = 100 * o["exposed_frac"]
        yerr = [[p.mean - p.ci[0]], [p.ci[1] - p.mean]] if np.all(np.isfinite(p.ci)) else None
        ax.errorbar([x], [p.mean], yerr=yerr, fmt=markers[i % len(markers)], color=f"C{i}", capsize=3, ms=7,
                    label=f"{_label(labels, p.variant)}")
    ax.axhline(0.0, color="black", lw=0.6)
    ax.set(xlabel="exposed all-to-all time (% of all-to-all time, modelled)",
           ylabel=f"final val loss - {ref or 'reference'} (nats)", title="quality vs communication exposure")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    if fig is not None:
        fig.tight_layout()
    return fig if fig is not None else ax.figure


def plot_recovery(records: Sequence, teacher_tokens: Optional[int] = None,
                  labels: Optional[Mapping[str, str]] = None):
    """FCSD recovery: validation loss (teacher dotted), KL to the teacher and top-1 agreement vs the
    distillation tokens (as % of the teacher's pretraining tokens when `teacher_tokens` is given)."""
    plt = _plt()
    fig, ax = plt.subplots(1, 3, figsize=(14, 4))
    teacher_loss = None
    for r in records:
        xs = [e["step"] * r.tokens_per_step for e in r.evals]
        if teacher_tokens:
            xs = [100 * x / teacher_tokens for x in xs]
        lab = (labels or {}).get(r.variant, r.variant)
        ax[0].plot(xs, [e["val_loss"] for e in r.evals], "o-", ms=3, label=lab)
        ax[1].plot(xs, [e["kl"] for e in r.evals], "o-", ms=3, label=lab)
        ax[2].plot(xs, [100 * e["top1"] for e in r.evals], "o-", ms=3, label=lab)
        teacher_loss = r.evals[0]["teacher_loss"] if r.evals else teacher_loss
    if teacher_loss is not None:
        ax[0].axhline(teacher_loss, color="gray", ls=":", label="teacher (standard)")
    xl = "FCSD tokens (% of teacher pretraining)" if teacher_tokens else "FCSD tokens"
    ax[0].set(xlabel=xl, ylabel="validation loss")
    ax[1].set(xlabel=xl, ylabel="KL(teacher || student)", yscale="log")
    ax[2].set(xlabel=xl, ylabel="top-1 agreement with teacher (%)")
    for a in ax:
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle("FCSD recovery (step 0 = converted, before any training)")
    fig.tight_layout()
    return fig


def show(fig, dpi: int = 100) -> None:
    """Display `fig` as a PNG in a notebook and close it. Works whatever the matplotlib backend (some
    library plotters switch to Agg, after which the inline backend no longer renders figures)."""
    # deferred: optional dependency (IPython: notebooks)
    from IPython.display import Image, display

    plt = _plt()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    display(Image(data=buf.getvalue(), format="png"))

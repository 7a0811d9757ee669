"""Figures and tables of the notebooks' experiments (matplotlib; every function returns the figure
or a markdown string so a notebook displays it and a script can save it).

    fig = plot_val_curves(records)                      # ablation.RunRecord list: mean over seeds + min/max band
    md = ablation_table(summarize(records), overlap)    # final losses with spread, exposed all-to-all fraction
    fig = plot_recovery(fcsd_records, teacher_tokens)    # FCSD: val loss / KL / top-1 vs distillation tokens
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence


def _plt():
    import matplotlib

    if matplotlib.get_backend().lower() not in ("module://matplotlib_inline.backend_inline", "inline"):
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_val_curves(records: Sequence, labels: Optional[Mapping[str, str]] = None, ax=None,
                    title: str = "validation loss during pretraining"):
    """One line per variant: mean validation loss over seeds vs step, shaded between min and max."""
    import numpy as np

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
    """Limit the y axis to the range the curves take over the last `frac` of training (the tails differ
    by a few hundredths; the first steps would hide them)."""
    import numpy as np

    tail = []
    for r in records:
        if r.steps:
            cut = r.steps[-1] * (1 - frac)
            tail += [v for s, v in zip(r.steps, r.val_loss) if s >= cut]
    if tail:
        lo, hi = float(np.min(tail)), float(np.max(tail))
        d = max(hi - lo, 1e-3) * pad
        ax.set_ylim(lo - d, hi + d)


def ablation_table(summary: Sequence[dict], overlap: Optional[Mapping[str, dict]] = None,
                   labels: Optional[Mapping[str, str]] = None) -> str:
    """Markdown: variant | final val loss mean ± std [min, max] | vs reference | exposed a2a | step time."""
    head = "| variant | seeds | final val loss (mean ± std) | min – max | vs standard |"
    sep = "|---|---|---|---|---|"
    if overlap:
        head += " exposed all-to-all | hidden / bound | modelled fwd time |"
        sep += "---|---|---|"
    lines = [head, sep]
    for r in summary:
        vs = f"{100 * r['vs_ref']:+.2f}%" if r.get("vs_ref") is not None else "–"
        line = (f"| {(labels or {}).get(r['variant'], r['variant'])} | {r['seeds']} | {r['mean']:.4f} ± {r['std']:.4f} | "
                f"{r['min']:.4f} – {r['max']:.4f} | {vs} |")
        if overlap:
            o = overlap.get(r["variant"])
            if o is None:
                line += " – | – | – |"
            else:
                of_bound = o["hidden_frac"] / o["bound_frac"] if o["bound_frac"] else 1.0
                line += f" {100 * o['exposed_frac']:.1f}% | {100 * of_bound:.0f}% | {o['step_time_us'] / 1000:.3f} ms |"
        lines.append(line)
    return "\n".join(lines)


def plot_quality_vs_speed(summary: Sequence[dict], overlap: Mapping[str, dict],
                          labels: Optional[Mapping[str, str]] = None, ax=None):
    """Scatter: exposed all-to-all fraction (x) vs final validation loss (y, mean with min-max bar)."""
    plt = _plt()
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for r in summary:
        o = overlap.get(r["variant"])
        if o is None:
            continue
        x = 100 * o["exposed_frac"]
        ax.errorbar([x], [r["mean"]], yerr=[[r["mean"] - r["min"]], [r["max"] - r["mean"]]], fmt="o", capsize=3)
        ax.annotate((labels or {}).get(r["variant"], r["variant"]), (x, r["mean"]), fontsize=8,
                    xytext=(4, 4), textcoords="offset points")
    ax.set(xlabel="exposed all-to-all time (% of all-to-all time, modelled)",
           ylabel="final validation loss", title="quality vs communication exposure")
    ax.grid(alpha=0.3)
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
    import io

    from IPython.display import Image, display

    plt = _plt()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    display(Image(data=buf.getvalue(), format="png"))

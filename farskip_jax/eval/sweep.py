"""Conversion sweep (the paper's Figure 3): evaluate one checkpoint with 0..L converted layers, the
first N and the last N, without any training; write a CSV and a plot.

    rows = conversion_sweep(graphdef, st, cfg, batches)         # teacher = same weights, standard
    write_csv(rows, "sweep.csv"); plot_sweep(rows, "sweep.png"); rows == read_csv("sweep.csv")

Each row: direction (first | last), layers (N), val_loss, ppl, teacher_loss, kl (teacher || converted),
top1 (agreement with the teacher). N = 0 is the unconverted model (KL 0, top-1 1.0).
"""

from __future__ import annotations

import csv
import os
import sys
from typing import Optional, Sequence

from farskip_jax.config import Config, FarSkipConfig
from farskip_jax.eval.metrics import evaluate_pair, make_compare_fn

FIELDS = ("direction", "layers", "val_loss", "ppl", "teacher_loss", "kl", "top1")


def conversion_sweep(graphdef, st: dict, cfg: Config, batches: list, *, preset: Optional[str] = None,
                     directions: Sequence[str] = ("first", "last"), counts: Optional[Sequence[int]] = None,
                     stream=sys.stdout) -> list[dict]:
    """Rows of FIELDS for each direction and N in `counts` (default 0..num_layers).

    preset: the connectivity of converted layers (default cfg.farskip.preset, or "farskip" when that
    is "standard"); skip_distance and attn/moe input overrides are taken from cfg.farskip."""
    L = cfg.model.num_layers
    preset = sweep_preset(cfg.farskip, preset)
    counts = list(range(L + 1)) if counts is None else list(counts)
    rows, base = [], None
    for direction in directions:
        for n in counts:
            if n == 0 and base is not None:
                rows.append(dict(base, direction=direction))
                continue
            r = evaluate_set(graphdef, st, cfg, batches, f"{direction}:{n}", preset=preset)
            row = dict(direction=direction, layers=n, **r)
            if n == 0:
                base = row
            rows.append(row)
            if stream is not None:
                print(f"{direction}-{n:<3d} converted ({preset}): val loss {r['val_loss']:.4f} | KL {r['kl']:.5f} | "
                      f"top-1 {100 * r['top1']:.2f}%", file=stream, flush=True)
    return rows


def sweep_preset(fs0: FarSkipConfig, preset: Optional[str] = None) -> str:
    """The connectivity of converted layers in a sweep: `preset`, else fs0's unless that is standard."""
    return preset or (fs0.preset if fs0.preset != "standard" else "farskip")


def evaluate_set(graphdef, st: dict, cfg: Config, batches: list, layers, *, preset: Optional[str] = None,
                 teacher: Optional[dict] = None) -> dict:
    """One conversion without training: `st` with `layers` (a spec such as "last:2" or layer indices)
    converted to `preset` (sweep_preset), attn/moe input overrides and skip_distance from cfg.farskip,
    against `teacher` (default: `st` itself) under standard connectivity.
    Returns dict(val_loss, ppl, teacher_loss, kl, top1)."""
    fs0 = cfg.farskip
    fs = FarSkipConfig(preset=sweep_preset(fs0, preset), attn_input=fs0.attn_input, moe_input=fs0.moe_input,
                       layers=layers if isinstance(layers, str) else tuple(sorted(layers)),
                       skip_distance=fs0.skip_distance)
    r = evaluate_pair(make_compare_fn(graphdef, fs), st, st if teacher is None else teacher, batches)
    return dict(val_loss=r.val_loss, ppl=r.ppl, teacher_loss=r.teacher_loss, kl=r.kl, top1=r.top1)


def write_csv(rows: list[dict], path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r[k] for k in FIELDS})
    return path


def read_csv(path: str) -> list[dict]:
    """Rows written by `write_csv` (direction str, layers int, the rest float)."""
    with open(path, newline="") as f:
        return [{k: (v if k == "direction" else int(v) if k == "layers" else float(v)) for k, v in r.items()}
                for r in csv.DictReader(f)]


def plot_sweep(rows: list[dict], path: str, title: str = "FarSkip conversion without training") -> str:
    """Two panels: validation loss and top-1 agreement vs number of converted layers (first-N, last-N)."""
    # deferred: matplotlib's backend is chosen when a figure is drawn, not at import
    import matplotlib

    matplotlib.use("Agg")
    # deferred: pyplot loads after that backend choice
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for direction, style in (("first", "o-"), ("last", "s--")):
        rs = sorted((r for r in rows if r["direction"] == direction), key=lambda r: r["layers"])
        if not rs:
            continue
        xs = [r["layers"] for r in rs]
        axes[0].plot(xs, [r["val_loss"] for r in rs], style, label="first N" if direction == "first" else "last N")
        axes[1].plot(xs, [100 * r["top1"] for r in rs], style, label="first N" if direction == "first" else "last N")
    if rows:
        axes[0].axhline(rows[0]["teacher_loss"], color="gray", lw=0.8, ls=":", label="unconverted")
    axes[0].set(xlabel="converted layers N", ylabel="validation loss (nats/token)")
    axes[1].set(xlabel="converted layers N", ylabel="top-1 agreement with unconverted (%)")
    for a in axes:
        a.grid(alpha=0.3)
        a.legend()
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

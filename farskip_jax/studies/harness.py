"""What every study shares: where it writes, the model shapes it compiles, a cache of compiled
programs, results kept as JSON by key, the grid of points, markdown tables, plots, the TBO verdicts
and the one `error:` line of a bad option.

    cache = CompileCache("/tmp/farskip_x")                 # compiled schedules, gzip'd pickles by key
    c = cache.get_or_compile("dsv3_6l|ep8|train", lambda: compile_one(...))
    store = ResultStore(os.path.join(out, "results.json"))  # timed entries by key: a re-run re-tables
    for p in grid(batch=[1, 2], ep=[8, 16]): ...           # {"batch": 1, "ep": 8}, ... (last axis fastest)
    lines = md_header(["row", "ms"]) + [md_row(["standard", "1.00"])]
    with figure(path, 1, 2, figsize=(12, 4.4)) as (fig, axes): axes[0].plot(...)
"""

from __future__ import annotations

import contextlib
import gzip
import itertools
import json
import os
import pickle
import sys
from typing import Callable, Iterator, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the model shapes the modelled studies compile (config path under the repository, extra overrides)
MODELS = {"dsv3_6l": "configs/deepseek_v3_6l.yaml", "dsv3_6l_gqa": "configs/deepseek_v3_6l.yaml",
          "dsv2_lite": "configs/deepseek_v2_lite.yaml"}
# FoE needs GQA attention and no group-limited routing (model/foe.check_foe): the `_gqa` model is
# DeepSeek-V3-6L with a GQA attention of the same 128 query heads (16 kv heads of 128) and plain
# top-8 routing, on which every variant compiles
MODEL_OVERRIDES = {"dsv3_6l_gqa": ["model.attention=gqa", "model.num_kv_heads=16", "model.head_dim=128",
                                   "moe.n_group=1", "moe.topk_group=1"]}


def results_dir(study: str) -> str:
    """The folder of the repository's recorded results a study writes by default (a checkout only)."""
    return os.path.join(REPO, "benchmarks", "results", study)


def model_config_path(model: str) -> str:
    """The config file of a study model (MODELS)."""
    return os.path.join(REPO, MODELS[model])


def log(message: str) -> None:
    """A study's progress line (stderr, so stdout is only the table)."""
    print(message, file=sys.stderr, flush=True)


def fail(message: str) -> int:
    """The one `error:` line of a bad option; returns the CLI's exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    return 2


def contention_error(contention: Optional[float]) -> Optional[str]:
    """Why --contention is refused (None: accepted)."""
    if contention is not None and not 0.0 < contention <= 1.0:
        return (f"--contention {contention} must be in (0, 1]: the fraction of its speed compute keeps while a "
                "collective is in flight (1.0 = no contention)")
    return None


def cache_file_name(key: str) -> str:
    """The file a key's compiled program is kept in ('|' -> '_', '=' -> '-')."""
    return key.replace("|", "_").replace("=", "-") + ".pkl.gz"


class CompileCache:
    """Compiled programs (any picklable value) by key, one gzip'd pickle each under `folder`, so a
    re-run re-times them without compiling."""

    def __init__(self, folder: str):
        self.folder = folder

    def path(self, key: str) -> str:
        return os.path.join(self.folder, cache_file_name(key))

    def get(self, key: str):
        """The kept value of `key`, or None."""
        p = self.path(key)
        if not os.path.exists(p):
            return None
        with gzip.open(p, "rb") as f:
            return pickle.load(f)

    def put(self, key: str, value) -> None:
        os.makedirs(self.folder, exist_ok=True)
        with gzip.open(self.path(key), "wb") as f:
            pickle.dump(value, f)

    def get_or_compile(self, key: str, compile_fn: Callable[[], object]):
        """The kept value of `key`, else compile_fn()'s (kept)."""
        value = self.get(key)
        if value is None:
            value = compile_fn()
            self.put(key, value)
        return value


class ResultStore(dict):
    """A JSON object of results by key, read from `path` when it exists; save() writes it back
    (indent 1, keys sorted, so a re-run's diff is the entries that changed)."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        if os.path.exists(path):
            with open(path) as f:
                self.update(json.load(f))

    def save(self) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "w") as f:
            json.dump(self, f, indent=1, sort_keys=True)


def write_json(path: str, value) -> None:
    """`value` as indented JSON (key order kept)."""
    with open(path, "w") as f:
        json.dump(value, f, indent=1)


def write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def grid(**axes: Sequence) -> Iterator[dict]:
    """Every point of the named axes, {axis: value}, the last axis varying fastest."""
    names = list(axes)
    for values in itertools.product(*(axes[n] for n in names)):
        yield dict(zip(names, values))


def md_row(cells: Sequence) -> str:
    """One markdown table row (an empty cell is written `| |`)."""
    return "|" + "|".join(f" {c} " if str(c) else " " for c in cells) + "|"


def md_header(columns: Sequence[str]) -> list[str]:
    """A markdown table's header and rule lines."""
    return [md_row(columns), "|" + "---|" * len(columns)]


@contextlib.contextmanager
def figure(path: str, *subplot_args, dpi: int = 110, **subplot_kw):
    """plt.subplots(*subplot_args, **subplot_kw) on the Agg backend, yielding (fig, axes); on exit the
    figure is laid out, saved to `path` and closed."""
    # deferred: matplotlib's backend is chosen when a figure is drawn, not at import
    import matplotlib

    matplotlib.use("Agg")
    # deferred: pyplot loads after that backend choice
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(*subplot_args, **subplot_kw)
    try:
        yield fig, axes
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)


def spread_range(reference: dict, variant: dict, central: float) -> dict:
    """{range: [low, high], dominant: constant} of a speedup over the fitted constants' spread:
    `reference` and `variant` {'constant:end': time}, speedup = reference / variant per constant set,
    `central` (the fitted constants' speedup) inside the range; dominant = the constant whose two ends
    move the speedup most. {} when either side has no spread."""
    if not reference or not variant:
        return {}
    vals = {k: reference[k] / variant[k] for k in reference if k in variant}
    swing: dict = {}
    for k, v in vals.items():
        swing.setdefault(k.split(":")[0], []).append(v)
    dom = max(swing, key=lambda n: max(swing[n] + [central]) - min(swing[n] + [central]))
    return {"range": [min(list(vals.values()) + [central]), max(list(vals.values()) + [central])], "dominant": dom}


def tbo_verdicts(farskip_ms: Optional[float], tbo_ms: Optional[float], both_ms: Optional[float], share: float,
                 share_text: str) -> list[str]:
    """The plain statements of a FarSkip vs two-batch-overlap point: which of the two is faster, and
    whether FarSkip + TBO is at least the better alone (the goal applies where communication is >= 20%
    of the no-overlap time; `share_text` names that share, e.g. 'communication ... of the no-overlap step')."""
    out = []
    if farskip_ms and tbo_ms:
        win = "FarSkip" if farskip_ms < tbo_ms else "TBO"
        out.append(f"{win} is faster: FarSkip {farskip_ms:.2f} ms vs standard + TBO {tbo_ms:.2f} ms "
                   f"({tbo_ms / farskip_ms:.3f}x FarSkip over TBO)")
    if farskip_ms and tbo_ms and both_ms:
        best = min(farskip_ms, tbo_ms)
        ok = both_ms <= best * (1 + 1e-9)
        out.append(f"{'adds up' if ok else 'does NOT add up'}: FarSkip + TBO {both_ms:.2f} ms vs the better "
                   f"alone {best:.2f} ms ({share_text.format(pct=f'{100 * share:.1f}%')}; the goal applies "
                   f"{'here' if share >= 0.2 else 'only at >= 20%'})")
    return out

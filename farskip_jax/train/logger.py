"""Run logging: a live progress line, JSONL metrics, TensorBoard event files (tensorboardX).

Only process 0 writes. metrics.jsonl has one JSON object per line: {"kind": "train"|"eval"|"event",
"step": int, ...}; the progress line shows step, loss, tokens/s, MFU and ETA.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Optional

from tensorboardX import SummaryWriter


def format_eta(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def config_summary(cfg, run_dir: str) -> str:
    """Three lines on what runs (the whole resolved config is <run_dir>/config.yaml)."""
    m, e, f, t = cfg.model, cfg.moe, cfg.farskip, cfg.train
    moe = (f"{e.num_experts} experts top-{e.top_k}" + (f" + {e.num_shared_experts} shared" if e.num_shared_experts else "")
           + f", dispatch {cfg.runtime.dispatch}") if e.num_experts else "dense"
    conn = f.preset + ("" if f.preset == "standard" else f" on layers {f.layers}")
    return (f"config: {m.num_layers} layers, d_model {m.d_model}, vocab {m.vocab_size}, {m.attention} attention, {moe}; "
            f"connectivity {conn}; compute {cfg.runtime.compute_dtype}, remat {cfg.runtime.remat}\n"
            f"        {t.mode}: {t.steps} steps of {t.batch_size} x {t.seq_len} tokens, lr {t.lr:g}, data {cfg.data.source}; "
            f"mesh data {cfg.mesh.data} x expert {cfg.mesh.expert}\n"
            f"        the whole resolved config: {os.path.join(run_dir, 'config.yaml')}")


def drop_records_after(run_dir: str, step: int) -> int:
    """Remove the metrics.jsonl records of steps after `step` (a resumed run logs them again); returns
    how many were dropped. Lines that do not parse are kept."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return 0
    keep, dropped = [], 0
    with open(path, errors="replace") as f:
        for line in f:
            try:
                late = int(json.loads(line).get("step", -1)) > step
            except (ValueError, AttributeError, TypeError):
                late = False
            if late:
                dropped += 1
            else:
                keep.append(line)
    if dropped:
        with open(path + ".tmp", "w") as f:
            f.writelines(keep)
        os.replace(path + ".tmp", path)
    return dropped


class RunLogger:
    def __init__(self, run_dir: str, *, tensorboard: bool = True, enabled: bool = True, stream=None):
        self.enabled = enabled
        self.stream = stream or sys.stdout
        self._jsonl = None
        self._tb = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self._jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a", buffering=1)
        if tensorboard:
            self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))

    def print(self, msg: str) -> None:
        if self.enabled:
            print(msg, file=self.stream, flush=True)

    def write(self, kind: str, step: int, values: dict) -> None:
        if not self.enabled:
            return
        rec = {"kind": kind, "step": int(step), "time": round(time.time(), 3)}
        rec.update({k: _jsonable(v) for k, v in values.items()})
        self._jsonl.write(json.dumps(rec) + "\n")
        if self._tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v)):
                    self._tb.add_scalar(f"{kind}/{k}", float(v), int(step))

    def progress(self, step: int, total: int, m: dict, eta_s: float, extra: tuple = ()) -> None:
        """The progress line; `extra`: more metrics of `m` to show after the loss."""
        mfu = f" mfu {100 * m['mfu']:.1f}%" if m.get("mfu") is not None else ""
        more = "".join(f" | {k} {m[k]:.5f}" for k in extra if k in m)
        self.print(f"step {step:>6d}/{total} | loss {m['loss']:.4f}{more} | gnorm {m['grad_norm']:.3f} | lr {m['lr']:.2e} | "
                   f"{m['tokens_per_s']:,.0f} tok/s{mfu}{data_wait(m)} | load {m['load_min']:.2f}-{m['load_max']:.2f} | "
                   f"eta {format_eta(eta_s)}")

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def data_wait(m: dict) -> str:
    """' | data 3 ms' from a step record's data_wait_s (the time the step waited for its batch)."""
    w = m.get("data_wait_s")
    return f" | data {1e3 * w:.0f} ms" if w is not None else ""


def _jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def read_metrics(run_dir: str, kind: Optional[str] = "train") -> list[dict]:
    """Records of metrics.jsonl (of one kind, or all with kind=None)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    return [r for r in recs if kind is None or r["kind"] == kind]

"""Model FLOPs per token (for MFU) and a measured matmul peak of the local device.

On a CPU the peak MFU divides by is measured once per machine (cpu_matmul_peak: 2 s of matmuls, kept in
<cache>/matmul_peak.json under the CPU model, its cores, the device count, dtype and jax version), so
MFU compares across runs on one machine (a peak measured at every start would follow the machine's
load). train.peak_flops overrides it.

MFU = achieved model FLOPs/s / (peak FLOPs/s per device x devices). Model FLOPs count only useful
work: 6 x (active matmul parameters) per trained token (forward 2, backward 4) plus the attention
score/value products 12 x layers x heads x head_dim x seq_len (PaLM appendix B convention). Routed
experts count top_k experts per token, whatever the backend really computes.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp

from farskip_jax.config import Config


def attention_params(cfg: Config) -> int:
    """Projection weights of one attention layer (GQA, or MLA with its low-rank q/kv)."""
    m = cfg.model
    if m.attention == "mla":
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = (m.d_model * m.q_lora_rank + m.q_lora_rank * m.num_heads * qk) if m.q_lora_rank else m.d_model * m.num_heads * qk
        kv = m.d_model * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * m.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
        return q + kv + m.num_heads * m.v_head_dim * m.d_model
    hd = m.resolved_head_dim
    return m.d_model * hd * (m.num_heads + 2 * m.num_kv_heads) + m.num_heads * hd * m.d_model


def active_matmul_params(cfg: Config) -> int:
    """Matmul parameters one token passes through (embedding lookup excluded, lm head included)."""
    m, e = cfg.model, cfg.moe
    attn = attention_params(cfg)
    total = m.d_model * m.vocab_size
    for i in range(m.num_layers):
        total += attn
        if e.num_experts and m.is_moe_layer(i):
            total += m.d_model * e.num_experts + e.top_k * 3 * m.d_model * e.expert_hidden
            if e.num_shared_experts > 0:
                total += 3 * m.d_model * e.resolved_shared_hidden
        else:
            total += 3 * m.d_model * m.mlp_hidden
    return total


def train_flops_per_token(cfg: Config, seq_len: int) -> float:
    m = cfg.model
    return 6.0 * active_matmul_params(cfg) + 12.0 * m.num_layers * m.num_heads * m.resolved_head_dim * seq_len


def total_params(cfg: Config) -> int:
    """All parameters (every expert), for reporting model size."""
    m, e = cfg.model, cfg.moe
    attn = attention_params(cfg)
    total = m.d_model * m.vocab_size * (1 if m.tie_embeddings else 2)
    for i in range(m.num_layers):
        total += attn + 2 * m.d_model
        if e.num_experts and m.is_moe_layer(i):
            total += m.d_model * e.num_experts + e.num_experts * 3 * m.d_model * e.expert_hidden
            if e.num_shared_experts > 0:
                total += 3 * m.d_model * e.resolved_shared_hidden
        else:
            total += 3 * m.d_model * m.mlp_hidden
    return total


def measure_matmul_peak(dtype=jnp.float32, n: int = 1024, seconds: float = 1.0, device=None) -> float:
    """Best observed FLOPs/s of an [n, n] @ [n, n] matmul chain on one device (a practical peak)."""
    device = device or jax.local_devices()[0]
    a = jax.device_put(jnp.ones((n, n), dtype) / n, device)
    reps = 8

    @jax.jit
    def chain(x):
        for _ in range(reps):
            x = x @ a
        return x

    chain(a).block_until_ready()
    best, t_end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        chain(a).block_until_ready()
        best = max(best, reps * 2.0 * n**3 / (time.perf_counter() - t0))
    return best


PEAK_FILE = "matmul_peak.json"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key(dtype) -> str:
    """What a measured peak belongs to: CPU model, usable cores, local devices, dtype, jax version."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"{_cpu_model()} | {cores} cores | {jax.local_device_count()} devices | {jnp.dtype(dtype).name} | "
            f"jax {jax.__version__}")


def cpu_matmul_peak(dtype=jnp.float32, cache_dir: Optional[str] = None, seconds: float = 2.0) -> tuple[float, str]:
    """(FLOPs/s per device, where the figure comes from): this machine's matmul peak, measured once and
    kept in <cache_dir>/matmul_peak.json (default ~/.cache/farskip_jax). A file that is not such a
    JSON object is left alone (the peak is measured for this run only)."""
    path = Path(cache_dir or Path.home() / ".cache" / "farskip_jax") / PEAK_FILE
    key = machine_key(dtype)
    table: Optional[dict] = {}
    if path.exists():
        try:
            table = json.loads(path.read_text())
            if not isinstance(table, dict):
                table = None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            table = None
    entry = (table or {}).get(key)
    if isinstance(entry, dict) and isinstance(entry.get("flops"), (int, float)) and entry["flops"] > 0:
        return float(entry["flops"]), f"measured once on this machine on {entry.get('date', '?')} ({path}; delete it " \
                                      "to measure again)"
    peak = measure_matmul_peak(dtype, seconds=seconds)
    if table is None:
        return peak, f"measured now; {path} is not a peak table, so the figure is not kept"
    table[key] = {"flops": peak, "date": time.strftime("%Y-%m-%d %H:%M"), "seconds": seconds}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1))
        os.replace(tmp, path)
        where = f"measured now and kept for later runs on this machine in {path}"
    except OSError as e:
        where = f"measured now; not kept ({path}: {e.strerror or e})"
    return peak, where

"""The compiled programs the hold-out table re-times: one train step (one micro-batch) per setting,
compiled deviceless once and kept as a schedule file (analysis/schedule_store.py).

    spec = PROGRAMS["dsv3_6l_ep32_b1"]
    path = compile_program_file(spec, "standard", cache_dir)     # minutes on 2 CPU cores
    schedule, meta = load_schedule_file(path)

Every program: the train step of analysis/programs.py, compiled for H200 compile-only GPUs (8 per
host; EP 16 / 32 span 2 / 4 hosts) with the cuda_hopper preset and the latency-hiding scheduler,
the target's memory set to MI325X's 256 GB, runtime.dispatch=all_to_all at capacity factor 1.0 (the
useful bytes at balance), no remat, the routed experts traced as a grouped GEMM's cost proxy
(programs.grouped_gemm_proxy, the one expert-compute proxy of every calibrated row) and the
attention as the model's plain core (priced by the cost model as the kernel the setting ran).
DeepSeek-V2-Lite is compiled unrolled (as Megatron runs its layers) at 4 and 6 layers and
extrapolated linearly to 27 (the rule of compare_overlap / inference_report: exact when the layers
between are the model's repeating MoE layer); DeepSeek-V3-6L unrolled at its 6 layers.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Optional

from farskip_jax.analysis.deviceless import LHS_FLAGS, preset_options
from farskip_jax.analysis.overlap import run_overlap
from farskip_jax.analysis.schedule_store import save_schedule
from farskip_jax.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VARIANTS = ("standard", "farskip")
MEMORY_GB = 256.0  # MI325X: what XLA's scheduler may hold live (it stops overlapping past it)


@dataclass(frozen=True)
class ProgramSpec:
    name: str
    config: str  # path under the repository root
    ep: int
    batch_per_gpu: int  # sequences per GPU in one micro-batch
    seq: int
    layers: tuple[int, ...]  # compiled depths (two: extrapolated linearly to full_layers)
    full_layers: int
    scan: bool
    overrides: tuple[str, ...] = field(default_factory=tuple)
    hardware: str = "mi325x"  # the cost model's hardware (the paper's training runs: MI325X nodes)

    def key(self, variant: str, layers: int) -> str:
        return f"{self.name}_L{layers}_{variant}"


def _spec(name, config, ep, b, seq, layers, full, scan, extra=()):
    return ProgramSpec(name, config, ep, b, seq, tuple(layers), full, scan, tuple(extra))


PROGRAMS = {
    s.name: s for s in (
        _spec("dsv3_6l_ep8_b1", "configs/deepseek_v3_6l.yaml", 8, 1, 4096, (6,), 6, False),
        _spec("dsv3_6l_ep16_b1", "configs/deepseek_v3_6l.yaml", 16, 1, 4096, (6,), 6, False),
        _spec("dsv3_6l_ep32_b1", "configs/deepseek_v3_6l.yaml", 32, 1, 4096, (6,), 6, False),
        _spec("dsv2_lite_ep8_b4", "configs/deepseek_v2_lite.yaml", 8, 4, 4096, (4, 6), 27, False),
    )
}


def overrides_of(spec: ProgramSpec, layers: int, variant: str) -> list[str]:
    return [f"mesh.data=1", f"mesh.expert={spec.ep}", "runtime.dispatch=all_to_all", "runtime.capacity_factor=1.0",
            f"model.max_seq_len={max(spec.seq, 4096)}", "runtime.remat=none", "runtime.gmm=auto",
            "runtime.attention_impl=auto", f"runtime.scan_layers={'true' if spec.scan else 'false'}",
            f"model.num_layers={layers}", f"farskip.preset={variant}", *spec.overrides]


def compile_program_file(spec: ProgramSpec, variant: str, layers: int, cache_dir: str, log=None) -> str:
    """Compile (spec, variant, depth) deviceless and write its schedule to cache_dir; returns the path.
    An existing file is kept (delete it to recompile)."""
    path = os.path.join(cache_dir, spec.key(variant, layers) + ".json.gz")
    if os.path.exists(path):
        return path
    os.makedirs(cache_dir, exist_ok=True)
    cfg = load_config(os.path.join(ROOT, spec.config), overrides_of(spec, layers, variant))
    flags = dict(preset_options("cuda_hopper"), **LHS_FLAGS)
    t0 = time.time()
    (r,) = run_overlap(cfg, (variant,), ("train",), batch=spec.batch_per_gpu * spec.ep, seq=spec.seq, target="h200",
                       num_devices=spec.ep, flags=flags, hardware=None, log=log, gpus_per_node=min(8, spec.ep),
                       memory_gb=MEMORY_GB, grouped_gemm=True, cfg_for=lambda p, c: c, probe_latency=False)
    meta = {"program": spec.name, "variant": variant, "layers": layers, "ep": spec.ep,
            "batch_per_gpu": spec.batch_per_gpu, "seq": spec.seq, "layout": r.layout,
            "node_of": [int(d.process_index) for d in r.mesh.devices.flat], "compile_s": time.time() - t0,
            "xla_step_us": r.report.step_time, "scheduler_peak_gib": r.report.peak_memory / 2**30,
            "overrides": overrides_of(spec, layers, variant), "date": time.strftime("%Y-%m-%d")}
    save_schedule(r.schedule, path, meta)
    return path


def compile_all(cache_dir: str, names: Optional[list[str]] = None, log=None) -> list[str]:
    """Every (program, variant, depth) of `names` (default all) not yet in cache_dir."""
    out = []
    for name in names or list(PROGRAMS):
        spec = PROGRAMS[name]
        for variant in VARIANTS:
            for layers in spec.layers:
                out.append(compile_program_file(spec, variant, layers, cache_dir, log))
                if log:
                    log(f"[calibration] {spec.key(variant, layers)} -> {out[-1]}")
    return out


if __name__ == "__main__":  # compile the missing programs (the calibration CLI does this with --compile)
    import sys

    names = sys.argv[2:] or None
    compile_all(sys.argv[1], names, log=lambda m: print(m, file=sys.stderr, flush=True))

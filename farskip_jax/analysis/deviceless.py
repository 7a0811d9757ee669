"""Compile a JAX program for a GPU topology with no GPU present, and read back XLA's schedule.

    devices = gpu_devices("h100_sxm", 8)          # compile-only devices (jax-cuda12-plugin/pjrt)
    mesh = jax.sharding.Mesh(np.array(devices).reshape(...), axis_names)
    prog = compile_deviceless(jax.jit(fn), *abstract_args, flags=LHS_FLAGS)
    prog.hlo_text          # the scheduled module (compiled.as_text())
    prog.schedule          # hlo.Schedule with XLA's cost-model start/end times per instruction

Target configs are GpuTargetConfigProto text files in `specs/` (data copied from OpenXLA's
xla/backends/gpu/target_config/specs/) or any path to such a file. Works with
`JAX_PLATFORMS=cpu`: the topology API creates compile-only devices, the rest of JAX stays on CPU.
"""

from __future__ import annotations

import glob
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from farskip_jax.analysis.hlo import Schedule, load_schedule
from farskip_jax.errors import BackendError
from farskip_jax.analysis.cost_model import collective_payload, collective_time_us, HARDWARE
from farskip_jax.parallel.xla_flags import preset_flags

SPECS_DIR = Path(__file__).parent / "specs"
TARGETS = {"h100_sxm": "cuda", "h200": "cuda"}

# Flags every overlap compile uses unless the caller overrides them (GPU debug options):
# - the latency-hiding scheduler (what the report is about);
# - no CUB radix sort: its custom call asks the CUDA runtime for scratch sizes, which a compile with
#   no CUDA libraries cannot answer (large sorts = the MoE token sort); XLA's own sort is used instead;
# - no Triton GEMM fusions: without autotuning (no GPU) XLA picks tiny default tiles and its cost model
#   then rates large GEMMs such as the LM head far below roofline; cuBLAS custom calls are modelled
#   near roofline.
LHS_FLAGS: dict[str, Any] = {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_gpu_enable_cub_radix_sort": False,
    "xla_gpu_enable_triton_gemm": False,
}


def preset_options(name: str) -> dict[str, Any]:
    """A parallel/xla_flags.py preset as compile options (`{flag: value}`), for compiling with it
    without touching the process-wide XLA_FLAGS."""
    out: dict[str, Any] = {}
    for arg in preset_flags(name):
        k, _, v = arg.lstrip("-").partition("=")
        if v == "":
            out[k] = ""
            continue
        low = v.lower()
        out[k] = (low == "true") if low in ("true", "false") else (int(v) if v.lstrip("-").isdigit() else v)
    return out


def target_config_text(target: str, memory_gb: Optional[float] = None) -> str:
    """GpuTargetConfigProto text of a known target (h100_sxm, h200) or of a .txtpb path; with
    `memory_gb` its device_memory_size replaced (e.g. 256 for MI325X-sized HBM under an H200 spec:
    the latency-hiding scheduler stops overlapping when a schedule exceeds its memory limit)."""
    path = Path(target)
    if not path.exists():
        path = SPECS_DIR / f"{target}.txtpb"
    if not path.exists():
        known = sorted(p.stem for p in SPECS_DIR.glob("*.txtpb"))
        raise BackendError(f"unknown GPU target {target!r}; use one of {known} or a path to a "
                           "GpuTargetConfigProto text file")
    text = path.read_text()
    if memory_gb is not None:
        if "device_memory_size:" not in text:
            raise BackendError(f"target {target!r} has no device_memory_size to replace; drop memory_gb")
        text = re.sub(r"device_memory_size: \d+", f"device_memory_size: {int(memory_gb * 2**30)}", text)
    return text


def gpu_devices(target: str = "h100_sxm", num_devices: int = 8, platform: Optional[str] = None,
                gpus_per_node: Optional[int] = None, memory_gb: Optional[float] = None) -> list:
    """Compile-only devices of a GPU topology with `num_devices` GPUs: one host (default), or
    num_devices / gpus_per_node hosts of gpus_per_node GPUs each (topology "1 x nodes x gpus";
    jax 0.10.2 accepts e.g. 1x2x8, 1x4x8, 1x4x4, 1x8x4). Device ids run host-major: device i is on
    host i // gpus_per_node (its `process_index`)."""
    platform = platform or TARGETS.get(target, "cuda")
    text = target_config_text(target, memory_gb)
    per = gpus_per_node or num_devices
    if per < 1 or num_devices % per:
        raise BackendError(f"{num_devices} GPUs cannot be split into nodes of gpus_per_node={per}; choose a "
                           f"divisor of {num_devices} (e.g. 8)")
    try:
        topo = topologies.get_topology_desc(platform=platform, target_config=text,
                                            topology=f"1x{num_devices // per}x{per}")
    except Exception as e:  # plugin missing or proto not understood by this jaxlib
        raise BackendError(
            f"cannot create a deviceless {platform} topology for target {target!r}: {e}. Install the "
            "compile-only plugin wheels matching jax (pip install jax-cuda12-plugin jax-cuda12-pjrt)") from e
    return list(topo.devices)


@dataclass
class CompiledProgram:
    hlo_text: str
    schedule: Schedule
    flags: dict


def compile_deviceless(jitted, *args, flags: Optional[dict] = None, keep_dump: Optional[str] = None,
                       **kwargs) -> CompiledProgram:
    """Lower `jitted(*args, **kwargs)` (ShapeDtypeStructs with shardings on GPU devices), compile it
    with the latency-hiding scheduler dump on, and return the scheduled HLO + XLA's schedule."""
    opts = dict(LHS_FLAGS)
    opts.update(flags or {})
    with tempfile.TemporaryDirectory(prefix="farskip_overlap_") as tmp:
        dump = keep_dump or tmp
        os.makedirs(dump, exist_ok=True)
        opts_c = dict(opts, xla_dump_to=dump, xla_dump_latency_hiding_schedule=True)
        compiled = jitted.lower(*args, **kwargs).compile(compiler_options=opts_c)
        files = sorted(glob.glob(os.path.join(dump, "*.schedule.txt")), key=os.path.getmtime)
        if not files:
            raise BackendError("XLA wrote no latency-hiding schedule; is the latency-hiding scheduler on "
                               "(xla_gpu_enable_latency_hiding_scheduler=true) and the target a GPU?")
        schedule = load_schedule(Path(files[-1]).read_text())
    return CompiledProgram(hlo_text=compiled.as_text(), schedule=schedule, flags=opts)


_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "S32": "int32", "U32": "uint32",
           "S8": "int8", "U8": "uint8", "F64": "float64", "S64": "int64"}


def probe_all_to_all_latency(element_type: str, dims: tuple, split_dim: int, group_size: int, devices: list,
                             flags: Optional[dict] = None) -> Optional[float]:
    """XLA's modelled latency (us) of one all-to-all of a per-device operand [dims] over groups of
    `group_size` devices: compile it alone and read the start-to-done gap of its schedule."""
    if element_type not in _DTYPES or not dims or group_size < 2 or len(devices) % group_size:
        return None
    if dims[split_dim] % group_size:
        return None
    mesh = Mesh(np.array(devices).reshape(len(devices) // group_size, group_size), ("rest", "group"))
    spec = P(("rest", "group"))
    glob = (dims[0] * len(devices),) + tuple(dims[1:])

    def body(x):
        return jax.lax.all_to_all(x, "group", split_dim, split_dim, tiled=True)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    arg = jax.ShapeDtypeStruct(glob, getattr(jnp, _DTYPES[element_type]), sharding=NamedSharding(mesh, spec))
    sched = compile_deviceless(fn, arg, flags=flags).schedule
    gaps = [p.done.start - p.start.end for p in sched.pairs if p.collective == "all-to-all"]
    return max(gaps) if gaps else None


def collective_durations(schedule: Schedule, devices: list, flags: Optional[dict] = None,
                         fallback_hardware: str = "h100_sxm") -> list[float]:
    """Modelled duration of every collective of `schedule.pairs`: XLA's latency for all-to-alls
    (probed once per distinct shape); anything else (ragged all-to-alls, which XLA's estimator does
    not cover, all-reduces, all-gathers, ...) the two-stream model's transfer time on
    `fallback_hardware` (cost_model.collective_time_us of cost_model.collective_payload; not the
    start-to-done window, which holds whatever queued or waited in it); the window when an
    all-to-all's probe fails."""
    cache: dict = {}
    out = []
    for p in schedule.pairs:
        window = max(p.done.start - p.start.end, 0.0)
        lat = None
        if p.collective == "all-to-all" and len(p.operand_shapes) == 1 and len(p.dims) == 1:
            et, dims = p.operand_shapes[0]
            key = (et, dims, p.dims[0], p.group_size or len(devices))
            if key not in cache:
                cache[key] = probe_all_to_all_latency(et, dims, p.dims[0], key[3], devices, flags)
            lat = cache[key]
        elif p.collective != "all-to-all" and p.start.operands:
            payload = collective_payload(schedule, p, len(devices))
            lat = collective_time_us(p.collective, payload, p.group_size or len(devices), HARDWARE[fallback_hardware])
        out.append(lat if lat is not None else window)
    return out

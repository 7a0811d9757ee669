"""Memory plan: what one GPU holds during a train step (pretraining or FCSD), and what fits where.

    python -m farskip_jax.analysis.memory --config configs/deepseek_v2_lite.yaml --mode pretrain \
        --remat full,minimal --fsdp 1 --seq 4096 --out benchmarks/results/memory/dsv2_lite.json

For every (mode, remat policy, FSDP size) it compiles the REAL step deviceless for 8 x fsdp GPUs
(nodes of 8, experts over `mesh.expert`, FSDP = one more node per step): train/step.py's
make_train_step with AdamW, or fcsd/distill.py's make_distill_step with a frozen teacher in
`distill.teacher_dtype` + the student + AdamW, jitted as the trainer jits it (donated state, output
shardings = input shardings). `compiled.memory_analysis()` gives per device: arguments (parameters
+ optimizer state + teacher + batch), outputs, temporaries, aliased bytes (donated state reused for
the new state) and peak = arguments + outputs + temporaries - aliased. The arguments are also
counted analytically from the shardings (`state_bytes`): the two must agree.

Depth: by default the step is compiled at the config's own depth whenever `runtime.scan_layers` is true
(the real configs: a full-depth scanned step compiles in seconds to a minute), at two per-device
batches (`--batches 1,2`); nothing is extrapolated in depth. `--depths A,B` (two depths, e.g. 3,5)
asks for an extrapolation, and is the default for a Python loop over layers
(`runtime.scan_layers=false`: ~30 min per full-depth compile on 2 shared cores; default depths 2,3).
An extrapolated plan says how far it was checked: the validation compile of `--validate-depth`, or
"not checked" when there was none.
Either way the temporaries are modelled (TempModel) as the larger of two phases: the optimizer update
(the gradients, + a second copy of params and optimizer state where the update is not in place: exact
from the shardings) and the activations (gradients + c0 + B x per-sequence bytes, fitted where that
phase dominates). `--validate-depth` / `--validate-batch` compare the model with one more compiled
point. A plain bilinear fit in (depth, batch) failed that check (docs/memory.md).

Below the plan it prints the largest buffers live at the peak of the deepest, largest-batch compile
(`--top N`): shape, opcode and the scope that made them (op_name metadata: jvp = forward,
transpose(jvp) = backward), from XLA's buffer live ranges (analysis/peak_buffers.py).

"Fits" = peak <= usable_fraction x device memory. The default fraction 0.75 is both JAX's default
GPU preallocation (XLA_PYTHON_CLIENT_MEM_FRACTION=.75) and about what XLA's GPU compiler allows a
program before it rematerializes on its own (80% x 95% slop of the device memory, minus I/O;
docs/overlap.md). Programs are compiled for an H200 target with 1 TiB memory so
that XLA never rematerializes behind the plan's back.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from farskip_jax.analysis import peak_buffers as pb
from farskip_jax.analysis.cli_checks import check_out_file, int_list, read_json_object
from farskip_jax.analysis.deviceless import gpu_devices, LHS_FLAGS, preset_options
from farskip_jax.config import load_config, replace
from farskip_jax.errors import ConfigError, FarSkipError
from farskip_jax.fcsd.distill import make_distill_step
from farskip_jax.loading.optimizer import make_optimizer
from farskip_jax.model.layers import dtype_of
from farskip_jax.parallel.mesh import batch_shards, make_mesh
from farskip_jax.parallel.sharding import batch_sharding
from farskip_jax.train.step import abstract_train_state, make_train_step

GiB = 2**30

# Device memory per GPU (bytes). H100/H200: XLA's own target specs (analysis/specs/*.txtpb:
# device_memory_size); MI300X / MI325X: 8 HBM3 stacks of 24 GiB / 8 HBM3E stacks of 32 GiB.
DEVICE_MEMORY = {
    "mi300x": 192 * GiB,
    "mi325x": 256 * GiB,
    "h100_sxm": 84942979072,
    "h200": 151397597184,
}
USABLE_FRACTION = 0.75
PEAK_BUFFERS = 24  # largest non-argument buffers at the peak kept per compiled point (printed: --top)
REMAT_ORDER = ("none", "dots", "minimal", "full")  # least to most recomputation
MODES = ("pretrain", "fcsd")
GPUS_PER_NODE = 8


@dataclasses.dataclass
class Point:
    """memory_analysis() of one compiled step (bytes per device)."""

    mode: str
    remat: str
    fsdp: int
    layers: int
    batch: int  # sequences per device
    seq: int
    argument: int
    output: int
    temp: int
    alias: int
    peak: int
    analytic_argument: int
    compile_s: float
    # the non-finite guard wrote the update into the donated state (a select: GPU/TPU targets) rather
    # than building the new state among the temporaries (a cond: CPU targets)
    inplace_update: Optional[bool] = None
    # the values live at the program's peak (analysis/peak_buffers.py: summary)
    peak_buffers: Optional[dict] = None

    def key(self) -> str:
        return point_key(self.mode, self.remat, self.fsdp, self.layers, self.batch, self.seq)


def point_key(mode, remat, fsdp, layers, batch, seq) -> str:
    return f"{mode}|{remat}|fsdp{fsdp}|L{layers}|b{batch}|s{seq}"


def cut_depth(cfg, layers: int):
    """cfg with its first `layers` layers (layer lists such as nope_layers / chunked_layers / moe_layers
    restricted to them, first_k_dense kept below the depth)."""
    m = cfg.model
    ch: dict = {"model.num_layers": layers, "model.first_k_dense": min(m.first_k_dense, layers - 1 if layers > 1 else 0)}
    ch["model.nope_layers"] = tuple(i for i in m.nope_layers if i < layers)
    if m.chunked_layers is not None:
        ch["model.chunked_layers"] = tuple(i for i in m.chunked_layers if i < layers)
    if m.moe_layers is not None:
        ch["model.moe_layers"] = tuple(i for i in m.moe_layers if i < layers)
    return replace(cfg, **ch)


def shard_bytes(x) -> int:
    """Bytes of one device's shard of a ShapeDtypeStruct with a sharding."""
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
    return int(math.prod(shape)) * x.dtype.itemsize


def state_bytes(tree) -> int:
    return sum(shard_bytes(x) for x in jax.tree.leaves(tree))


def mode_config(cfg, mode: str, remat: str, fsdp: int):
    if mode not in MODES:
        raise ConfigError(f"--mode {mode!r} is unknown; choose one of {list(MODES)}")
    if remat not in REMAT_ORDER:
        raise ConfigError(f"--remat {remat!r} is not a runtime.remat value; choose from {list(REMAT_ORDER)}")
    ch = {"runtime.remat": remat, "mesh.fsdp": fsdp, "mesh.data": 1, "train.grad_accum": 1,
          "train.mode": "distill" if mode == "fcsd" else "pretrain"}
    return replace(cfg, **ch)


def abstract_program(cfg, mode: str, mesh, batch_per_device: int, seq: int):
    """(jitted step, abstract args, analytic per-device bytes by part) of the real step on `mesh`."""
    tx, schedule = make_optimizer(cfg.train)
    graphdef, state = abstract_train_state(cfg, mesh, tx)
    b = batch_per_device * batch_shards(mesh)
    bs = batch_sharding(mesh)
    batch = {k: jax.ShapeDtypeStruct((b, seq), jnp.float32 if k == "loss_mask" else jnp.int32, sharding=bs)
             for k in ("tokens", "targets", "positions", "segment_ids", "loss_mask")}
    out_sh = (jax.tree.map(lambda x: x.sharding, state), None)
    parts = {"params": state_bytes(state["params"]), "optimizer": state_bytes(state["opt"]),
             "other_state": state_bytes({k: v for k, v in state.items() if k not in ("params", "opt")}),
             "batch": state_bytes(batch)}
    if mode == "pretrain":
        fn = jax.jit(make_train_step(graphdef, cfg, tx, schedule), donate_argnums=0, out_shardings=out_sh)
        return fn, (state, batch), parts

    td = dtype_of(cfg.distill.teacher_dtype)

    def cast(x):
        dt = td if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
        return jax.ShapeDtypeStruct(x.shape, dt, sharding=x.sharding)

    # the teacher as a State of plain (abstract) arrays: nnx.merge then makes its Variables inside the
    # loss's trace. With Variables made outside it (what fcsd/distill.py passes today) any runtime.remat
    # other than none fails with flax's TraceContextError; the bytes are the same either way.
    pure = lambda tree, f=lambda x: x: jax.tree.map(lambda v: f(v.get_value()), tree,  # noqa: E731
                                                    is_leaf=lambda x: isinstance(x, nnx.Variable))
    teacher = dict(params=pure(state["params"], cast), bias=pure(state["bias"]), rest=pure(state["rest"]))
    parts["teacher"] = state_bytes(teacher)
    fn = jax.jit(make_distill_step(graphdef, cfg, tx, schedule), donate_argnums=0, out_shardings=out_sh)
    return fn, (state, batch, teacher), parts


def plan_devices(cfg, memory_gb: float = 1024.0) -> list:
    """Compile-only H200-spec GPUs (memory set to `memory_gb`, so XLA never rematerializes on its
    own) for cfg.mesh with data = 1: fsdp x expert x tensor GPUs in nodes of up to 8."""
    m = cfg.mesh
    n = m.fsdp * m.expert * m.tensor
    return gpu_devices("h200", n, gpus_per_node=min(n, GPUS_PER_NODE), memory_gb=memory_gb)


def compile_flags() -> dict:
    return dict(preset_options("cuda_hopper"), **LHS_FLAGS)


def compile_point(cfg, mode: str, remat: str, fsdp: int, layers: int, batch: int, seq: int,
                  devices_for=None) -> Point:
    """Compile the step at this depth / per-device batch and read its memory analysis.
    devices_for(cfg) -> devices (default plan_devices: compile-only GPUs)."""
    c = cut_depth(mode_config(cfg, mode, remat, fsdp), layers)
    mesh = make_mesh(c.mesh, (devices_for or plan_devices)(c))
    t0 = time.time()
    fn, args, parts = abstract_program(c, mode, mesh, batch, seq)
    flags = compile_flags() if mesh.devices.flat[0].platform != "cpu" else {}
    lowered = fn.lower(*args)
    with pb.dumping() as d:
        m = lowered.compile(compiler_options=dict(flags, **d.options)).memory_analysis()
        try:
            bufs = pb.summary(pb.peak_buffers(d.path), top=PEAK_BUFFERS)
        except (OSError, ValueError) as e:  # the plan stands without the printout
            print(f"[memory] no peak buffers: {e}", file=sys.stderr)
            bufs = None
    return Point(mode, remat, fsdp, layers, batch, seq, int(m.argument_size_in_bytes), int(m.output_size_in_bytes),
                 int(m.temp_size_in_bytes), int(m.alias_size_in_bytes), int(m.peak_memory_in_bytes),
                 int(sum(parts.values())), time.time() - t0,
                 inplace_update=mesh.devices.flat[0].platform != "cpu",  # train/step.apply_if_finite
                 peak_buffers=bufs)


def full_state_parts(cfg, mode: str, remat: str, fsdp: int, batch: int, seq: int, devices_for=None) -> dict:
    """Analytic per-device bytes (params, optimizer, teacher, ...) of the FULL-depth model (eval_shape)."""
    c = mode_config(cfg, mode, remat, fsdp)
    mesh = make_mesh(c.mesh, (devices_for or plan_devices)(c))
    _, _, parts = abstract_program(c, mode, mesh, batch, seq)
    jax.clear_caches()
    return parts


@dataclasses.dataclass
class TempModel:
    """The temporaries of a train step (bytes per device) at depth L with B sequences per device, as
    the larger of its two peaks:

        update phase      U(L)    = gradients                                (update in place)
                                  = gradients + the new params and optimizer state   (otherwise)
        activation phase  A(L, B) = gradients + c0 + B (s0 + s1 L)
        temp(L, B)        = max(U(L), A(L, B))

    params(L) = p0 + p1 L and optimizer(L) = o0 + o1 L are exact (counted from the shardings at one or
    two depths); the gradients are one fp32 copy of the parameters. "In place" is how XLA:GPU compiles
    the step with the non-finite guard a select (train/step.apply_if_finite, docs/memory.md): the new
    state lands in the donated buffers. With the guard's cond (CPU programs) the new state is built among
    the temporaries (docs/memory.md gives the sizes).
    c0 (batch-independent temporaries beyond the gradients; negative where not every gradient is
    live at the activation peak), s0 (per sequence: logits, loss, one layer's recomputation) and s1
    (per layer and sequence: the saved activations) are fitted by least squares to the compiled points
    whose temporaries exceed U (the activation phase); `active` says how many there were. With one
    batch among them c0 = 0; with none, s0 is the largest (temp - gradients) / B seen: an
    over-estimate, flagged."""

    p0: float
    p1: float
    o0: float
    o1: float
    s0: float
    s1: float
    active: int
    c0: float = 0.0
    inplace: bool = False

    def params(self, L: float) -> float:
        return self.p0 + self.p1 * L

    def update(self, L: float) -> float:
        if self.inplace:
            return self.params(L)
        return 2 * self.params(L) + self.o0 + self.o1 * L

    def activation(self, L: float, B: float) -> float:
        return self.params(L) + self.c0 + B * (self.s0 + self.s1 * L)

    def __call__(self, L: float, B: float) -> float:
        return max(self.update(L), self.activation(L, B))

    @classmethod
    def fit(cls, pts: Sequence[Point], parts_at: dict) -> "TempModel":
        """pts: compiled points; parts_at: {depth: analytic parts} for every depth of pts."""
        depths = sorted({p.layers for p in pts})
        if len(depths) > 2 or len({p.batch for p in pts}) < 2:
            raise ConfigError("the temporaries model needs compiles at two per-device batches and one or two depths; "
                              "e.g. --depths 27 --batches 1,2 or --depths 3,5 --batches 1,2")
        inplace = {bool(p.inplace_update) for p in pts}
        if len(inplace) > 1:
            raise ConfigError("the compiled points mix an in-place update with one built among the temporaries "
                              "(a cache of an older compile?): give --cache a new file")
        if len(depths) == 2:
            (l1, l2) = depths
            p1 = (parts_at[l2]["params"] - parts_at[l1]["params"]) / (l2 - l1)
            o1 = (parts_at[l2]["optimizer"] - parts_at[l1]["optimizer"]) / (l2 - l1)
        else:
            l1, p1, o1 = depths[0], 0.0, 0.0
        p0, o0 = parts_at[l1]["params"] - p1 * l1, parts_at[l1]["optimizer"] - o1 * l1
        m = cls(p0, p1, o0, o1, 0.0, 0.0, 0, 0.0, inplace.pop())
        act = [p for p in pts if p.temp > 1.02 * m.update(p.layers)]
        extra = lambda p: p.temp - m.params(p.layers)  # noqa: E731  (temporaries beyond the gradients)
        c0, s0, s1 = 0.0, 0.0, 0.0
        if len({p.batch for p in act}) >= 2:
            cols = (lambda p: [1.0, p.batch, p.batch * p.layers]) if len({p.layers for p in act}) >= 2 else \
                (lambda p: [1.0, p.batch])
            coef, *_ = np.linalg.lstsq(np.array([cols(p) for p in act]), np.array([extra(p) for p in act]), rcond=None)
            c0, s0, s1 = (list(coef) + [0.0])[:3]
        elif act:
            s0 = float(np.mean([extra(p) / p.batch for p in act]))
        else:
            s0 = max(extra(p) / p.batch for p in pts)
        return dataclasses.replace(m, c0=float(c0), s0=float(s0), s1=float(max(s1, 0.0)), active=len(act))


@dataclasses.dataclass
class Row:
    """One (mode, remat, fsdp) of the plan at the config's depth."""

    mode: str
    remat: str
    fsdp: int
    parts: dict  # analytic bytes per device, full depth, batch 1
    fit: TempModel
    output_extra: int  # outputs not aliased to donated inputs (metrics, ...)
    layers: int
    seq: int
    gpus: int  # fsdp x expert x tensor
    validation: Optional[dict] = None
    bound_from: Optional[int] = None  # not compiled: temporaries of this FSDP size (an upper bound)
    depths: Optional[list] = None  # the depths compiled for the fit ([layers]: exact at the config's depth)
    peak_point: Optional[Point] = None  # the compiled point whose peak buffers are printed

    @property
    def nodes(self) -> int:
        return -(-self.gpus // GPUS_PER_NODE)

    @property
    def fixed(self) -> float:
        """Bytes that do not grow with the batch: state (+ teacher) + non-aliased outputs."""
        return sum(v for k, v in self.parts.items() if k != "batch") + self.output_extra

    def update_temp(self) -> float:
        """U at the config's depth from its exact state: the gradients (+ the new params and optimizer
        state where the update is not in place)."""
        if self.fit.inplace:
            return self.parts["params"]
        return 2 * self.parts["params"] + self.parts["optimizer"]

    def per_seq(self) -> float:
        """Activation bytes per sequence per device at the config's depth (s0 + s1 L)."""
        return self.fit.s0 + self.fit.s1 * self.layers

    def temp(self, batch: int) -> float:
        return max(self.update_temp(), self.parts["params"] + self.fit.c0 + batch * self.per_seq())

    def peak(self, batch: int) -> float:
        per_seq_batch = self.parts["batch"]  # the batch of 1 sequence per device
        return self.fixed + per_seq_batch * batch + self.temp(batch)

    def max_batch(self, capacity: float, limit: int = 2**40) -> int:
        """Largest per-device batch (sequences of `seq`) whose peak fits in `capacity` bytes (0: none);
        `limit` only bounds the search (the peak grows with every sequence, so it is never reached)."""
        if self.peak(1) > capacity:
            return 0
        lo, hi = 1, 2
        while hi <= limit and self.peak(hi) <= capacity:
            lo, hi = hi, hi * 2
        hi = min(hi, limit + 1)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.peak(mid) <= capacity else (lo, mid)
        return lo


def build_rows(cfg, modes, remats, fsdps, depths, batches, seq, validate_depth=None, cache=None, log=None,
               devices_for=None, validate_cached: bool = False, validate_batch=None) -> list[Row]:
    """Compile (or take from `cache`, a dict of Point by key) what the fit needs, per (mode, remat, fsdp).
    devices_for(cfg) -> devices to compile for (default: compile-only GPUs, plan_devices).
    validate_depth / validate_batch: compile one more point (default depth: the config's; default batch:
    the first of `batches`) and store the fit's error on it in Row.validation."""
    log = log or (lambda m: None)
    cache = {} if cache is None else cache
    rows = []
    gpus_per_fsdp = cfg.mesh.expert * cfg.mesh.tensor

    def get(mode, remat, f, L, B):
        k = point_key(mode, remat, f, L, B, seq)
        if k not in cache:
            log(f"[memory] compiling {mode} remat={remat} fsdp={f} ({f * gpus_per_fsdp} GPUs) depth {L} batch {B}/device ...")
            p = compile_point(cfg, mode, remat, f, L, B, seq, devices_for)
            jax.clear_caches()
            log(f"[memory]   {p.compile_s:.0f}s: peak {p.peak / GiB:.2f} GiB (args {p.argument / GiB:.2f}, temp "
                f"{p.temp / GiB:.2f}, out {p.output / GiB:.2f}, alias {p.alias / GiB:.2f}); analytic args "
                f"{p.analytic_argument / GiB:.2f} GiB")
            cache[k] = dataclasses.asdict(p)
        v = cache[k]
        return v if isinstance(v, Point) else Point(**v)

    if len(depths) == 1 and depths[0] != cfg.model.num_layers:
        raise ConfigError(f"--depths {depths[0]}: one depth must be the config's ({cfg.model.num_layers}); give two "
                          "depths to extrapolate")
    for mode in modes:
        for remat in remats:
            for f in fsdps:
                pts = [get(mode, remat, f, L, B) for L in depths for B in batches]
                parts_at = {L: full_state_parts(cut_depth(cfg, L), mode, remat, f, 1, seq, devices_for) for L in depths}
                fit = TempModel.fit(pts, parts_at)
                extra = max(p.output - p.alias for p in pts)
                parts = full_state_parts(cfg, mode, remat, f, 1, seq, devices_for)
                row = Row(mode, remat, f, parts, fit, extra, cfg.model.num_layers, seq, f * gpus_per_fsdp,
                          depths=sorted(depths))
                deepest = [p for p in pts if p.layers == max(depths)]
                row.peak_point = max(deepest, key=lambda p: p.batch)
                vL = validate_depth or (cfg.model.num_layers if validate_batch else None)
                B = validate_batch or batches[0]
                if vL and (not validate_cached or point_key(mode, remat, f, vL, B, seq) in cache):
                    vp = get(mode, remat, f, vL, B)
                    row.validation = dict(layers=vL, batch=B, compiled_temp=vp.temp, predicted_temp=fit(vL, B),
                                          rel_error=(fit(vL, B) - vp.temp) / max(vp.temp, 1),
                                          phase="update" if fit.update(vL) >= fit.activation(vL, B) else "activation")
                rows.append(row)
    return rows


def bound_rows(cfg, rows: Sequence[Row], fsdps: Sequence[int], devices_for=None) -> list[Row]:
    """Rows at other FSDP sizes without compiling: the exact state at that size (counted from its
    shardings; it sets the update phase) and the activations per sequence of the nearest compiled FSDP
    size (per-device activations and one layer's all-gathered weights do not depend on the FSDP size)."""
    out = []
    for f in fsdps:
        for key in dict.fromkeys((r.mode, r.remat) for r in rows):
            base = [r for r in rows if (r.mode, r.remat) == key and r.bound_from is None]
            if not base or any(r.fsdp == f for r in base):
                continue
            b = min(base, key=lambda r: (abs(r.fsdp - f), -r.fsdp))
            parts = full_state_parts(cfg, b.mode, b.remat, f, 1, b.seq, devices_for)
            out.append(dataclasses.replace(b, fsdp=f, parts=parts, gpus=b.gpus // b.fsdp * f, validation=None,
                                           bound_from=b.fsdp))
    return out


def format_plan(cfg_name: str, rows: Sequence[Row], usable: float, devices=tuple(DEVICE_MEMORY), top: int = 8) -> str:
    lines = [f"memory plan: {cfg_name}, {rows[0].layers} layers, seq {rows[0].seq}, per device (GiB); "
             f"fits = peak <= {usable:.2f} x device memory; peak = state (+ teacher) + batch + temp, temp = "
             f"max(update: grads{'' if all(r.fit.inplace for r in rows) else ' + new state'}, activation: grads + c0 + "
             f"B x act/seq)"]
    hdr = (f"{'mode':<9}{'remat':<8}{'fsdp':>4}{'GPUs':>5}{'params':>8}{'optim':>8}{'teacher':>8}{'update':>8}"
           f"{'act/seq':>8}{'temp@1':>8}{'peak@1':>8}  " + "  ".join(f"{'B ' + d:>10}" for d in devices))
    lines += [hdr, "-" * len(hdr)]
    for r in rows:
        mb = [r.max_batch(usable * DEVICE_MEMORY[d]) for d in devices]
        mark = "*" if r.bound_from else " "
        lines.append(f"{r.mode:<9}{r.remat:<8}{r.fsdp:>3}{mark}{r.gpus:>5}{r.parts['params'] / GiB:>8.1f}"
                     f"{r.parts['optimizer'] / GiB:>8.1f}{r.parts.get('teacher', 0) / GiB:>8.1f}"
                     f"{r.update_temp() / GiB:>8.1f}{(r.per_seq() + r.parts['batch']) / GiB:>8.2f}"
                     f"{r.temp(1) / GiB:>8.1f}{r.peak(1) / GiB:>8.1f}  " + "  ".join(f"{(str(b) if b else '-'):>10}" for b in mb))
    lines.append("B <device> = largest per-device batch (sequences) that fits; '-' = not even one sequence")
    if any(r.bound_from for r in rows):
        lines.append("* not compiled: exact state at this FSDP size, activations per sequence of the nearest compiled "
                     "FSDP size")
    for r in rows:
        if not r.bound_from and r.fit.active == 0:
            lines.append(f"NOTE {r.mode}/{r.remat}/fsdp{r.fsdp}: no compiled point was in the activation phase; act/seq "
                         "is an over-estimate (compile larger --batches)")
        if not r.bound_from and r.depths and r.depths != [r.layers]:
            d = ",".join(map(str, r.depths))
            if r.validation and r.validation["layers"] not in r.depths:
                lines.append(f"EXTRAPOLATED {r.mode}/{r.remat}/fsdp{r.fsdp}: depth {r.layers} from compiles at depths {d}; "
                             f"checked at depth {r.validation['layers']} (below)")
            else:
                lines.append(f"EXTRAPOLATED {r.mode}/{r.remat}/fsdp{r.fsdp}: depth {r.layers} from compiles at depths {d}; "
                             f"not checked at any other depth (--validate-depth {r.layers} compiles the config's depth)")
        if r.validation:
            v = r.validation
            lines.append(f"validation {r.mode}/{r.remat}/fsdp{r.fsdp}: depth {v['layers']} batch {v['batch']}: temp "
                         f"compiled {v['compiled_temp'] / GiB:.2f} GiB, model {v['predicted_temp'] / GiB:.2f} GiB "
                         f"({100 * v['rel_error']:+.1f}%, {v['phase']} phase)")
    lines.append("")
    lines += verdict_lines(rows, usable, devices)
    if top:
        lines += peak_buffer_lines(rows, top)
    return "\n".join(lines)


def peak_buffer_lines(rows: Sequence[Row], top: int) -> list[str]:
    """The largest buffers live at the peak of each row's deepest, largest-batch compile."""
    out = []
    for r in rows:
        p = r.peak_point
        if r.bound_from or p is None or not p.peak_buffers:
            continue
        out += ["", f"largest buffers live at the peak: {r.mode}/{r.remat}/fsdp{r.fsdp}, depth {p.layers}, batch {p.batch}"
                f"/device (temp {p.temp / GiB:.2f} GiB; scope = op_name: jvp = forward, transpose(jvp) = backward)",
                pb.format_peak_buffers(p.peak_buffers, top=top)]
        if p.peak_buffers["other_bytes"] < 0.9 * p.temp:
            out.append(f"  (XLA's live ranges at the peak list {p.peak_buffers['other_bytes'] / GiB:.2f} of the {p.temp / GiB:.2f} GiB "
                       "of temporaries: values inside loop bodies (the scanned layers' recomputation) are not among them)")
    return out


def best_choice(rows: Sequence[Row], mode: str, device: str, usable: float) -> Optional[tuple[Row, int]]:
    """Fewest nodes first, then the least recomputation, for which at least one sequence fits."""
    cand = [(r.fsdp, REMAT_ORDER.index(r.remat), r) for r in rows if r.mode == mode]
    for _, _, r in sorted(cand, key=lambda t: (t[0], t[1])):
        b = r.max_batch(usable * DEVICE_MEMORY[device])
        if b:
            return r, b
    return None


def verdict_lines(rows, usable, devices=tuple(DEVICE_MEMORY)) -> list[str]:
    out = []
    for mode in dict.fromkeys(r.mode for r in rows):
        for d in devices:
            bc = best_choice(rows, mode, d, usable)
            if bc is None:
                r = max((r for r in rows if r.mode == mode), key=lambda r: r.gpus)
                out.append(f"{mode} on {d}: nothing fits up to fsdp {r.fsdp} ({r.gpus} GPUs); more FSDP nodes needed")
            else:
                r, b = bc
                how = f" [not compiled: activations of fsdp {r.bound_from}]" if r.bound_from else ""
                out.append(f"{mode} on {d}: {r.nodes} node(s) of 8 ({r.gpus} GPUs, fsdp {r.fsdp}), remat {r.remat}, up to {b} "
                           f"sequence(s) of {r.seq} per GPU (peak {r.peak(b) / GiB:.1f} of "
                           f"{usable * DEVICE_MEMORY[d] / GiB:.1f} GiB usable){how}")
    return out


def rows_json(rows: Sequence[Row], usable: float) -> list[dict]:
    out = []
    for r in rows:
        out.append(dict(mode=r.mode, remat=r.remat, fsdp=r.fsdp, gpus=r.gpus, nodes=r.nodes, layers=r.layers, seq=r.seq,
                        parts_bytes=r.parts, temp_model=dataclasses.asdict(r.fit), update_temp_bytes=r.update_temp(), act_per_seq_bytes=r.per_seq(), output_extra_bytes=r.output_extra,
                        peak_b1_bytes=r.peak(1), validation=r.validation, bound_from_fsdp=r.bound_from, depths=r.depths,
                        peak_buffers=r.peak_point.peak_buffers if r.peak_point else None,
                        max_batch={d: r.max_batch(usable * m) for d, m in DEVICE_MEMORY.items()}))
    return out


def default_depths(cfg) -> list[int]:
    """The depths the plan compiles unless told: the config's own with scanned layers (exact, no
    extrapolation), else 2 and 3 (an unscanned full-depth compile takes ~30 min here)."""
    L = cfg.model.num_layers
    if cfg.runtime.scan_layers or L <= 3:
        return [L]
    return [2, 3]


def check_plan_args(a, cfg, depths: Sequence[int], batches: Sequence[int]) -> None:
    """ConfigError for a memory-plan command line that cannot run as asked, before anything compiles."""
    if not 0.0 < a.usable <= 1.0:
        raise ConfigError(f"--usable {a.usable} must be a fraction of device memory in (0, 1] (default "
                          f"{USABLE_FRACTION}: JAX's GPU preallocation)")
    if a.seq is not None and a.seq < 1:
        raise ConfigError(f"--seq {a.seq} must be >= 1 (leave it out for train.seq_len)")
    if len(set(batches)) != 2:
        raise ConfigError(f"--batches {a.batches!r} must name two different per-device batches (e.g. 1,2): the "
                          "activations per sequence are fitted between them")
    if not 1 <= len(set(depths)) <= 2:
        raise ConfigError(f"--depths {a.depths!r} must name one depth (the config's) or two to extrapolate from "
                          "(e.g. 2,3)")
    for flag, v in (("--validate-depth", a.validate_depth), ("--validate-batch", a.validate_batch)):
        if v is not None and v < 1:
            raise ConfigError(f"{flag} {v} must be >= 1")
    if a.top < 0:
        raise ConfigError(f"--top {a.top} must be >= 0 (0: no buffer list)")
    check_out_file(a.out, "--out", "the plan")
    check_out_file(a.cache, "--cache", "the compiled points")
    for path in (a.read_cache or "").split(","):
        if path.strip() and not os.path.isfile(path.strip()):
            raise ConfigError(f"--read-cache {path.strip()} does not exist; name cache files an earlier plan wrote "
                              "(--cache)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m farskip_jax.analysis.memory", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--mode", default="pretrain,fcsd", help="pretrain, fcsd or both (comma separated)")
    ap.add_argument("--remat", default=None, help="runtime.remat policies to plan (default: the config's)")
    ap.add_argument("--fsdp", default=None, help="FSDP sizes = nodes of 8 GPUs (comma separated; default: the config's "
                    "mesh.fsdp)")
    ap.add_argument("--bound-fsdp", default="", help="more FSDP sizes planned without compiling (exact state, "
                    "activations of the nearest compiled size)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default train.seq_len)")
    ap.add_argument("--depths", default=None,
                    help="depths the step is compiled at: the config's (default with runtime.scan_layers) or two depths "
                         "to extrapolate from (default 2,3 for an unscanned model)")
    ap.add_argument("--batches", default="1,2", help="two per-device batches the step is compiled at")
    ap.add_argument("--validate-depth", type=int, default=None, help="compile one more depth and report the fit's error")
    ap.add_argument("--validate-batch", type=int, default=None,
                    help="compile one more per-device batch (at the config's depth, or --validate-depth) and report the fit's error")
    ap.add_argument("--validate-cached", action="store_true",
                    help="validate only where the --validate-depth point is already in a cache (no new compile)")
    ap.add_argument("--usable", type=float, default=USABLE_FRACTION, help="usable fraction of device memory")
    ap.add_argument("--cache", default=None, help="JSON of compiled points (read and extended; reruns are incremental)")
    ap.add_argument("--read-cache", default=None, help="more point caches to read (comma separated; not written)")
    ap.add_argument("--out", default=None, help="write the plan as JSON here")
    ap.add_argument("--top", type=int, default=8, help="print this many of the largest buffers live at the peak (0: none)")
    ap.add_argument("overrides", nargs="*", help="config overrides key=value")
    a = ap.parse_args(argv)

    log = lambda m: m and print(m, file=sys.stderr, flush=True)  # noqa: E731
    try:
        cfg = load_config(a.config, a.overrides)
        modes = [m.strip() for m in a.mode.split(",") if m.strip()]
        bad = [m for m in modes if m not in MODES]
        if bad or not modes:
            raise FarSkipError(f"--mode: {f'unknown {bad}' if bad else 'no mode named'}; choose from {list(MODES)} "
                               "(comma separated)")
        remats = [r.strip() for r in (a.remat or cfg.runtime.remat).split(",") if r.strip()]
        bad = [r for r in remats if r not in REMAT_ORDER]
        if bad:
            raise FarSkipError(f"--remat: unknown {bad}; choose from {list(REMAT_ORDER)}")
        seq = a.seq or cfg.train.seq_len
        depths = default_depths(cfg) if a.depths is None else int_list(a.depths, "--depths")
        batches = int_list(a.batches, "--batches")
        check_plan_args(a, cfg, depths, batches)
        fsdps = int_list(a.fsdp, "--fsdp") if a.fsdp else [cfg.mesh.fsdp]
        bound_fsdps = int_list(a.bound_fsdp, "--bound-fsdp")
        cache: dict = {}
        for path in [p.strip() for p in (a.read_cache or "").split(",")] + [a.cache or ""]:
            if path and os.path.exists(path):
                cache.update(read_json_object(path, "--cache" if path == a.cache else "--read-cache",
                                              "a cache of compiled points"))

        class Saving(dict):  # write the cache after every new compile: a long run can be resumed
            def __setitem__(self, k, v):
                super().__setitem__(k, v)
                if a.cache:
                    os.makedirs(os.path.dirname(os.path.abspath(a.cache)), exist_ok=True)
                    with open(a.cache, "w") as f:
                        json.dump(dict(self), f, indent=1)

        t0 = time.time()
        rows = build_rows(cfg, modes, remats, fsdps, depths, batches, seq,
                          a.validate_depth, Saving(cache), log, validate_cached=a.validate_cached,
                          validate_batch=a.validate_batch)
        rows += bound_rows(cfg, rows, bound_fsdps)
    except FarSkipError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = format_plan(f"{a.config} {' '.join(a.overrides)}".strip(), rows, a.usable, top=a.top)
    print(text)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(dict(config=a.config, overrides=a.overrides, usable_fraction=a.usable, device_memory=DEVICE_MEMORY,
                           depths=depths, batches=batches, seq=seq, wall_s=time.time() - t0,
                           rows=rows_json(rows, a.usable), table=text), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Overlap report for the serving programs of the tp_ep layout: prefill and decode
compiled deviceless for GPUs, their all-reduces priced by the two-stream model, standard vs FarSkip.

    python -m farskip_jax.analysis.inference_report --config configs/deepseek_v2_lite.yaml \
        --program prefill --batch 16 --tokens 1024 [--devices 16 --gpus-per-node 8] [--hardware h200]
    python -m farskip_jax.analysis.inference_report --config ... --program decode --batch 64 --context 2048

    mesh = serving_mesh(cfg, gpu_devices("h200", 16, gpus_per_node=8))   # TP = EP over the devices
    prog = compile_serving(cfg_of(cfg, "farskip"), mesh, "prefill", batch=16, tokens=1024, max_len=1024)
    t = time_serving(prog.schedule, node_of(mesh), "h200", "prefill")    # ServingTiming (microseconds)

The programs are serving/programs.prefill_program / decode_program (prefill with the LM head on the last
slot only: what the first token costs), compiled with LHS_FLAGS + TpEpLayout.compiler_options() (the
latency-hiding scheduler on, XLA's all-reduce combiners off), on the layout of serving/tp_ep.py:
per layer one attention all-reduce (scope attention_allreduce; of a + s under FarSkip with the
default tensor-parallel shared experts) and one routed all-reduce (routed_allreduce; of s + r under
standard), payload batch x tokens x d_model x 2 bytes (bf16); shared_allreduce where neither can
carry the shared experts (parallel/tp_ep.TpEpStep). The schedule XLA chose is
re-timed by cost_model.simulate on analysis/topology.py's links (intra-node NVLink / Infinity Fabric;
NICs between nodes, hierarchical all-reduce), prefill with the attention core priced as a causal
flash kernel per layer (a server's prefill attention; analysis/attention_cost.py), decode with the
core as compiled (it reads the cache: memory bound), KV-cache writes at the bytes of the update (in
place), compute under an all-reduce in flight at the hardware's contention (cost_model.HARDWARE,
--contention). Reported per program (ServingTiming):

    time_us           modelled TTFT (prefill) / time per output token (decode)
    hidden_frac       all-reduce time hidden under compute / all-reduce time (the paper's "overlap");
                      layer_hidden_frac: the same for the layer all-reduces (attention + routed) only
    serial_us         the same schedule with every all-reduce synchronous (vLLM / SGLang's standard
                      model: nothing runs under an all-reduce)
    ceiling_us        time_us minus every exposed all-reduce microsecond (all of them hidden)
    row_copy_us       scanned programs (runtime.scan_layers, serving/generate.py): the copies XLA makes
                      of each layer's row of a stacked weight / cache ahead of a GEMM in every iteration
    inplace_us        time_us with those copies free: the GEMMs reading the rows in place (XLA's
                      dynamic-slice fusion; 0 = a program without such copies)

Scanned programs keep their layers in while bodies: the schedule is the entry with every loop
unrolled, XLA's order inside each body repeated (analysis/loop_schedule.py).

Routed experts: a deviceless compile has no grouped GEMM, so `jax.lax.ragged_dot` is traced as a cost
proxy at the useful rows of a perfectly balanced router (`balanced_grouped_gemm`: a batched GEMM of
rows * k / EP rows over the local experts, each expert's weights read once): the layout's dropless
buffer holds T * min(k, E/EP) rows per device, of which T * k / EP are real at balance.
Depth-cut models: `extrapolate` (two depths, linear in the layer count; every ServingTiming field
is a sum over layers plus a constant).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import glob
import math
import os
import sys
import tempfile
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from farskip_jax.analysis.calibration_fit import load_fitted
from farskip_jax.analysis.cost_model import HARDWARE, hardware_from_fit, OptimizerStep, simulate, with_contention
from farskip_jax.analysis.deviceless import compile_deviceless, gpu_devices, LHS_FLAGS
from farskip_jax.analysis.hlo import COLLECTIVES
from farskip_jax.analysis.loop_schedule import load_unrolled_schedule, row_copy_ops
from farskip_jax.analysis.report import analyze
from farskip_jax.analysis.scopes import scope_of
from farskip_jax.analysis.timeline import plot_layer_timelines
from farskip_jax.analysis.topology import LINKS, links_from_fit, resized, Topology
from farskip_jax.config import load_config, replace
from farskip_jax.errors import ConfigError, FarSkipError
from farskip_jax.kernels import ops
from farskip_jax.parallel.mesh import make_mesh
from farskip_jax.serving.programs import decode_program, prefill_program
from farskip_jax.serving.tp_ep import abstract_inference_model, TpEpLayout

ROLES = ("attention", "routed", "shared", "dense_mlp", "other")
LAYER_ROLES = ("attention", "routed", "shared")
REDUCTIONS = ("all-reduce", "all-gather", "reduce-scatter")
# XLA's dot merger fuses dots that share an operand (gate and up projections of one token batch) by
# concatenating their weights in every call: a copy of the weights per step, which a server does once
# at load time (fused gate_up weights). In a weight-bandwidth-bound decode step that copy costs as
# much as the GEMMs, so the serving programs compile without it (merge_weights=True keeps it).
NO_WEIGHT_MERGE = ("dot-merger",)


def role_of(op_name: str) -> str:
    """attention | routed | shared | dense_mlp | other (embedding lookup, LM head) of an all-reduce's
    op_name (tensor-parallel shared experts ride in the attention or routed one, or have their own)."""
    op_name = op_name or ""
    if "moe/group_sum" in op_name:  # Federation of Experts (inference.layout=foe): the routed sum alone
        return "routed"
    if "attention_allreduce" in op_name or "group_sum" in op_name:  # FoE: attention (+ routed of k-1)
        return "attention"
    if "routed_allreduce" in op_name:
        return "routed"
    if "shared_allreduce" in op_name or "shared_experts" in op_name:  # FoE: GSPMD's sum of the split shared experts
        return "shared"
    if "dense_mlp" in op_name:
        return "dense_mlp"
    return "other"


# --------------------------------------------------------------------------------------------------
# configs, meshes, programs
# --------------------------------------------------------------------------------------------------


def serving_shape(cfg, num_devices: int, gpus_per_node: Optional[int] = None) -> tuple[int, int]:
    """(mesh.expert, mesh.tensor) of the paper's layout on `num_devices` GPUs: TP = EP = every device
    when the attention heads (and GQA kv heads) split that many ways, else TP over one node's GPUs
    with the attention replicated over `expert` = nodes (EP still every device)."""
    m = cfg.model

    def ok(tp):
        kv_ok = m.attention != "gqa" or m.num_kv_heads % tp == 0 or tp % m.num_kv_heads == 0
        return m.num_heads % tp == 0 and kv_ok

    if ok(num_devices):
        return 1, num_devices
    per = gpus_per_node or num_devices
    if ok(per):
        return num_devices // per, per

    raise ConfigError(f"model.num_heads={m.num_heads} splits neither {num_devices} nor {per} ways; "
                      "the tp_ep layout needs mesh.tensor to divide the heads")


def serving_config(cfg, preset: str, num_devices: int, gpus_per_node: Optional[int] = None,
                   layers: Optional[int] = None, scan_layers: Optional[bool] = None, micro_batches: int = 1,
                   foe_groups: Optional[int] = None):
    """cfg on the tp_ep layout of num_devices GPUs (serving_shape), connectivity `preset`, bf16, no
    remat, runtime.gmm and runtime.attention_impl auto (a server's kernels); `layers` cuts the depth (model.num_layers); scan_layers: the stacked, scanned program
    (serving/generate.py) or per-layer weights unrolled (default: the config's runtime.scan_layers);
    micro_batches: 2 = two-batch overlap (runtime.micro_batches). foe_groups = H: the Federation-of-
    Experts layout instead (inference.layout=foe, runtime.num_groups = H over the num_devices GPUs)."""
    if foe_groups:
        over = {"inference.layout": "foe", "mesh.data": 1, "mesh.fsdp": 1, "mesh.expert": num_devices,
                "mesh.tensor": 1, "runtime.num_groups": foe_groups,
                "runtime.dispatch": "local" if foe_groups == num_devices else "all_to_all"}
    else:
        expert, tensor = serving_shape(cfg, num_devices, gpus_per_node)
        over = {"inference.layout": "tp_ep", "mesh.data": 1, "mesh.fsdp": 1, "mesh.expert": expert,
                "mesh.tensor": tensor, "runtime.dispatch": "all_to_all" if expert > 1 else "local"}
    # a server's kernels: the grouped GEMM (ragged_dot, traced as compile_serving's balanced proxy) and the
    # platform's attention, whatever a training config picked for memory (runtime.gmm=tiled walks weight
    # tiles over the padded rows of the replicated MoE; blockwise attention loops over key blocks)
    over.update({"runtime.capacity_factor": None, "farskip.preset": preset, "runtime.micro_batches": micro_batches,
                 "runtime.remat": "none", "runtime.compute_dtype": "bfloat16", "runtime.param_dtype": "bfloat16",
                 "runtime.gmm": "auto", "runtime.attention_impl": "auto"})
    if scan_layers is not None:
        over["runtime.scan_layers"] = bool(scan_layers)
    if layers is not None:
        over["model.num_layers"] = layers
        if cfg.model.nope_layers:
            over["model.nope_layers"] = [i for i in cfg.model.nope_layers if i < layers]
        if cfg.model.chunked_layers is not None:
            over["model.chunked_layers"] = [i for i in cfg.model.chunked_layers if i < layers]
    return replace(cfg, **over)


def serving_mesh(cfg, devices):
    return make_mesh(cfg.mesh, list(devices))


def node_of(mesh) -> tuple[int, ...]:
    """Node (host) of each logical device of the mesh, in the program's device order."""
    return tuple(int(d.process_index) for d in mesh.devices.flat)


USED_EXPERTS = "used_expert_weights"  # the proxy's slice of the experts that get rows (not a device op)


def _balanced_grouped_gemm(fraction: float):
    def proxy(lhs, rhs, group_sizes):
        m, k = lhs.shape
        g = rhs.shape[0]
        rhs = rhs.astype(lhs.dtype)
        real = max(1, math.ceil(m * fraction))
        if real < g:  # fewer real rows than local experts: `real` experts with one row each, only their
            with jax.named_scope(USED_EXPERTS):  # weights read (the slice's copy is priced free: time_serving)
                rhs = rhs[:real]
            g = real
        if m < g:
            lhs = jnp.pad(lhs, ((0, g - m), (0, 0)))
        per = max(1, math.ceil(m * fraction / g))  # rows per local expert at balance
        u = min(per * g, lhs.shape[0] - lhs.shape[0] % g)
        per = max(u // g, 1)
        x = lhs[: per * g] + jnp.zeros((), lhs.dtype) * group_sizes.sum().astype(lhs.dtype)  # keep the dependency
        # output in the input dtype: a bf16 x bf16 -> f32 dot of few rows compiles (XLA:GPU) to f32
        # copies of the weights around the GEMM; a grouped GEMM accumulates in f32 reading bf16
        if g == 1:
            y = jnp.dot(x, rhs[0])
        else:
            y = jnp.einsum("gmk,gkn->gmn", x.reshape(g, per, k), rhs).reshape(g * per, -1)
        return jnp.pad(y, ((0, max(m - g * per, 0)), (0, 0)))[:m]

    return proxy


def balanced_grouped_gemm(fraction: float):
    """A context: while it is open, the grouped matmul `ragged_dot` of the model's backend seam
    (kernels/ops.py; lhs [M, K], rhs [G, K, N], sizes) is a batched GEMM of ceil(M * fraction) rows
    split evenly over the G groups (each group's weights read once, the useful FLOPs of a balanced
    grouped GEMM), zero-padded to M rows. Analysis compiles only: the values are wrong, the costs,
    shapes and dependencies are a balanced grouped GEMM's (as analysis/programs.grouped_gemm_proxy).
    With fewer real rows than groups only that many experts' weights are read (a grouped GEMM skips
    experts without rows): the proxy slices them out under the scope USED_EXPERTS, a copy that
    time_serving prices free (the grouped GEMM reads them in place)."""
    return ops.registered_while(ops.GROUPED_MATMUL, "ragged_dot", ops.Backend(_balanced_grouped_gemm(fraction), platform=None))


def useful_fraction(cfg, mesh) -> float:
    """Real rows / buffer rows of ReplicatedEPCompute at a balanced router: T * k / EP of the
    T * min(k, E / EP) rows per device. Federation of Experts with one group per device (the local
    path: the group's T * k / H rows, all real): 1; with a dropless all-to-all inside a group the
    buffer holds T_l rows per local expert, of which T_l * k / E are real. dp_ep (all-to-all
    buffers of capacity factor cf): 1 / cf real at balance; dropless: k / E."""
    if cfg.inference.layout == "foe":
        return 1.0 if cfg.runtime.dispatch == "local" else cfg.moe.top_k / cfg.moe.num_experts
    if cfg.inference.layout == "dp_ep":  # the all-to-all buffers: C slots per (source, expert)
        cf = cfg.runtime.capacity_factor
        return min(1.0, 1.0 / cf) if cf else cfg.moe.top_k / cfg.moe.num_experts
    ep = mesh.shape["expert"] * mesh.shape["tensor"]
    k, e = cfg.moe.top_k, cfg.moe.num_experts
    if not e:
        return 1.0
    return min(1.0, k / (ep * min(k, e // ep)))


def compile_serving(cfg, mesh, program: str, batch: int, tokens: int, max_len: int, flags: Optional[dict] = None,
                    merge_weights: bool = False):
    """deviceless.CompiledProgram of the prefill (tokens per row = the prompt) or decode (tokens = 1)
    program of `cfg` on `mesh`, with LHS_FLAGS + TpEpLayout.compiler_options() (+ `flags`).
    merge_weights=False also disables NO_WEIGHT_MERGE (see there). Its schedule is the entry with
    every while loop unrolled (loop_schedule.load_unrolled_schedule): a scanned program's layers."""
    if program not in ("prefill", "decode"):
        raise ConfigError(f"program {program!r}: choose prefill or decode")
    opts = {**LHS_FLAGS, **TpEpLayout.compiler_options(), **(flags or {})}
    if merge_weights is False:  # xla_disable_hlo_passes is one comma-separated option
        opts["xla_disable_hlo_passes"] = ",".join(x for x in (opts.get("xla_disable_hlo_passes"), *NO_WEIGHT_MERGE) if x)
    with balanced_grouped_gemm(useful_fraction(cfg, mesh)), tempfile.TemporaryDirectory(prefix="farskip_serving_") as d:
        if program == "prefill":
            fn, args = prefill_program(cfg, mesh, batch, tokens, max_len, last_logits=True)
        else:
            fn, args = decode_program(cfg, mesh, batch, max_len)
        prog = compile_deviceless(fn, *args, flags=opts, keep_dump=d)
        # the while loops of a scanned program unrolled (analysis/loop_schedule.py; the entry as is otherwise)
        dump = sorted(glob.glob(os.path.join(d, "*.schedule.txt")), key=os.path.getmtime)[-1]
        with open(dump) as f:
            return dataclasses.replace(prog, schedule=load_unrolled_schedule(f.read()))


# --------------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ServingTiming:
    """Modelled figures of one serving program (us unless named otherwise); every field is additive
    over layers (see extrapolate)."""

    time_us: float
    serial_us: float  # every all-reduce synchronous
    compute_us: float
    ar_us: float  # all-reduce time (modelled durations), every all-reduce
    ar_hidden_us: float
    layer_ar_us: float  # attention + routed all-reduces
    layer_ar_hidden_us: float
    ar_count: float
    ar_bytes: float  # payload bytes summed over all-reduces
    by_role: dict  # role -> {count, us, hidden_us, bytes}
    other_collective_us: float = 0.0  # gathers etc. (GSPMD's)
    sync_collectives: float = 0.0  # collectives XLA left synchronous (priced as memory ops by the model)
    row_copy_us: float = 0.0  # scanned programs: the copies of one layer's row out of a stacked weight / cache
    inplace_us: float = 0.0  # time_us with those copies free (the GEMMs reading the rows in place); 0: no copies
    compute_by_scope: dict = dataclasses.field(default_factory=dict)  # named scope -> compute us (full speed)

    @property
    def time_inplace_us(self) -> float:
        return self.inplace_us or self.time_us

    @property
    def ar_exposed_us(self) -> float:
        return self.ar_us - self.ar_hidden_us

    @property
    def ceiling_us(self) -> float:
        return self.time_us - self.ar_exposed_us

    @property
    def hidden_frac(self) -> float:
        return self.ar_hidden_us / self.ar_us if self.ar_us else 1.0

    @property
    def layer_hidden_frac(self) -> float:
        return self.layer_ar_hidden_us / self.layer_ar_us if self.layer_ar_us else 1.0

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(ar_exposed_us=self.ar_exposed_us, ceiling_us=self.ceiling_us, hidden_frac=self.hidden_frac,
                 layer_hidden_frac=self.layer_hidden_frac)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "ServingTiming":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def topology_for(node_of_devices: Sequence[int], hardware: str, **links_over):
    nodes = tuple(node_of_devices)
    per = max(nodes.count(x) for x in set(nodes))
    return Topology(resized(LINKS[hardware], per, **links_over), nodes)


def score_elements(cfg, mesh, batch: int, tokens: int, max_len: int) -> int:
    """Elements of one device's attention scores [b, heads / TP, t, L] (prefill: t = L = the prompt);
    Federation of Experts: the heads of the device's groups."""
    split = mesh.shape["tensor"] if cfg.inference.layout != "foe" else min(cfg.runtime.num_groups, cfg.mesh.expert)
    return batch * (cfg.model.num_heads // split) * tokens * max_len


def flash_scores(schedule, scores: int):
    """A copy of `schedule` whose attention ops that stream the [b, h, t, L] scores through HBM (no
    FLOPs, at least one bf16 score tensor of `scores` elements moved: the masked softmax XLA fuses
    under a reshape's name, outside the attention_core scope) count as part of the attention core,
    which a flash kernel keeps on chip (analysis/attention_cost.py prices the core as one kernel)."""
    sched = copy.deepcopy(schedule)
    for o in sched.ops:
        if (o.kind == "compute" and o.flops <= 0 and o.in_bytes + o.out_bytes >= 2 * scores
                and scope_of(o.op_name) in ("attention", "attention_core")):
            o.op_name = f"{o.op_name}/attention_core"
    return sched


def time_serving(schedule, node_of_devices: Sequence[int], hardware: str = "h200", program: str = "prefill",
                 scores: Optional[int] = None, contention: Optional[float] = None, which: Optional[tuple] = None,
                 **links_over) -> ServingTiming:
    """Re-time a compiled serving program with the two-stream model on `hardware` (cost_model.HARDWARE,
    topology.LINKS), its collectives priced by which devices share a node (`node_of_devices`).
    Prefill: the attention core as a causal flash kernel, `scores` (score_elements) marks the
    materialised softmax of the naive core as part of it (flash_scores). contention: compute speed
    while a collective is in flight (default the hardware's). which: (Hardware fields, Links fields)
    {name: "low" | "high"} to take at that end of their fitted spread (calibration.SPREAD)."""
    copies = row_copy_ops(schedule)  # before flash_scores renames op_names
    proxy = frozenset(o.id for o in schedule.ops if o.kind == "compute" and USED_EXPERTS in (o.op_name or ""))
    if program == "prefill" and scores:
        schedule = flash_scores(schedule, scores)
    if which:
        fitted = load_fitted()
        nodes = tuple(node_of_devices)
        per = max(nodes.count(x) for x in set(nodes))
        topo = Topology(resized(links_from_fit(hardware, fitted, which[1]), per, **links_over), nodes)
        hw = with_contention(hardware_from_fit(hardware, fitted, which[0]), contention)
    else:
        topo = topology_for(node_of_devices, hardware, **links_over)
        hw = with_contention(HARDWARE[hardware], contention)
    kw = dict(topology=topo, fused_attention=program == "prefill", in_place_updates=True)
    free = OptimizerStep(ops=proxy, pairs=frozenset()) if proxy else None
    sched, durs = simulate(schedule, hw, free=free, **kw)
    rep = analyze(sched, durs, kinds=("all-reduce",), with_bound=False)
    inplace, copy_us = 0.0, 0.0
    if copies:
        copy_us = sum(o.end - o.start for o in sched.ops if o.id in copies)
        s2, d2 = simulate(schedule, hw, free=OptimizerStep(ops=copies | proxy, pairs=frozenset()), **kw)
        inplace = analyze(s2, d2, kinds=("all-reduce",), with_bound=False).step_time
    serial, _ = simulate(schedule, hw, serialize=REDUCTIONS, free=free, **kw)
    ars = [p for p in schedule.pairs if p.collective == "all-reduce"]
    by_role = {r: {"count": 0, "us": 0.0, "hidden_us": 0.0, "bytes": 0.0} for r in ROLES}
    for p, s in zip(ars, rep.stats):
        b = by_role[role_of(p.start.op_name)]
        b["count"] += 1
        b["us"] += s.duration
        b["hidden_us"] += s.hidden
        b["bytes"] += p.bytes
    other = sum(d for p, d in zip(sched.pairs, durs) if p.collective != "all-reduce")
    sync = sum(1 for o in schedule.ops if o.kind == "compute" and o.opcode in COLLECTIVES)
    tot = rep.totals("all")
    lay_us = sum(by_role[r]["us"] for r in LAYER_ROLES)
    lay_hid = sum(by_role[r]["hidden_us"] for r in LAYER_ROLES)
    return ServingTiming(time_us=rep.step_time, serial_us=serial.makespan, compute_us=rep.compute_time,
                         ar_us=tot["duration"], ar_hidden_us=tot["hidden"], layer_ar_us=lay_us,
                         layer_ar_hidden_us=lay_hid, ar_count=len(ars), ar_bytes=float(sum(p.bytes for p in ars)),
                         by_role=by_role, other_collective_us=other, sync_collectives=sync, row_copy_us=copy_us,
                         inplace_us=inplace, compute_by_scope=dict(rep.compute_by_scope))


def extrapolate(a: ServingTiming, la: int, b: ServingTiming, lb: int, layers: int) -> ServingTiming:
    """The figures at `layers` from two depth-cut compiles (la < lb layers): each field
    a + (b - a) (layers - la) / (lb - la); exact when the layers between la and lb are the model's
    repeating layer (the constant holds the embedding, dense layers, LM head)."""
    f = (layers - la) / (lb - la)

    def lin(x, y):
        if isinstance(x, dict):
            return {k: lin(x.get(k, 0.0), y.get(k, 0.0)) for k in set(x) | set(y)}
        return x + (y - x) * f

    da, db = dataclasses.asdict(a), dataclasses.asdict(b)
    if a.inplace_us or b.inplace_us:  # 0 means "no copies" (the time itself)
        da["inplace_us"], db["inplace_us"] = a.time_inplace_us, b.time_inplace_us
    return ServingTiming(**{k: lin(da[k], db[k]) for k in da})


def weight_bytes_per_device(cfg, mesh) -> float:
    """Parameter bytes one device reads in a decode step on the tp_ep layout (its shards of every
    weight; the embedding table is left out when the LM head is separate: a lookup reads b rows).
    Divided by the HBM bandwidth: the weight-bandwidth floor of a small-batch decode step."""
    _, state = abstract_inference_model(cfg, mesh)
    total = 0.0
    for path, x in jax.tree_util.tree_leaves_with_path(state):
        keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
        if "embed" in keys and not cfg.model.tie_embeddings:
            continue
        shard = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        total += float(np.prod(shard)) * np.dtype(x.dtype).itemsize
    return total


def expected_ar_bytes(cfg, batch: int, tokens: int) -> int:
    """Payload of one layer all-reduce: batch x tokens x d_model x bytes of the compute dtype."""
    return batch * tokens * cfg.model.d_model * np.dtype(cfg.runtime.compute_dtype).itemsize


def plot_serving_timelines(items, hardware: str, program: str, layer: int, path: Optional[str] = None,
                           scores: Optional[int] = None, contention: Optional[float] = None):
    """Two-stream timelines of one layer (analysis/timeline.py), one panel per (label, schedule,
    node_of_devices), the all-reduces coloured attention / routed; `scores` as time_serving."""
    panels, names = [], {}
    for label, schedule, nodes in items:
        if program == "prefill" and scores:
            schedule = flash_scores(schedule, scores)
        sched, durs = simulate(schedule, with_contention(HARDWARE[hardware], contention),
                               topology=topology_for(nodes, hardware), fused_attention=program == "prefill",
                               in_place_updates=True)
        panels.append((label, sched, analyze(sched, durs, label=label, kinds=("all-reduce",), with_bound=False)))
        names.update({p.start.name: f"{role_of(p.start.op_name)} all-reduce" for p in schedule.pairs})
    return plot_layer_timelines(panels, layer, "fwd", path, role_of=lambda st: names.get(st.name, "other"),
                                lane="all-reduce")


def format_pair(std: ServingTiming, fs: ServingTiming, what: str) -> str:
    """Standard vs FarSkip for one program, as text."""
    rows = [f"{'':<40}{'standard':>14}{'farskip':>14}",
            f"{what + ' (ms)':<40}{std.time_us / 1e3:>14.3f}{fs.time_us / 1e3:>14.3f}",
            f"{'all-reduces synchronous (ms)':<40}{std.serial_us / 1e3:>14.3f}{fs.serial_us / 1e3:>14.3f}",
            f"{'compute (ms)':<40}{std.compute_us / 1e3:>14.3f}{fs.compute_us / 1e3:>14.3f}",
            f"{'all-reduces (count, ms)':<40}{f'{std.ar_count:.0f}, {std.ar_us / 1e3:.3f}':>14}"
            f"{f'{fs.ar_count:.0f}, {fs.ar_us / 1e3:.3f}':>14}",
            f"{'all-reduce hidden (all / layer)':<40}{f'{100 * std.hidden_frac:.1f}/{100 * std.layer_hidden_frac:.1f}%':>14}"
            f"{f'{100 * fs.hidden_frac:.1f}/{100 * fs.layer_hidden_frac:.1f}%':>14}",
            f"{'ceiling: every all-reduce hidden (ms)':<40}{std.ceiling_us / 1e3:>14.3f}{fs.ceiling_us / 1e3:>14.3f}",
            f"speedup farskip / standard {std.time_us / fs.time_us:.3f}x (vs synchronous all-reduces "
            f"{std.serial_us / fs.time_us:.3f}x; ceiling {std.time_us / std.ceiling_us:.3f}x)"]
    if std.row_copy_us or fs.row_copy_us:  # a scanned program: XLA copies each layer's rows out of the stacks
        rows[2:2] = [f"{'  of which stacked-row copies (ms)':<40}{std.row_copy_us / 1e3:>14.3f}{fs.row_copy_us / 1e3:>14.3f}",
                     f"{'  rows read in place (ms)':<40}{std.time_inplace_us / 1e3:>14.3f}"
                     f"{fs.time_inplace_us / 1e3:>14.3f}"]
        rows.append(f"rows read in place: speedup {std.time_inplace_us / fs.time_inplace_us:.3f}x")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--program", default="prefill", choices=("prefill", "decode"))
    ap.add_argument("--batch", type=int, default=16, help="concurrent requests")
    ap.add_argument("--tokens", type=int, default=1024, help="prefill: prompt length")
    ap.add_argument("--context", type=int, default=2048, help="decode: cache length (tokens)")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--target", default="h200")
    ap.add_argument("--hardware", default="h200", help="two-stream model: h200, h100_sxm, mi300x, mi325x")
    ap.add_argument("--contention", type=float, default=None,
                    help="compute speed while a collective is in flight, fraction (0, 1] (default: the hardware's, "
                         "cost_model.HARDWARE; 1.0 = no contention)")
    ap.add_argument("--layers", type=int, default=None, help="cut the model to this many layers")
    ap.add_argument("--scan-layers", choices=("config", "true", "false"), default="config",
                    help="stacked layers decoded as a scan (serving/generate.py) or per-layer weights unrolled")
    ap.add_argument("overrides", nargs="*", help="config overrides key=value")
    a = ap.parse_args(argv)

    try:
        if a.hardware not in HARDWARE:
            raise FarSkipError(f"--hardware {a.hardware!r} is unknown; choose one of {sorted(HARDWARE)}")
        hw = with_contention(HARDWARE[a.hardware], a.contention)
        base = load_config(a.config, a.overrides)
        devices = gpu_devices(a.target, a.devices, gpus_per_node=min(a.gpus_per_node, a.devices), memory_gb=1e4)
        tokens = a.tokens if a.program == "prefill" else 1
        max_len = a.tokens if a.program == "prefill" else a.context
        out = {}
        for preset in ("standard", "farskip"):
            scan = None if a.scan_layers == "config" else a.scan_layers == "true"
            cfg = serving_config(base, preset, a.devices, a.gpus_per_node, a.layers, scan)
            mesh = serving_mesh(cfg, devices)
            print(f"[inference_report] compiling {a.program} ({preset}, batch {a.batch} x {tokens} tokens, cache "
                  f"{max_len}, mesh {dict(mesh.shape)}, {'scanned' if cfg.runtime.scan_layers else 'per-layer'} "
                  "layers) ...", file=sys.stderr, flush=True)
            prog = compile_serving(cfg, mesh, a.program, a.batch, tokens, max_len)
            out[preset] = time_serving(prog.schedule, node_of(mesh), a.hardware, a.program,
                                       score_elements(cfg, mesh, a.batch, tokens, max_len), a.contention)
    except FarSkipError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"cost model: compute under an all-reduce in flight at {hw.contention:.2f} of its speed (contention; "
          f"default {HARDWARE[a.hardware].contention:.2f} for {a.hardware}, --contention)")
    print(format_pair(out["standard"], out["farskip"], "TTFT" if a.program == "prefill" else "time per output token"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

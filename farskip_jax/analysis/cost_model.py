"""A two-stream cost model for GPUs XLA has no target spec for (MI300X, MI325X), same report.

    sched_mi = simulate(schedule, HARDWARE["mi300x"], ep=8)    # a re-timed copy of the Schedule
    report = analyze(sched_mi, durations=None)                  # hidden fractions under this model

Input: the compiled program's scheduled HLO (hlo.Schedule: the instruction order XLA chose, each
op's FLOPs (dots), bytes read + written, and the async collective start/done pairs).
Model (assumptions, all parameters of `Hardware`):
- one compute stream executes the compute ops in the compiled order; op time =
  launch + max(FLOPs / (peak * matmul_eff), bytes / (hbm_bw * mem_eff))  (roofline per fused kernel);
- one communication stream executes collectives in the order of their starts, one at a time; a
  collective begins at max(its start on the compute stream, end of the previous collective) and
  lasts latency + wire bytes / bandwidth, with wire bytes = payload * (n-1)/n for all-to-all,
  all-gather and reduce-scatter, 2 * payload * (n-1)/n for all-reduce (ring);
- a done blocks the compute stream until its collective has finished; communication kernels do not
  slow the compute kernels down (no SM / HBM contention: an optimistic assumption, see docs);
- ragged all-to-all moves its whole send buffer (an upper bound: the real rows are data dependent);
- `serialize=("all-to-all", ...)` runs those collectives synchronously instead (the compute stream
  waits at the start until the transfer is over): the "no overlap" baseline of the paper's Megatron
  runs, where every all-to-all microsecond is exposed.
A done op's [start, end] is the time the compute stream waits at it (zero when the transfer is over).
The order is the one LHS picked for the compiled target (H100 spec when no ROCm compiler is
present), so this answers "how does this schedule fare on MI300X", not "what would LHS do there".
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from farskip_jax.analysis.hlo import Schedule


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # dense bf16 FLOP/s per GPU
    hbm_bw: float  # bytes/s
    a2a_bw: float  # bytes/s one GPU pushes into the fabric during an all-to-all (algorithm bandwidth)
    coll_bw: float  # bytes/s bus bandwidth of ring collectives (all-reduce, all-gather, ...)
    coll_latency_us: float = 10.0  # fixed cost of one collective
    launch_us: float = 2.0  # fixed cost of one kernel
    matmul_eff: float = 0.7  # achieved / peak FLOP/s of large GEMMs
    mem_eff: float = 0.8  # achieved / peak HBM bandwidth


# Vendor peak numbers; fabric numbers are 7 x 64 GB/s (MI300X/MI325X Infinity Fabric, one direction)
# and 450 GB/s (H100 NVLink 4) derated to ~70% for what RCCL/NCCL all-to-all reach at MB sizes.
HARDWARE = {
    "mi300x": Hardware("MI300X", peak_flops=1307.4e12, hbm_bw=5.3e12, a2a_bw=0.7 * 448e9, coll_bw=0.7 * 448e9),
    "mi325x": Hardware("MI325X", peak_flops=1307.4e12, hbm_bw=6.0e12, a2a_bw=0.7 * 448e9, coll_bw=0.7 * 448e9),
    "h100_sxm": Hardware("H100-SXM", peak_flops=989.4e12, hbm_bw=3.35e12, a2a_bw=0.7 * 450e9, coll_bw=0.7 * 450e9),
    "h200": Hardware("H200", peak_flops=989.4e12, hbm_bw=4.8e12, a2a_bw=0.7 * 450e9, coll_bw=0.7 * 450e9),
}


def compute_time_us(flops: float, bytes_moved: float, hw: Hardware) -> float:
    return hw.launch_us + 1e6 * max(flops / (hw.peak_flops * hw.matmul_eff), bytes_moved / (hw.hbm_bw * hw.mem_eff))


def collective_time_us(kind: str, payload: float, group: int, hw: Hardware) -> float:
    n = max(group, 1)
    frac = (n - 1) / n
    if kind in ("all-to-all", "ragged-all-to-all"):
        return hw.coll_latency_us + 1e6 * payload * frac / hw.a2a_bw
    factor = 2.0 if kind == "all-reduce" else 1.0
    return hw.coll_latency_us + 1e6 * factor * payload * frac / hw.coll_bw


def simulate(schedule: Schedule, hw: Hardware, group_size: int = 8,
             serialize: tuple[str, ...] = (), topology=None,
             own_stream: tuple[str, ...] = ()) -> tuple[Schedule, list[float]]:
    """Re-time `schedule` on `hw` with the two-stream model; collectives whose kind is in `serialize`
    block the compute stream from their start to their end (no overlap). With `topology`
    (analysis/topology.Topology) a collective's time depends on which of its replica-group members
    share a node (intra-node links vs NICs); without, the single-node formula above. Collectives
    whose kind is in `own_stream` (e.g. the gradient all-reduces) run on a second communication
    stream, FIFO among themselves, instead of queueing with the all-to-alls (Megatron's DP and EP
    groups are separate NCCL/RCCL communicators; the two streams do not share bandwidth here, an
    optimistic assumption).

    Returns (the re-timed copy, modelled duration of every entry of `.pairs`)."""
    sched = copy.deepcopy(schedule)
    pair_of_start = {p.start.id: i for i, p in enumerate(sched.pairs)}
    pair_of_done = {p.done.id: i for i, p in enumerate(sched.pairs)}
    durations = [0.0] * len(sched.pairs)
    finish = [0.0] * len(sched.pairs)
    t, comm_free = 0.0, [0.0, 0.0]
    for o in sched.ops:
        if o.kind == "compute":
            o.start, o.end = t, t + compute_time_us(o.flops, o.in_bytes + o.out_bytes, hw)
            t = o.end
        elif o.kind == "start" and o.id in pair_of_start:
            i = pair_of_start[o.id]
            p = sched.pairs[i]
            payload = sched.by_id[p.start.operands[0]].out_bytes if p.collective == "ragged-all-to-all" else p.bytes
            if topology is not None:
                durations[i] = topology.collective_time_us(p.collective, payload, p.groups)
            else:
                durations[i] = collective_time_us(p.collective, payload, p.group_size or group_size, hw)
            lane = 1 if p.collective in own_stream else 0
            begin = max(t, comm_free[lane])
            finish[i] = comm_free[lane] = begin + durations[i]
            o.start = o.end = t
            if p.collective in serialize:  # synchronous: nothing runs under it, its window is empty
                o.start, o.end = t, finish[i]
                t = finish[i]
        elif o.kind == "done" and o.id in pair_of_done:
            i = pair_of_done[o.id]
            if sched.pairs[i].collective in serialize:
                o.start = o.end = finish[i]
                continue
            o.start = t
            t = max(t, finish[i])
            o.end = t
        else:
            o.start = o.end = t
    return sched, durations

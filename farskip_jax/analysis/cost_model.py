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
  lasts latency + wire bytes / (bandwidth x g(payload)), with wire bytes = payload * (n-1)/n for
  all-to-all, all-gather and reduce-scatter, 2 * payload * (n-1)/n for all-reduce (ring); payload =
  the operands' bytes, for an all-gather the gathered buffer (collective_payload); g(S) = S^q /
  (S^q + S_half^q) is the size curve fitted to rccl-tests (size_efficiency; 1 when S_half = 0);
- a done blocks the compute stream until its collective has finished;
- contention: while a collective is in flight (between its begin and end on a communication
  stream) compute runs at `Hardware.contention` of its speed (RCCL/NCCL kernels occupy CUs/SMs and
  HBM bandwidth); only the part of a compute op that overlaps a collective is stretched. With
  `Hardware.contention_comm` < 1 a collective also progresses at that fraction of its speed while
  compute runs (the two streams re-timed together, event by event: simulate's dynamic path). The
  stretch is recorded per op (HloOp.stretch);
- ragged all-to-all moves the smaller of its send and receive buffers (the real rows at perfect
  balance: the dispatch's send buffer, the combine's receive buffer; data dependent otherwise);
- `serialize=("all-to-all", ...)` runs those collectives synchronously instead (the compute stream
  waits at the start until the transfer is over): the "no overlap" baseline of the paper's Megatron
  runs, where every all-to-all microsecond is exposed.
A done op's [start, end] is the time the compute stream waits at it (zero when the transfer is over).
The order is the one LHS picked for the compiled target (H100 spec when no ROCm compiler is
present), so this answers "how does this schedule fare on MI300X", not "what would LHS do there".

Constants: HARDWARE holds the central values fitted to published component measurements
(analysis/calibration_fit.py, calibration_data/fitted.json; sources, spread and residuals in
docs/calibration.md); `hardware_variant(name, which)` gives a constant at its low / high end.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional
import dataclasses

from farskip_jax.analysis.attention_cost import attention_kernels
from farskip_jax.analysis.hlo import Schedule
from farskip_jax.analysis.calibration_fit import load_fitted
from farskip_jax.analysis.scopes import layer_of, scope_of
from farskip_jax.errors import ConfigError


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
    attn_eff: float = 0.5  # achieved / peak FLOP/s of a fused (flash) attention kernel (fused_attention=True)
    contention: float = 1.0  # compute speed while a collective is in flight / its speed alone (1 = none)
    contention_comm: float = 1.0  # a collective's speed while compute runs / its speed alone (1 = none)
    coll_size_half: float = 0.0  # bytes at which the size curve g(S) reaches half its bandwidth (0: no curve)
    coll_size_q: float = 1.0  # exponent of the size curve g(S) = S^q / (S^q + S_half^q)


# Vendor peaks (calibration_data/components.json "peaks"); every efficiency, bandwidth, latency and
# contention is the central value fitted to published component measurements
# (analysis/calibration_fit.py -> calibration_data/fitted.json; docs/calibration.md has the sources,
# spread and residuals).
PEAKS = {"mi300x": ("MI300X", 1307.4e12, 5.3e12), "mi325x": ("MI325X", 1307.4e12, 6.0e12),
         "h100_sxm": ("H100-SXM", 989.4e12, 3.35e12), "h200": ("H200", 989.4e12, 4.8e12)}
FITTED_FIELDS = ("matmul_eff", "mem_eff", "attn_eff", "launch_us", "contention", "contention_comm", "coll_bw",
                 "a2a_bw", "coll_latency_us", "coll_size_half", "coll_size_q")


def hardware_from_fit(name: str, fitted: dict, which: Optional[dict] = None) -> Hardware:
    """Hardware `name` with every FITTED_FIELDS constant at its central value in `fitted`
    (calibration_fit.load_fitted()), except those named in `which` ({constant: "low" | "high"})."""
    label, peak, hbm = PEAKS[name]
    f = fitted[name]
    which = which or {}
    vals = {k: float(f[k][which.get(k, "value")]) for k in FITTED_FIELDS}
    return Hardware(label, peak_flops=peak, hbm_bw=hbm, **vals)


def _hardware_table() -> dict:
    fitted = load_fitted()
    return {name: hardware_from_fit(name, fitted) for name in PEAKS}


HARDWARE = _hardware_table()


def hardware_variant(name: str, which: Optional[dict] = None) -> Hardware:
    """HARDWARE[name] with the constants named in `which` at their fitted low / high end."""
    return hardware_from_fit(name, load_fitted(), which)


def with_contention(hw: Hardware, contention: Optional[float]) -> Hardware:
    """`hw` with its contention replaced, of compute and of communication alike (None: unchanged);
    ConfigError outside (0, 1]."""
    if contention is None:
        return hw
    if not 0.0 < contention <= 1.0:
        raise ConfigError(f"contention {contention} must be in (0, 1]: the fraction of its speed compute keeps "
                          "while a collective is in flight (1.0 = no contention)")
    return dataclasses.replace(hw, contention=float(contention), contention_comm=float(contention))


CAUSAL_FRACTION = 0.5  # share of the [s, s] score blocks a causal flash kernel computes
FLASH_BWD_RECOMPUTE = 1.25  # flash backward: 5 GEMMs (QK^T recomputed, dV, dP, dQ, dK) vs the 4 of plain autodiff


def fused_attention_us(flops: float, nbytes: float, direction: str, hw: Hardware) -> float:
    """One attention core priced as a causal flash kernel (analysis/attention_cost.py groups the
    compiled ops into such kernels): its compiled dot FLOPs x the causal fraction (x the recompute
    factor backward) at attn_eff of peak, or its bytes at the HBM bandwidth, whichever is longer."""
    f = flops * CAUSAL_FRACTION * (FLASH_BWD_RECOMPUTE if direction == "bwd" else 1.0)
    return hw.launch_us + 1e6 * max(f / (hw.peak_flops * hw.attn_eff), nbytes / (hw.hbm_bw * hw.mem_eff))


UNFUSED_FWD_PASSES = 4  # score-sized HBM passes of an unfused core forward: QK^T writes S, softmax reads S writes P, PV reads P
UNFUSED_BWD_PASSES = 7  # backward: dP written, softmax-backward reads P, dP writes dS, dV reads P, dQ and dK read dS
UNFUSED_FWD_KERNELS, UNFUSED_BWD_KERNELS = 3, 5
SCORE_BYTES = 2  # bf16 scores / probabilities (Megatron's fused scale-mask-softmax keeps them in the compute dtype)


def unfused_attention_us(flops: float, nbytes: float, direction: str, hw: Hardware, flops_per_score: float) -> float:
    """One attention core priced as an unfused kernel chain (Megatron's local core attention: no
    flash kernel): its GEMMs' compiled FLOPs (the full [t, s] scores) at matmul_eff, plus the scores
    moved through HBM: UNFUSED_FWD_PASSES (fwd) / UNFUSED_BWD_PASSES (bwd) passes of E elements, E =
    FLOPs / flops_per_score forward (flops_per_score = 2 (qk head dim + v head dim)), half that
    per FLOP backward (4 GEMMs to the forward's 2), plus the kernel's q, k, v, O (dO, dQ, dK, dV) bytes."""
    if direction == "bwd":
        scores, passes, kernels = flops / (2.0 * flops_per_score), UNFUSED_BWD_PASSES, UNFUSED_BWD_KERNELS
    else:
        scores, passes, kernels = flops / flops_per_score, UNFUSED_FWD_PASSES, UNFUSED_FWD_KERNELS
    moved = nbytes + passes * scores * SCORE_BYTES
    return kernels * hw.launch_us + 1e6 * (flops / (hw.peak_flops * hw.matmul_eff) + moved / (hw.hbm_bw * hw.mem_eff))


def in_place_update(o) -> bool:
    """An op that writes a slice of a buffer in place (dynamic-update-slice, alone or as the root of a
    fusion: a KV-cache write): it moves the update, not the buffer."""
    last = (o.op_name or "").rsplit("/", 1)[-1]
    return o.opcode == "dynamic-update-slice" or (o.opcode == "fusion" and last.startswith("dynamic_update_slice"))


def moved_bytes(o, in_place_updates: bool = False) -> float:
    """Bytes an op reads + writes; an in-place update (in_place_update) moves its update twice (read,
    write) instead of the whole buffer in and out."""
    if in_place_updates and in_place_update(o) and o.in_bytes >= o.out_bytes:
        return 2.0 * (o.in_bytes - o.out_bytes)
    return o.in_bytes + o.out_bytes


def compute_time_us(flops: float, bytes_moved: float, hw: Hardware) -> float:
    return hw.launch_us + 1e6 * max(flops / (hw.peak_flops * hw.matmul_eff), bytes_moved / (hw.hbm_bw * hw.mem_eff))


def flash_attention_times(schedule: Schedule, hw, in_place_updates: bool = False,
                          unfused_flops_per_score: Optional[float] = None) -> dict[int, float]:
    """{op id: modelled us} of every attention_core compute op: its kernel's time (
    fused_attention_us, or unfused_attention_us when `unfused_flops_per_score` is given; 0 for a
    kernel without dots) spread over its ops in proportion to their compiled roofline times
    (cost_model.compute_time_us; `in_place_updates` as cost_model.moved_bytes)."""
    out: dict[int, float] = {}
    for k in attention_kernels(schedule):
        if k.flops <= 0:
            t = 0.0
        elif unfused_flops_per_score:
            t = unfused_attention_us(k.flops, k.bytes, k.direction, hw, unfused_flops_per_score)
        else:
            t = fused_attention_us(k.flops, k.bytes, k.direction, hw)
        naive = {i: compute_time_us(schedule.by_id[i].flops, moved_bytes(schedule.by_id[i], in_place_updates), hw)
                 for i in k.ops}
        total = sum(naive.values())
        for i in k.ops:
            out[i] = t * naive[i] / total if total > 0 else 0.0
    return out


def size_efficiency(payload: float, half: float, q: float) -> float:
    """g(S) = S^q / (S^q + half^q): the share of its large-message bandwidth a collective of S bytes
    per device reaches (fitted to rccl-tests, calibration_fit.fit_allreduce); 1 when half <= 0."""
    if half <= 0.0 or payload <= 0.0:
        return 1.0
    return payload ** q / (payload ** q + half ** q)


def collective_time_us(kind: str, payload: float, group: int, hw: Hardware) -> float:
    n = max(group, 1)
    frac = (n - 1) / n
    g = size_efficiency(payload, hw.coll_size_half, hw.coll_size_q)
    if kind in ("all-to-all", "ragged-all-to-all"):
        return hw.coll_latency_us + 1e6 * payload * frac / (hw.a2a_bw * g)
    factor = 2.0 if kind == "all-reduce" else 1.0
    return hw.coll_latency_us + 1e6 * factor * payload * frac / (hw.coll_bw * g)


@dataclass(frozen=True)
class OptimizerStep:
    """What a train step does once per step, not once per micro-batch: op ids of the parameter
    update and pair indices (into schedule.pairs) of the gradient reductions."""

    ops: frozenset
    pairs: frozenset


def optimizer_step(schedule: Schedule) -> OptimizerStep:
    """The parameter update = compute ops of the step outside the loss and its gradient (their
    op_name has neither `jvp(` nor `transpose(`, e.g. `jit(step)/sub`); gradient reductions =
    reductions (all-reduce, reduce-scatter) whose result reaches no layer computation and no other
    collective (it only feeds the update). An all-reduce inside a layer (Federation of Experts'
    cross-group sum, forward or backward) feeds the next layer's work and is not one."""
    consumers: dict[int, list] = {}
    for o in schedule.ops:
        for x in o.operands:
            consumers.setdefault(x, []).append(o)

    def feeds_work(op_id: int) -> bool:
        seen, stack = set(), [op_id]
        while stack:
            for c in consumers.get(stack.pop(), []):
                if c.id in seen:
                    continue
                seen.add(c.id)
                if c.kind == "start" or (c.kind == "compute" and layer_of(c.op_name) is not None):
                    return True
                stack.append(c.id)
        return False

    ops = frozenset(o.id for o in schedule.ops if o.kind == "compute" and o.op_name
                    and "jvp(" not in o.op_name and "transpose(" not in o.op_name)
    pairs = frozenset(i for i, p in enumerate(schedule.pairs)
                      if p.collective in ("all-reduce", "reduce-scatter") and not feeds_work(p.done.id))
    return OptimizerStep(ops, pairs)


def ragged_payload(schedule: Schedule, pair) -> float:
    """Bytes a ragged all-to-all moves per device, modelled at perfect balance: the smaller of its
    send buffer (operand 0) and its receive buffer (operand 1). The dispatch sends its exact rows from
    a worst-case receive buffer, the combine sends from that worst-case buffer into the exact rows;
    either way the real rows are the smaller buffer (data dependent otherwise)."""
    sizes = [schedule.by_id[x].out_bytes for x in pair.start.operands[:2] if x in schedule.by_id]
    return float(min(sizes)) if sizes else float(pair.bytes)


def collective_payload(schedule: Schedule, pair, group_size: int) -> float:
    """The bytes per device a collective's time formula takes: its operands' bytes (the buffer an
    all-reduce / reduce-scatter reduces, an all-to-all exchanges), except an all-gather, whose operand
    is the device's shard: the gathered buffer (operands x group size) is what it moves (n-1)/n of;
    a ragged all-to-all: ragged_payload."""
    if pair.collective == "ragged-all-to-all":
        return ragged_payload(schedule, pair)
    if pair.collective == "all-gather":
        return float(pair.bytes) * max(pair.group_size or group_size, 1)
    return float(pair.bytes)


def stretched_end(t: float, work: float, busy: list, speed: float) -> float:
    """End of `work` us of compute begun at t that runs at `speed` of its pace inside the intervals
    `busy` (sorted, disjoint (begin, end): a collective in flight) and at full pace outside them."""
    if speed >= 1.0 or work <= 0.0:
        return t + work
    cur = t
    for a, b in busy:
        if b <= cur:
            continue
        if a > cur:
            if work <= a - cur:
                return cur + work
            work -= a - cur
            cur = a
        if work <= (b - cur) * speed:
            return cur + work / speed
        work -= (b - cur) * speed
        cur = b
    return cur + work


def _union(intervals) -> list:
    out: list = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def simulate(schedule: Schedule, hw: Hardware, group_size: int = 8,
             serialize: tuple[str, ...] = (), topology=None,
             own_stream: tuple[str, ...] = (), fused_attention: bool = False,
             free: Optional["OptimizerStep"] = None, in_place_updates: bool = False,
             contention: Optional[float] = None, unfused_attention: Optional[float] = None,
             imbalance: float = 1.0, contention_comm: Optional[float] = None) -> tuple[Schedule, list[float]]:
    """Re-time `schedule` on `hw` with the two-stream model; collectives whose kind is in `serialize`
    block the compute stream from their start to their end (no overlap). With `topology`
    (analysis/topology.Topology) a collective's time depends on which of its replica-group members
    share a node (intra-node links vs NICs); without, the single-node formula above. Collectives
    whose kind is in `own_stream` (e.g. the gradient all-reduces) run on a second communication
    stream, FIFO among themselves, instead of queueing with the all-to-alls (Megatron's DP and EP
    groups are separate NCCL/RCCL communicators; the two streams do not share bandwidth here, an
    optimistic assumption). `fused_attention` prices each layer's `attention_core` as one causal
    flash kernel per pass (analysis/attention_cost.py) instead of the compiled kernels (the naive
    core's materialised [s, s] scores); `unfused_attention` (FLOPs per score element forward, 2 (qk
    + v head dims)) prices it as an unfused kernel chain instead (unfused_attention_us). `free`
    (optimizer_step(schedule)) prices the gradient reductions and the parameter update at zero: the
    steady state of gradient accumulation over many micro-batches, where they run once per step.
    `in_place_updates` prices a dynamic-update-slice (a KV-cache write) at its update's bytes
    (moved_bytes) instead of the whole buffer in and out. `contention`: compute speed while a
    collective is in flight (default hw.contention); `contention_comm`: a collective's speed while
    compute runs (default hw.contention_comm); 1.0 = none.
    `imbalance` (>= 1, default 1 = balanced): the busiest device's expert load / the mean; the
    expert_compute ops and the all-to-all payloads scale with it (the busiest device sets the pace).

    Returns (the re-timed copy, modelled duration of every entry of `.pairs`: alone, without
    contention)."""
    sched = copy.deepcopy(schedule)
    speed = with_contention(hw, contention).contention
    comm_speed = with_contention(hw, contention_comm).contention_comm if contention_comm is not None \
        else hw.contention_comm
    pair_of_start = {p.start.id: i for i, p in enumerate(sched.pairs)}
    pair_of_done = {p.done.id: i for i, p in enumerate(sched.pairs)}
    durations = [0.0] * len(sched.pairs)
    free_ops = free.ops if free is not None else frozenset()
    free_pairs = free.pairs if free is not None else frozenset()
    attn = {}
    if fused_attention or unfused_attention:
        attn = flash_attention_times(sched, hw, in_place_updates, unfused_attention)
    n_all = len(topology.node_of) if topology is not None else group_size

    def duration_of(i: int) -> float:
        p = sched.pairs[i]
        if i in free_pairs:
            return 0.0
        payload = collective_payload(sched, p, n_all)
        if imbalance != 1.0 and p.collective in ("all-to-all", "ragged-all-to-all"):
            payload *= imbalance
        if topology is not None:
            return topology.collective_time_us(p.collective, payload, p.groups)
        return collective_time_us(p.collective, payload, p.group_size or group_size, hw)

    def work_of(o) -> float:
        w = attn[o.id] if o.id in attn else compute_time_us(o.flops, moved_bytes(o, in_place_updates), hw)
        if imbalance != 1.0 and scope_of(o.op_name) == "expert_compute":
            w *= imbalance
        return w

    if comm_speed < 1.0:
        return _simulate_coupled(sched, durations, pair_of_start, pair_of_done, duration_of, work_of, free_ops,
                                 serialize, own_stream, speed, comm_speed)
    finish = [0.0] * len(sched.pairs)
    t, comm_free = 0.0, [0.0, 0.0]
    flight: list = []  # (begin, end) of collectives not over at t
    busy: list = []  # their union
    for o in sched.ops:
        if o.kind == "compute" and o.id in free_ops:
            o.start = o.end = t
        elif o.kind == "compute":
            work = work_of(o)
            if any(e <= t for _, e in flight):  # drop the collectives over by now
                flight = [iv for iv in flight if iv[1] > t]
                busy = _union(flight)
            o.start, o.end = t, stretched_end(t, work, busy, speed)
            o.stretch = o.end - o.start - work
            t = o.end
        elif o.kind == "start" and o.id in pair_of_start:
            i = pair_of_start[o.id]
            p = sched.pairs[i]
            durations[i] = duration_of(i)
            lane = 1 if p.collective in own_stream else 0
            begin = max(t, comm_free[lane])
            finish[i] = comm_free[lane] = begin + durations[i]
            if finish[i] > begin and speed < 1.0:
                flight.append((begin, finish[i]))
                busy = _union(flight)
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


def _simulate_coupled(sched, durations, pair_of_start, pair_of_done, duration_of, work_of, free_ops,
                      serialize, own_stream, speed: float, comm_speed: float):
    """simulate's path where compute and communication slow each other: time advances event by
    event; while a compute op runs, the collective at the head of each stream progresses at
    comm_speed and the op at `speed` (if any collective is in flight, else 1); while the compute
    stream waits at a done (or a serialised collective), collectives progress at full speed."""
    eps = 1e-9
    lanes: list[list] = [[], []]  # per stream: [[pair index, remaining us], ...] in FIFO order
    finish: dict[int, float] = {}
    t = 0.0

    def advance(dt: float, rate: float) -> None:
        nonlocal t
        for lane in lanes:
            if lane:
                lane[0][1] -= rate * dt
        t += dt
        for lane in lanes:
            while lane and lane[0][1] <= eps:
                finish[lane.pop(0)[0]] = t

    def head_time(rate: float) -> float:
        return min((lane[0][1] / rate for lane in lanes if lane), default=float("inf"))

    def wait_for(i: int) -> None:
        while i not in finish:
            advance(head_time(1.0), 1.0)

    for o in sched.ops:
        if o.kind == "compute" and o.id in free_ops:
            o.start = o.end = t
        elif o.kind == "compute":
            work = work_of(o)
            o.start, left = t, work
            while left > eps:
                busy = any(lanes)
                s = speed if busy else 1.0
                dt = min(left / s, head_time(comm_speed))
                left -= s * dt
                advance(dt, comm_speed)
            o.end = t
            o.stretch = o.end - o.start - work
        elif o.kind == "start" and o.id in pair_of_start:
            i = pair_of_start[o.id]
            p = sched.pairs[i]
            durations[i] = duration_of(i)
            o.start = o.end = t
            if durations[i] <= 0.0:
                finish[i] = t
            else:
                lanes[1 if p.collective in own_stream else 0].append([i, durations[i]])
            if p.collective in serialize:
                wait_for(i)
                o.end = t
        elif o.kind == "done" and o.id in pair_of_done:
            i = pair_of_done[o.id]
            o.start = t
            wait_for(i)
            o.end = t
            if sched.pairs[i].collective in serialize:
                o.start = o.end
        else:
            o.start = o.end = t
    return sched, durations

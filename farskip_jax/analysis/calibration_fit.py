"""The cost model's constants fitted to published component measurements, and to nothing else.

    fits = fit_constants(load_components())       # {hardware: {constant: Fitted}}
    fits["mi300x"]["matmul_eff"].value, .low, .high, .sources

Input: calibration_data/components.json (each measurement with its source and setting). Per
hardware and constant the fit gives a central value, a low-high spread over the independent sources,
and each source's residual (its value / the central value - 1):

    matmul_eff     max-achievable BF16 GEMM / peak: median of the sources, spread = min..max
    attn_eff       flash attention forward FLOP/s / peak: H100 from FlashAttention-3 figures, H200 the
                   same (same SMs); MI300X / MI325X derived: H100's x (their matmul_eff / H100's),
                   since no CK / aiter figure was confirmed (stated in docs/calibration.md)
    coll_bw, coll_latency_us, coll_size_half, coll_size_q
                   all-reduce time = latency + 2 (n-1)/n S / (coll_bw g(S)), g(S) = S^q / (S^q + S_h^q):
                   least squares in log time to rccl-tests' 8-GPU points (MI300X), the bus bandwidth at most
                   the usable xGMI aggregate (7 x 48 GB/s, AMD's RCCL / xGMI blog); NVIDIA: busBw of
                   nccl-tests at large sizes, latency and curve shape borrowed from the MI300X fit
    a2a_bw         intra-node all-to-all bandwidth per GPU: TransferBench (MI300X / MI325X); NVIDIA:
                   the effective NVLink busBw of non-all-reduce collectives
    intra_eff, inter_eff
                   link efficiencies of analysis/topology.Links: a2a_bw / line rate; DeepEP V1's
                   RDMA bottleneck bandwidth / the CX7 NIC's 50 GB/s (H800's NIC = H100's)
    contention, contention_comm
                   AMD: from the realised share r of the ideal compute-communication overlap speedup
                   (arXiv 2412.14335): a GEMM and a collective of equal length T, both slowed to speed
                   k while they overlap, take T / k = 2T / (1 + r), so k = (1 + r) / 2, for compute
                   and communication alike; NVIDIA: compute speed 1 / (1 + slowdown) (arXiv
                   2507.03114), communication unslowed (no measurement)
    mem_eff, launch_us
                   NOT fitted (no measurement confirmed): kept at 0.8 (0.7-0.9) and 2 us, flagged
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
from scipy.optimize import least_squares

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration_data")
HARDWARE_NAMES = ("mi300x", "mi325x", "h100_sxm", "h200")
LINE_RATE_INTRA = {"mi300x": 7 * 64e9, "mi325x": 7 * 64e9, "h100_sxm": 450e9, "h200": 450e9}
NIC_BW = 400e9 / 8  # bytes/s of a 400 Gb/s NIC (CX7 / Pollara 400)
MIB = 2**20


@dataclass(frozen=True)
class Fitted:
    """One fitted constant: its central value, its spread over the independent sources, and each
    source as (value, residual = value / central - 1, source text)."""

    value: float
    low: float
    high: float
    sources: tuple = field(default_factory=tuple)
    fitted: bool = True  # False: no measurement behind it (an assumption, flagged)
    note: str = ""


def load_components(path: Optional[str] = None) -> dict:
    with open(path or os.path.join(DATA_DIR, "components.json")) as f:
        return json.load(f)


def _spread(values: list[float], texts: list[str], note: str = "") -> Fitted:
    vs = sorted(values)
    n = len(vs)
    mid = vs[n // 2] if n % 2 else 0.5 * (vs[n // 2 - 1] + vs[n // 2])
    return Fitted(mid, vs[0], vs[-1], tuple((v, v / mid - 1.0, t) for v, t in zip(values, texts)), True, note)


def _scaled(f: Fitted, k: float, note: str) -> Fitted:
    return Fitted(f.value * k, f.low * k, f.high * k, f.sources, f.fitted, note)


def allreduce_time_us(size_bytes, n: int, lat_us: float, bw: float, s_half: float, q: float):
    """The fitted all-reduce curve: lat + 2 (n-1)/n S / (bw g(S)), g(S) = S^q / (S^q + s_half^q)."""
    g = size_bytes ** q / (size_bytes ** q + s_half ** q)
    return lat_us + 1e6 * 2.0 * (n - 1) / n * size_bytes / (bw * g)


def fit_allreduce(sizes_bytes: list[float], times_us: list[float], n: int, bw_max: float) -> dict:
    """Least squares in log time of allreduce_time_us to measured points, the bus bandwidth at most
    `bw_max` (what the links can carry): {lat_us, bw, s_half, q, residuals (measured / modelled - 1)}."""
    s = np.asarray(sizes_bytes, float)
    t = np.asarray(times_us, float)

    def resid(p):
        lat, logbw, logsh, q = p
        return np.log(allreduce_time_us(s, n, lat, math.exp(logbw), math.exp(logsh), q)) - np.log(t)

    r = least_squares(resid, x0=[10.0, math.log(300e9), math.log(4 * MIB), 1.0],
                      bounds=([0.0, math.log(1e9), math.log(1e3), 0.1], [200.0, math.log(bw_max), math.log(1e10), 3.0]))
    lat, logbw, logsh, q = r.x
    model = allreduce_time_us(s, n, lat, math.exp(logbw), math.exp(logsh), q)
    return {"lat_us": float(lat), "bw": float(math.exp(logbw)), "s_half": float(math.exp(logsh)), "q": float(q),
            "residuals": [float(a / b - 1.0) for a, b in zip(t, model)]}


def fit_constants(comp: dict) -> dict[str, dict[str, Fitted]]:
    """{hardware: {constant: Fitted}} for HARDWARE_NAMES (module doc)."""
    out: dict[str, dict[str, Fitted]] = {h: {} for h in HARDWARE_NAMES}
    peaks = comp["peaks"]
    for h in HARDWARE_NAMES:
        srcs = comp["gemm_bf16"][h]
        out[h]["matmul_eff"] = _spread([s["tflops"] * 1e12 / peaks[h]["bf16_flops"] for s in srcs],
                                       [s["source"] + ("" if s["confirmed"] else " [as quoted, unconfirmed]")
                                        for s in srcs])
        out[h]["mem_eff"] = Fitted(0.8, 0.7, 0.9, (), False, comp["hbm"]["note"])
        out[h]["launch_us"] = Fitted(2.0, 2.0, 2.0, (), False, comp["launch"]["note"])
    att = comp["attention_fwd"]["h100_sxm"]
    a100 = _spread([s["tflops"] * 1e12 / peaks["h100_sxm"]["bf16_flops"] for s in att], [s["source"] for s in att])
    out["h100_sxm"]["attn_eff"] = a100
    out["h200"]["attn_eff"] = _scaled(a100, 1.0, "H100's FlashAttention-3 figures (same SMs and clocks)")
    for h in ("mi300x", "mi325x"):
        k = out[h]["matmul_eff"].value / out["h100_sxm"]["matmul_eff"].value
        out[h]["attn_eff"] = _scaled(a100, k, f"derived: H100's flash-attention efficiency x (this GPU's GEMM "
                                              f"efficiency / H100's) = x {k:.3f}; no CK / aiter figure confirmed")
    # collectives inside a node
    ar = comp["allreduce_intra"]["mi300x"]
    usable = comp["link_eff_intra"]["mi300x"][0]["value"] * LINE_RATE_INTRA["mi300x"]  # 7 x 48 GB/s of xGMI
    f = fit_allreduce([m * MIB for m in ar["sizes_mib"]], ar["time_us"], ar["gpus"], usable)
    worst = max(abs(r) for r in f["residuals"])
    src = ar["source"] + ("" if ar["confirmed"] else " [as quoted, unconfirmed]")
    res = tuple((t, r, f"{m} MiB: {t} us") for m, t, r in zip(ar["sizes_mib"], ar["time_us"], f["residuals"]))
    for h in ("mi300x", "mi325x"):
        note = src if h == "mi300x" else "MI300X's rccl-tests fit (same Infinity Fabric links and RCCL)"
        out[h]["coll_bw"] = Fitted(f["bw"], f["bw"] * (1 - worst), min(f["bw"] * (1 + worst), usable), res, True, note)
        out[h]["coll_latency_us"] = Fitted(f["lat_us"], f["lat_us"], f["lat_us"], res, True, note)
        out[h]["coll_size_half"] = Fitted(f["s_half"], f["s_half"], f["s_half"], res, True, note)
        out[h]["coll_size_q"] = Fitted(f["q"], f["q"], f["q"], res, True, note)
        a2a = comp["alltoall_intra"]["mi300x"][0]
        lo, hi = a2a["range"]
        tb = a2a["source"] + ("" if a2a["confirmed"] else " [as quoted, unconfirmed]")
        out[h]["a2a_bw"] = Fitted(a2a["gbs"] * 1e9, lo * 1e9, hi * 1e9, ((a2a["gbs"] * 1e9, 0.0, tb),), True, tb)
        link = comp["link_eff_intra"]["mi300x"][0]
        eff = a2a["gbs"] * 1e9 / LINE_RATE_INTRA[h]
        out[h]["intra_eff"] = Fitted(eff, lo * 1e9 / LINE_RATE_INTRA[h], link["value"],
                                     ((eff, 0.0, tb), (link["value"], link["value"] / eff - 1, link["source"])), True,
                                     "TransferBench all-to-all / 7 x 64 GB/s; high: the usable xGMI link rate")
    for h in ("h100_sxm", "h200"):
        m = comp["allreduce_intra"][h]
        bw = m["busbw_gbs"] * 1e9
        others = [comp["allreduce_intra"][x]["busbw_gbs"] * 1e9 for x in ("h100_sxm", "h200")]
        out[h]["coll_bw"] = Fitted(bw, min(others), max(others), tuple((v, v / bw - 1, comp["allreduce_intra"][x]["source"])
                                                                      for v, x in zip(others, ("h100_sxm", "h200"))),
                                   True, m["source"])
        for k in ("coll_latency_us", "coll_size_half", "coll_size_q"):
            base = out["mi300x"][k]
            out[h][k] = Fitted(base.value, base.low, base.high, base.sources, True,
                               "borrowed from MI300X's rccl-tests fit (no small-size nccl-tests figure confirmed)")
        link = comp["link_eff_intra"]["h100_sxm"][0]
        e = link["value"]
        out[h]["intra_eff"] = Fitted(e, e, e, ((e, 0.0, link["source"]),), True, link["source"])
        out[h]["a2a_bw"] = Fitted(e * LINE_RATE_INTRA[h], e * LINE_RATE_INTRA[h], e * LINE_RATE_INTRA[h],
                                  ((e * LINE_RATE_INTRA[h], 0.0, link["source"]),), True, link["source"])
    # across nodes: DeepEP V1 (H800 + CX7 400 Gb/s; the NIC path is the same on H100 / MI325X nodes)
    inter = comp["alltoall_inter"]
    ep16 = next(x for x in inter if x["ep"] == 16)
    phys = [x for x in inter if x["gbs"] <= NIC_BW / 1e9]  # above line rate = logical (deduplicated) bytes
    vals = [x["gbs"] * 1e9 / NIC_BW for x in phys]
    lo_ll = [0.78, 0.96]  # DeepEP V1 low-latency kernels: 39 GB/s (EP 128-256) .. 48 GB/s (EP 32)
    for h in HARDWARE_NAMES:
        out[h]["inter_eff"] = Fitted(ep16["gbs"] * 1e9 / NIC_BW, min(vals + lo_ll[:1]), lo_ll[1],
                                     tuple((x["gbs"] * 1e9 / NIC_BW, x["gbs"] * 1e9 / NIC_BW / (ep16["gbs"] * 1e9 / NIC_BW) - 1,
                                            x["source"]) for x in phys),
                                     True, "DeepEP V1 normal kernels, EP 16 (43 GB/s of a 50 GB/s CX7); spread: its "
                                           "low-latency kernels' 39-48 GB/s")
    # contention
    amd = comp["contention"]["amd"]
    ks = [(1.0 + s["realised_fraction"]) / 2.0 for s in amd]
    texts = [s["source"] + ("" if s["confirmed"] else " [as quoted, unconfirmed]") for s in amd]
    for h in ("mi300x", "mi325x"):
        c = Fitted(ks[0], min(ks), max(ks), tuple((k, k / ks[0] - 1, t) for k, t in zip(ks, texts)), True,
                   "central: untuned (RCCL defaults, as Megatron / XLA run it); high: tuned; k = (1 + r) / 2")
        out[h]["contention"] = c
        out[h]["contention_comm"] = c
    nv = comp["contention"]["nvidia"]
    speeds = [1.0 / (1.0 + s["compute_slowdown"]) for s in nv]
    nvf = _spread(speeds, [s["source"] for s in nv])
    for h in ("h100_sxm", "h200"):
        out[h]["contention"] = nvf
        out[h]["contention_comm"] = Fitted(1.0, nvf.low, 1.0, (), False,
                                           "no measurement of NCCL slowed by compute: 1.0 (unslowed); low: as compute")
    return out


def fitted_json(fits: dict[str, dict[str, Fitted]]) -> dict:
    """A JSON-serialisable form of fit_constants' result (calibration_data/fitted.json)."""
    return {h: {k: {"value": f.value, "low": f.low, "high": f.high, "fitted": f.fitted, "note": f.note,
                    "sources": [[v, r, t] for v, r, t in f.sources]} for k, f in d.items()} for h, d in fits.items()}


def load_fitted(path: Optional[str] = None) -> dict:
    """calibration_data/fitted.json (written by `python -m farskip_jax.analysis.calibration --fit`)."""
    with open(path or os.path.join(DATA_DIR, "fitted.json")) as f:
        return json.load(f)

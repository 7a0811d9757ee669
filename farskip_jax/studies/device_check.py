"""What only a GPU can show, in one command under 5 minutes on one CUDA or ROCm GPU.

    python -m farskip_jax.studies.device_check                    # one GPU: the real measurements
    python -m farskip_jax.studies.device_check --smoke            # any backend (CI: CPU), tiny shapes, seconds
    python -m farskip_jax.studies.device_check --parts a,c --out benchmarks/results/device_check

(a) train step: DeepSeek-V2-Lite at its real widths, depth cut to --layers (1 dense + MoE layers), bf16
    compute, fp32 master weights, AdamW, one device (no expert parallelism): standard vs farskip vs
    Federation of Experts (2 groups; FoE needs GQA, so its attention is GQA 16 x 128 in place of MLA):
    tokens/s and MFU (flops.train_flops_per_token over the device's dense bf16 peak).
(b) grouped GEMM at the expert shapes ([tokens x top_k, 2048] x [G, 2048, 1408], G = 64 local experts
    at EP 1 and 8 at EP 8): jax.lax.ragged_dot and the project's `tiled` backend vs a dense
    [M, K] x [K, N] dot of the same useful FLOPs, forward and forward+backward.
(c) op classes (dense GEMM, grouped GEMM, naive / fused attention core, RMSNorm, tiny-kernel launch)
    measured next to the two-stream cost model's prediction (analysis/cost_model.py) for the same op,
    and the constants refitted from the measurements in the cost model's names (matmul_eff,
    mem_eff, attn_eff, launch_us; grouped_gemm_eff has no field there yet). All-to-all cannot be
    measured on one GPU: its entry carries the model's prediction only.
(d) attention fwd+bwd at DeepSeek/Qwen-like shapes: naive (model.attention.attention_core),
    blockwise (the flash-style core with a custom VJP), jax.nn.dot_product_attention with XLA's
    implementation and with cuDNN (CUDA only).

Writes <out>/device_check.json (schema below, `SCHEMA_VERSION`) and prints one table per part. Timings
are medians of repeated runs after a warm-up (compile excluded and reported separately).
"""

from __future__ import annotations

import argparse
import json
import os
import platform as _platform
import statistics
import sys
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from farskip_jax.studies.harness import REPO, results_dir
from farskip_jax.analysis.cost_model import HARDWARE, Hardware
from farskip_jax.train.flops import measure_matmul_peak
from farskip_jax.config import load_config
from farskip_jax.parallel.build import create_model
from farskip_jax.parallel.mesh import make_mesh
from farskip_jax.parallel.sharding import place_state, shard_batch
from farskip_jax.train.flops import train_flops_per_token
from farskip_jax.loading.optimizer import make_optimizer
from farskip_jax.loading.train_state import init_state
from farskip_jax.train.step import make_train_step
from farskip_jax.kernels.gmm import gmm
from farskip_jax.analysis.cost_model import CAUSAL_FRACTION, FLASH_BWD_RECOMPUTE, collective_time_us, compute_time_us
from farskip_jax.kernels.attention import attention_core, blockwise_attention_core
from farskip_jax.model.attention import attention_mask

SCHEMA_VERSION = 1
PARTS = ("a", "b", "c", "d")
DSV2_LITE = "configs/deepseek_v2_lite.yaml"


# --------------------------------------------------------------------------------------------------
# timing and hardware
# --------------------------------------------------------------------------------------------------


def bench(fn: Callable, *args, reps: int = 10, min_s: float = 0.0) -> dict:
    """Median wall time (us) of fn(*args) after one warm-up call (whose time = compile + first run)."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    times = []
    t_end = time.perf_counter() + min_s
    while len(times) < reps or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return dict(us=1e6 * statistics.median(times), min_us=1e6 * min(times), reps=len(times), first_s=first)


def measure_bandwidth(n_bytes: int, reps: int) -> float:
    """Achieved bytes/s of an elementwise scale (read + write n_bytes each) on the default device."""
    x = jnp.ones((n_bytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0001)
    t = bench(f, x, reps=reps)["us"] * 1e-6
    return 2 * n_bytes / t


def detect_hardware(smoke: bool):
    """(key, cost_model.Hardware, how) for the local device: the cost model's entry for a known GPU
    (H100, H200, MI300X, MI325X), else one built from measured peaks (the CPU of a smoke run)."""

    kind = jax.devices()[0].device_kind.lower()
    for key, pat in (("h200", "h200"), ("h100_sxm", "h100"), ("mi325x", "mi325"), ("mi300x", "mi300")):
        if pat in kind:
            return key, HARDWARE[key], "vendor peaks of analysis/cost_model.HARDWARE"
    dt = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    peak = measure_matmul_peak(dt, n=256 if smoke else 4096, seconds=0.3 if smoke else 2.0)
    bw = measure_bandwidth(2**22 if smoke else 2**30, 5)
    hw = Hardware(name=jax.devices()[0].device_kind, peak_flops=peak, hbm_bw=bw, a2a_bw=1e9, coll_bw=1e9,
                  matmul_eff=1.0, mem_eff=1.0)
    return "measured", hw, f"measured here: matmul peak ({jnp.dtype(dt).name}) and elementwise bandwidth"


# --------------------------------------------------------------------------------------------------
# shapes
# --------------------------------------------------------------------------------------------------


def shapes(smoke: bool) -> dict:
    """Every size the parts use; --smoke shrinks them to seconds on a CPU."""
    if smoke:
        return dict(layers=2, batch=2, seq=32, steps=2, model=["model.d_model=64", "model.num_heads=4",
                    "model.num_kv_heads=4", "model.mlp_hidden=128", "model.vocab_size=512", "model.kv_lora_rank=32",
                    "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=8", "model.v_head_dim=16",
                    "moe.num_experts=8", "moe.top_k=2", "moe.expert_hidden=32", "model.max_seq_len=64"],
                    foe=["model.attention=gqa", "model.num_kv_heads=4", "model.head_dim=16"],
                    gemm=dict(m=256, k=64, n=32, groups=(4,)), dense=(128, 64, 96), norm=(256, 64),
                    attn=[dict(name="gqa", b=1, s=64, h=4, kv=2, d=16)], block=16, reps=3)
    return dict(layers=4, batch=2, seq=4096, steps=5, model=[], foe=["model.attention=gqa", "model.num_kv_heads=16",
                "model.head_dim=128"], gemm=dict(m=4 * 4096 * 6 // 4, k=2048, n=1408, groups=(64, 8)),
                dense=(8192, 2048, 10944), norm=(8192, 2048),
                attn=[dict(name="dsv2_lite", b=1, s=4096, h=16, kv=16, d=128),
                      dict(name="qwen3_gqa", b=1, s=4096, h=32, kv=4, d=128)], block=512, reps=10)


# --------------------------------------------------------------------------------------------------
# (a) train step
# --------------------------------------------------------------------------------------------------


def train_variants(sh: dict) -> dict:
    base = [f"model.num_layers={sh['layers']}", "model.first_k_dense=1", "mesh.expert=1", "mesh.data=1",
            "runtime.dispatch=local", "runtime.capacity_factor=null", f"train.batch_size={sh['batch']}",
            f"train.seq_len={sh['seq']}"] + sh["model"]
    out = {"standard": base + ["farskip.preset=standard"], "farskip": base + ["farskip.preset=farskip"],
           "foe": base + sh["foe"] + ["runtime.num_groups=2", "farskip.preset=standard"]}
    return {k: v for k, v in out.items() if k in sh.get("variants", out)}


def part_a(sh: dict, hw) -> dict:
    """tokens/s and MFU of the real train step (trainer's jit: donated state, out_shardings)."""

    rows = {}
    for name, ov in train_variants(sh).items():
        cfg = load_config(os.path.join(REPO, DSV2_LITE), ov)
        mesh = make_mesh(cfg.mesh, jax.devices()[:1])
        tx, schedule = make_optimizer(cfg.train)
        graphdef, state = init_state(create_model(cfg, mesh, seed=0), tx, 0)
        state = place_state(state, mesh)
        b, s = cfg.train.batch_size, cfg.train.seq_len
        rng = np.random.default_rng(0)
        tok = rng.integers(0, cfg.model.vocab_size, (b, s + 1), dtype=np.int32)
        batch = shard_batch(dict(tokens=tok[:, :-1], targets=tok[:, 1:], positions=np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)),
                                 segment_ids=np.ones((b, s), np.int32), loss_mask=np.ones((b, s), np.float32)), mesh)
        shardings = jax.tree.map(lambda x: x.sharding, state)
        step = jax.jit(make_train_step(graphdef, cfg, tx, schedule), donate_argnums=0, out_shardings=(shardings, None))
        box = {"state": state}

        def run(batch):
            box["state"], m = step(box["state"], batch)
            return m["loss"]

        t = bench(run, batch, reps=sh["steps"])
        tps = b * s / (t["us"] * 1e-6)
        fpt = train_flops_per_token(cfg, s)
        rows[name] = dict(step_ms=t["us"] / 1e3, tokens_per_s=tps, mfu=fpt * tps / hw.peak_flops, compile_s=t["first_s"],
                          flops_per_token=fpt, loss=float(run(batch)), gmm=cfg.runtime.gmm, layers=cfg.model.num_layers,
                          batch=b, seq=s, attention=cfg.model.attention)
        del box, state, step
        jax.clear_caches()
    for name in rows:
        ref = rows.get("standard", rows[name])
        rows[name]["speedup_vs_standard"] = ref["step_ms"] / rows[name]["step_ms"]
    return rows


# --------------------------------------------------------------------------------------------------
# (b) grouped GEMM
# --------------------------------------------------------------------------------------------------


def balanced_groups(m: int, g: int, seed: int = 0) -> np.ndarray:
    """Group sizes summing to m, +-25% around m / g (a realistically unbalanced router)."""
    w = np.random.default_rng(seed).uniform(0.75, 1.25, g)
    sizes = np.floor(w / w.sum() * m).astype(np.int32)
    sizes[0] += m - sizes.sum()
    return sizes


def gemm_cases(sh: dict):
    """(name, fn(lhs, rhs, group_sizes), groups) of part (b)."""

    def ragged(x, w, gs):
        return jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32).astype(x.dtype)

    def dense_ref(x, w, gs):  # the useful FLOPs as one GEMM: what an ideal grouped GEMM costs
        return jnp.dot(x, w[0], preferred_element_type=jnp.float32).astype(x.dtype)

    def tiled(x, w, gs):
        return gmm(x, w, gs, backend="tiled", tile=128 if x.shape[0] >= 4096 else 16)

    return [("ragged_dot", ragged), ("tiled", tiled), ("dense_reference", dense_ref)]


def part_b(sh: dict, hw) -> list:
    g = sh["gemm"]
    m, k, n = g["m"], g["k"], g["n"]
    dt = jnp.bfloat16
    out = []
    for groups in g["groups"]:
        x = jax.random.normal(jax.random.key(0), (m, k), dt)
        w = (jax.random.normal(jax.random.key(1), (groups, k, n), jnp.float32) * 0.02).astype(dt)
        gs = jnp.asarray(balanced_groups(m, groups))
        useful = 2.0 * m * k * n
        for name, fn in gemm_cases(sh):
            fwd = jax.jit(fn)
            loss = lambda x, w, gs, fn=fn: jnp.sum(fn(x, w, gs).astype(jnp.float32))  # noqa: E731
            fb = jax.jit(jax.grad(loss, argnums=(0, 1)))
            tf = bench(fwd, x, w, gs, reps=sh["reps"])
            tb = bench(fb, x, w, gs, reps=sh["reps"])
            out.append(dict(groups=groups, m=m, k=k, n=n, impl=name, fwd_us=tf["us"], fwdbwd_us=tb["us"],
                            fwd_tflops=useful / tf["us"] * 1e-6, fwdbwd_tflops=3 * useful / tb["us"] * 1e-6,
                            fwd_eff=useful / (tf["us"] * 1e-6) / hw.peak_flops,
                            fwdbwd_eff=3 * useful / (tb["us"] * 1e-6) / hw.peak_flops))
    for r in out:
        ref = next(q for q in out if q["groups"] == r["groups"] and q["impl"] == "dense_reference")
        r["fwd_vs_dense"] = r["fwd_us"] / ref["fwd_us"]
        r["fwdbwd_vs_dense"] = r["fwdbwd_us"] / ref["fwdbwd_us"]
    return out


# --------------------------------------------------------------------------------------------------
# (c) op classes vs the two-stream cost model
# --------------------------------------------------------------------------------------------------


def rmsnorm(x, w):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6) * w).astype(x.dtype)


def attention_flops(b, s, h, d) -> float:
    """QK^T and PV of a full (non-causal) [s, s] attention, forward."""
    return 4.0 * b * h * s * s * d


def part_c(sh: dict, hw) -> dict:
    """Each op class: measured us, the cost model's predicted us, and the constant refitted from it."""

    ops = []
    dt = jnp.bfloat16
    # dense GEMM (projections, shared experts, LM head)
    mm, kk, nn = sh["dense"]
    a = jax.random.normal(jax.random.key(0), (mm, kk), dt)
    bmat = jax.random.normal(jax.random.key(1), (kk, nn), dt)
    t = bench(jax.jit(lambda a, b: a @ b), a, bmat, reps=sh["reps"])
    fl, by = 2.0 * mm * kk * nn, 2.0 * (mm * kk + kk * nn + mm * nn)
    ops.append(dict(op="dense_gemm", shape=f"[{mm},{kk}]x[{kk},{nn}] bf16", flops=fl, bytes=by, measured_us=t["us"],
                    predicted_us=compute_time_us(fl, by, hw), fitted=("matmul_eff", fl / (t["us"] * 1e-6) / hw.peak_flops)))
    # grouped GEMM: the model prices it as a dense dot of its useful FLOPs (analysis/programs.grouped_gemm_proxy)
    g = sh["gemm"]
    groups = g["groups"][-1]
    x = jax.random.normal(jax.random.key(2), (g["m"], g["k"]), dt)
    w = jax.random.normal(jax.random.key(3), (groups, g["k"], g["n"]), dt)
    gs = jnp.asarray(balanced_groups(g["m"], groups))
    t = bench(jax.jit(lambda x, w, gs: jax.lax.ragged_dot(x, w, gs)), x, w, gs, reps=sh["reps"])
    fl = 2.0 * g["m"] * g["k"] * g["n"]
    by = 2.0 * (g["m"] * g["k"] + groups * g["k"] * g["n"] + g["m"] * g["n"])
    ops.append(dict(op="grouped_gemm", shape=f"ragged_dot [{g['m']},{g['k']}]x[{groups},{g['k']},{g['n']}] bf16", flops=fl,
                    bytes=by, measured_us=t["us"], predicted_us=compute_time_us(fl, by, hw),
                    fitted=("grouped_gemm_eff", fl / (t["us"] * 1e-6) / hw.peak_flops)))
    # attention core, causal, fwd+bwd: naive (the model prices its materialised scores at roofline) and
    # fused (blockwise here; flash priced by cost_model.fused_attention_us)
    c = sh["attn"][0]
    b, s, h, d = c["b"], c["s"], c["h"], c["d"]
    q = jax.random.normal(jax.random.key(4), (b, s, h, d), dt)
    kv = jax.random.normal(jax.random.key(5), (b, s, h, d), dt)
    pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    mask = attention_mask(pos, pos, None, None)
    scale = d ** -0.5
    naive = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attention_core(q, k, v, mask, scale).astype(jnp.float32)), argnums=(0, 1, 2)))
    t = bench(naive, q, kv, kv, reps=sh["reps"])
    f_fwd = attention_flops(b, s, h, d)
    fl = 3 * f_fwd  # fwd 2 GEMMs + bwd 4 GEMMs, no causal skipping in the naive core
    scores = b * h * s * s
    by = scores * (4 + 4 + 2) * 3 + 2 * 4 * b * s * h * d  # f32 logits/probs written+read fwd and bwd, bf16 probs
    ops.append(dict(op="attention_naive", shape=f"b{b} s{s} h{h} d{d} causal fwd+bwd", flops=fl, bytes=by,
                    measured_us=t["us"], predicted_us=compute_time_us(fl, by, hw),
                    fitted=("naive_attention_eff", fl / (t["us"] * 1e-6) / hw.peak_flops)))
    blk = jax.jit(jax.grad(lambda q, k, v: jnp.sum(blockwise_attention_core(q, k, v, mask, scale, sh["block"]).astype(jnp.float32)),
                           argnums=(0, 1, 2)))
    t = bench(blk, q, kv, kv, reps=sh["reps"])
    fl_causal = CAUSAL_FRACTION * f_fwd * (1 + 2 * FLASH_BWD_RECOMPUTE)  # what fused_attention_us prices fwd + bwd
    ops.append(dict(op="attention_fused", shape=f"blockwise b{b} s{s} h{h} d{d} causal fwd+bwd", flops=fl_causal,
                    bytes=0.0, measured_us=t["us"], predicted_us=2 * hw.launch_us + 1e6 * fl_causal / (hw.peak_flops * hw.attn_eff),
                    fitted=("attn_eff", fl_causal / (t["us"] * 1e-6) / hw.peak_flops)))
    # elementwise / norms: HBM bound
    tn, dn = sh["norm"]
    xn = jax.random.normal(jax.random.key(6), (tn, dn), dt)
    wn = jnp.ones((dn,), jnp.float32)
    t = bench(jax.jit(rmsnorm), xn, wn, reps=sh["reps"])
    by = 2.0 * 2 * tn * dn + 4 * dn
    ops.append(dict(op="rmsnorm", shape=f"[{tn},{dn}] bf16", flops=0.0, bytes=by, measured_us=t["us"],
                    predicted_us=compute_time_us(0.0, by, hw), fitted=("mem_eff", by / (max(t["us"] - hw.launch_us, 1e-3) * 1e-6) / hw.hbm_bw)))
    # launch: 64 dependent tiny kernels in one program vs 1
    tiny = jnp.ones((8,), jnp.float32)

    def chain(n):
        def f(x):
            for i in range(n):
                x = jnp.sin(x) + i  # not foldable into one fusion: sin per step
                x = jax.lax.optimization_barrier(x)
            return x
        return jax.jit(f)

    t1, t64 = bench(chain(1), tiny, reps=sh["reps"])["us"], bench(chain(64), tiny, reps=sh["reps"])["us"]
    launch = max((t64 - t1) / 63, 0.0)
    ops.append(dict(op="kernel_launch", shape="64 dependent tiny kernels", flops=0.0, bytes=0.0, measured_us=launch,
                    predicted_us=hw.launch_us, fitted=("launch_us", launch)))
    # all-to-all: needs several GPUs
    payload = 2.0 * 4096 * 6 * 2048 / 8 * 7  # bf16 dispatch of 4096 tokens x top 6 at EP 8 (per GPU)
    ops.append(dict(op="all_to_all", shape="dispatch 4096 tok x top6 x 2048 bf16, EP 8", flops=0.0, bytes=payload,
                    measured_us=None, predicted_us=collective_time_us("all-to-all", payload, 8, hw),
                    fitted=None, note="not measurable on one GPU: needs 8 GPUs of one node (the overlap report's all-to-alls)"))
    for o in ops:
        o["ratio_measured_over_predicted"] = (o["measured_us"] / o["predicted_us"]) if o["measured_us"] else None
    fitted = {o["fitted"][0]: o["fitted"][1] for o in ops if o["fitted"]}
    return dict(ops=[{k: v for k, v in o.items() if k != "fitted"} | {"fitted": list(o["fitted"]) if o["fitted"] else None}
                     for o in ops], fitted_constants=fitted,
                model_constants=dict(matmul_eff=hw.matmul_eff, mem_eff=hw.mem_eff, attn_eff=hw.attn_eff,
                                     launch_us=hw.launch_us, peak_flops=hw.peak_flops, hbm_bw=hw.hbm_bw))


# --------------------------------------------------------------------------------------------------
# (d) attention implementations
# --------------------------------------------------------------------------------------------------


def attention_impls(sh: dict, mask, scale: float) -> dict:

    def xla_sdpa(q, k, v, implementation=None):
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation=implementation)

    impls = {"naive": lambda q, k, v: attention_core(q, k, v, mask, scale),
             "blockwise": lambda q, k, v: blockwise_attention_core(q, k, v, mask, scale, sh["block"]),
             "sdpa_xla": lambda q, k, v: xla_sdpa(q, k, v, "xla")}
    kind = jax.devices()[0].device_kind.lower()
    if jax.default_backend() == "gpu" and not any(t in kind for t in ("amd", "instinct", "mi3")):  # cuDNN: CUDA only
        impls["sdpa_cudnn"] = lambda q, k, v: xla_sdpa(q, k, v, "cudnn")
    return impls


def part_d(sh: dict, hw) -> list:

    out = []
    for c in sh["attn"]:
        b, s, h, kvh, d = c["b"], c["s"], c["h"], c["kv"], c["d"]
        ks = jax.random.split(jax.random.key(7), 3)
        q = jax.random.normal(ks[0], (b, s, h, d), jnp.bfloat16)
        k = jax.random.normal(ks[1], (b, s, kvh, d), jnp.bfloat16)
        v = jax.random.normal(ks[2], (b, s, kvh, d), jnp.bfloat16)
        pos = jnp.broadcast_to(jnp.arange(s), (b, s))
        mask = attention_mask(pos, pos, None, None)
        ref = None
        f_causal = CAUSAL_FRACTION * attention_flops(b, s, h, d)
        for name, fn in attention_impls(sh, mask, d ** -0.5).items():
            row = dict(shape=c["name"], b=b, s=s, h=h, kv=kvh, d=d, impl=name)
            try:
                fwd = jax.jit(fn)
                fb = jax.jit(jax.grad(lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)))
                y = fwd(q, k, v)
                if ref is None:
                    ref = y
                row["max_abs_diff_vs_naive"] = float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref.astype(jnp.float32))))
                tf, tb = bench(fwd, q, k, v, reps=sh["reps"]), bench(fb, q, k, v, reps=sh["reps"])
                row.update(fwd_us=tf["us"], fwdbwd_us=tb["us"],
                           causal_tflops_fwdbwd=3.5 * f_causal / tb["us"] * 1e-6)  # fwd 1 + bwd 2.5 (flash recompute)
            except Exception as e:  # an implementation this backend lacks (cuDNN versions, shapes)
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            out.append(row)
    return out



# --------------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------------


def format_report(res: dict) -> str:
    L = []
    p = L.append
    env = res["environment"]
    p(f"device check: {env['device_kind']} ({env['backend']}), jax {env['jax']}, mode {res['mode']}; "
      f"peaks {env['peak_flops'] / 1e12:.3g} TFLOP/s, {env['hbm_bw'] / 1e9:.3g} GB/s ({env['peaks_from']})")
    if "a" in res["parts"]:
        p("\n(a) train step, DeepSeek-V2-Lite widths cut in depth, one device")
        p(f"{'variant':<10}{'layers':>7}{'tokens':>8}{'step ms':>10}{'tok/s':>12}{'MFU':>8}{'vs std':>8}{'compile s':>10}")
        for k, r in res["parts"]["a"].items():
            p(f"{k:<10}{r['layers']:>7}{r['batch'] * r['seq']:>8}{r['step_ms']:>10.2f}{r['tokens_per_s']:>12,.0f}"
              f"{100 * r['mfu']:>7.1f}%{r['speedup_vs_standard']:>7.3f}x{r['compile_s']:>10.1f}")
    if "b" in res["parts"]:
        p("\n(b) grouped GEMM vs a dense GEMM of the same useful FLOPs (bf16)")
        p(f"{'G':>4} {'M x K x N':<20}{'impl':<17}{'fwd us':>10}{'x dense':>9}{'f+b us':>11}{'x dense':>9}{'f+b eff':>9}")
        for r in res["parts"]["b"]:
            p(f"{r['groups']:>4} {str(r['m']) + 'x' + str(r['k']) + 'x' + str(r['n']):<20}{r['impl']:<17}{r['fwd_us']:>10.1f}"
              f"{r['fwd_vs_dense']:>8.2f}x{r['fwdbwd_us']:>11.1f}{r['fwdbwd_vs_dense']:>8.2f}x{100 * r['fwdbwd_eff']:>8.1f}%")
    if "c" in res["parts"]:
        c = res["parts"]["c"]
        p("\n(c) op classes: measured vs the two-stream cost model")
        p(f"{'op':<17}{'shape':<48}{'measured us':>12}{'model us':>10}{'ratio':>7}  fitted")
        for o in c["ops"]:
            meas = f"{o['measured_us']:.1f}" if o["measured_us"] is not None else "n/a"
            ratio = f"{o['ratio_measured_over_predicted']:.2f}" if o["ratio_measured_over_predicted"] else "-"
            fit = f"{o['fitted'][0]}={o['fitted'][1]:.3g}" if o["fitted"] else o.get("note", "")
            p(f"{o['op']:<17}{o['shape'][:47]:<48}{meas:>12}{o['predicted_us']:>10.1f}{ratio:>7}  {fit}")
        p("fitted constants (cost_model.Hardware names): " + ", ".join(f"{k}={v:.3g}" for k, v in c["fitted_constants"].items())
          + " | model now: " + ", ".join(f"{k}={c['model_constants'][k]:.3g}" for k in ("matmul_eff", "mem_eff", "attn_eff", "launch_us")))
    if "d" in res["parts"]:
        p("\n(d) attention, causal, bf16")
        p(f"{'shape':<11}{'impl':<12}{'fwd us':>11}{'fwd+bwd us':>12}{'TFLOP/s':>9}{'max|diff|':>11}")
        for r in res["parts"]["d"]:
            if "error" in r:
                p(f"{r['shape']:<11}{r['impl']:<12}  unavailable: {r['error'][:80]}")
            else:
                p(f"{r['shape']:<11}{r['impl']:<12}{r['fwd_us']:>11.1f}{r['fwdbwd_us']:>12.1f}{r['causal_tflops_fwdbwd']:>9.3g}"
                  f"{r['max_abs_diff_vs_naive']:>11.2e}")
    for k, v in res.get("errors", {}).items():
        p(f"\npart ({k}) failed: {v}")
    p(f"\ntotal {res['wall_s']:.0f}s")
    return "\n".join(L)


def run(parts=PARTS, smoke: bool = False, log=None, variants=None) -> dict:
    """Run the selected parts; a part that raises is recorded under `errors` (the others still run).
    variants: the train-step variants of part (a) (default standard, farskip, foe)."""
    log = log or (lambda m: None)
    t0 = time.time()
    sh = shapes(smoke)
    if variants:
        sh["variants"] = list(variants)
    key, hw, how = detect_hardware(smoke)
    res = dict(schema_version=SCHEMA_VERSION, mode="smoke" if smoke else "full", parts={}, errors={},
               environment=dict(backend=jax.default_backend(), device_kind=jax.devices()[0].device_kind,
                                jax=jax.__version__, python=_platform.python_version(), hardware=key,
                                peak_flops=hw.peak_flops, hbm_bw=hw.hbm_bw, peaks_from=how,
                                time=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())), shapes=sh)
    fns = {"a": part_a, "b": part_b, "c": part_c, "d": part_d}
    for p in parts:
        log(f"[device_check] part ({p}) ...")
        tp = time.time()
        try:
            res["parts"][p] = fns[p](sh, hw)
        except Exception as e:  # recorded, so one missing feature does not lose the other measurements
            res["errors"][p] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        log(f"[device_check]   ({p}) {time.time() - tp:.1f}s")
    res["wall_s"] = time.time() - t0
    return res


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, any backend (CI)")
    ap.add_argument("--parts", default=",".join(PARTS), help="subset of a,b,c,d")
    ap.add_argument("--variants", default="standard,farskip,foe", help="part (a) train-step variants")
    ap.add_argument("--out", default=results_dir("device_check"))
    a = ap.parse_args(argv)
    parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        print(f"error: --parts {bad} unknown; choose from {list(PARTS)}", file=sys.stderr)
        return 2
    if not a.smoke and jax.default_backend() == "cpu":
        print("error: no GPU here (jax backend is cpu); run on one CUDA or ROCm GPU, or add --smoke for the CPU "
              "check of the same code paths at tiny shapes", file=sys.stderr)
        return 2
    res = run(parts, a.smoke, log=lambda m: print(m, file=sys.stderr, flush=True),
              variants=[v.strip() for v in a.variants.split(",") if v.strip()])
    text = format_report(res)
    print(text)
    os.makedirs(a.out, exist_ok=True)
    name = "device_check_smoke" if a.smoke else "device_check"
    with open(os.path.join(a.out, f"{name}.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(a.out, f"{name}.txt"), "w") as f:
        f.write(text + "\n")
    print(f"wrote {os.path.join(a.out, name + '.json')}")
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())

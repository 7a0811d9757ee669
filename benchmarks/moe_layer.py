"""Routed-expert forward+backward time relative to an equal-FLOP dense SwiGLU MLP, side by side.

    python -m benchmarks.moe_layer [--shapes a,b] [--backends blas,tiled,einsum,ragged_dot] [--repeats 5]
                                   [--dtype bfloat16]

Shapes (fp32; --dtype bfloat16: bf16 activations, float32 weights, the dense reference in bf16 too
through matmul_2d, i.e. on AMX where the CPU has it, plus a float32 dense row):
  a: batch 8 x seq 256, d_model 256, 16 experts, top-2, expert hidden 512
  b: batch 8 x seq 256, d_model 1024, 64 experts, top-6, expert hidden 1408 (DeepSeek-V2-Lite
     proportions; --batch-b 2 is the shrunk variant: only 48 rows per expert, so the 64 expert
     weight slices (10x the dense MLP's bytes) are re-read for little work and the ratio rises)
Each MoE variant = router (softmax top-k) + `local_routed_compute` (sort, grouped matmul SwiGLU,
weighted un-sort), gradients w.r.t. the input, router and expert weights. The reference is a dense
SwiGLU with hidden = top_k * expert_hidden (same active FLOPs per token), gradients w.r.t. input and
weights. Variants are timed interleaved (one call of each per repeat), median reported; the printed
ratio is variant / dense. `tiled@cf1.25` is the dropping variant (capacity factor 1.25) for reference;
`tiled:experts` / `blas:experts` are that backend's expert SwiGLU alone on pre-sorted rows (no
router/sort/un-sort).

--malloc resident (the default, as in train.py) keeps freed memory in the process before JAX
allocates anything (farskip_jax/kernels/host_memory.py: glibc mallopt, one arena, no mmap for large blocks,
no trim); `default` leaves glibc as it is: every step then page-faults its big buffers afresh (shape
b: 1.2 s of system time per 2.1 s step). Even resident, the first calls grow the heap until it fits
the interleaved variants (on this VM fresh pages cost about 0.3 GB/s of system time, so such a call
can take ~2x). Calls that faulted in more than FRESH_PAGES pages are marked `*` and a second ratio in
brackets leaves them out.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from farskip_jax import kernels  # noqa: E402
from farskip_jax.config import RuntimeConfig, kernels_from_env  # noqa: E402
from farskip_jax.kernels.host_memory import keep_freed_memory  # noqa: E402
from farskip_jax.model.experts import ExpertWeights, expert_swiglu, local_routed_compute  # noqa: E402
from farskip_jax.model.layers import matmul_2d  # noqa: E402
from farskip_jax.model.router import RouteResult  # noqa: E402

SHAPES = {
    "a": dict(batch=8, seq=256, d=256, experts=16, top_k=2, hidden=512),
    "b": dict(batch=8, seq=256, d=1024, experts=64, top_k=6, hidden=1408),
}


FRESH_PAGES = 16384  # minor page faults (64 MiB of 4 KiB pages) that mark a call as having grown the heap

def make_moe_step(cfg: RuntimeConfig, top_k: int, num_experts: int):
    def loss(params, x, ct):
        logits = matmul_2d(x, params["router"])
        probs = jax.nn.softmax(logits, -1)
        w, idx = jax.lax.top_k(probs, top_k)
        w = w / w.sum(-1, keepdims=True)
        route = RouteResult(indices=idx.astype(jnp.int32), weights=w, aux_loss=jnp.zeros(()),
                            z_loss=jnp.zeros(()), load=jnp.zeros((num_experts,)))
        ew = ExpertWeights(params["w_gate"], params["w_up"], params["w_down"])
        out = local_routed_compute(x, route, ew, cfg)
        return jnp.sum(out.y * ct), out.dropped

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def make_experts_only_step(group_sizes: jax.Array, cfg: RuntimeConfig):
    """The backend's expert SwiGLU alone (experts.expert_swiglu) on rows already sorted by expert:
    no router, sort or un-sort. x here is the [N, d] sorted rows; same output format."""
    def loss(params, xs, ct):
        y = expert_swiglu(xs, group_sizes, ExpertWeights(params["w_gate"], params["w_up"], params["w_down"]), cfg)
        return jnp.sum(y * ct), jnp.zeros((), jnp.int32)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def make_dense_step():
    def loss(params, x, ct):
        h = jax.nn.silu(matmul_2d(x, params["w_gate"])) * matmul_2d(x, params["w_up"])
        return jnp.sum(matmul_2d(h, params["w_down"]) * ct)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def weight_traffic_estimate(moe_params: dict, dense_params: dict, dense_s: float, repeats: int = 5) -> None:
    """Print how much of the ratio the expert weights' memory traffic alone explains.

    Per step the MoE streams every expert weight three times (read by the forward grouped GEMM, read
    again by the input-gradient GEMM, its gradient written), the dense MLP its own (much smaller)
    weights; at the streaming bandwidth measured here (x -> 1.0001 x over the expert weights, read +
    write) the difference is time the layer spends moving weights unless a GEMM hides it. Not a
    hard floor (a GEMM can overlap some of it), but a ratio near it is memory-bound, not compute-bound."""
    ws = [moe_params[k] for k in ("w_gate", "w_up", "w_down")]
    scale = jax.jit(lambda *a: tuple(x * 1.0001 for x in a))
    jax.block_until_ready(scale(*ws))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(scale(*ws))
        best = min(best, time.perf_counter() - t0)
    moe_bytes = sum(w.size * w.dtype.itemsize for w in ws)
    dense_bytes = sum(w.size * w.dtype.itemsize for w in dense_params.values())
    bw = 2 * moe_bytes / best  # bytes read + written per second
    extra = 3 * (moe_bytes - dense_bytes) / bw
    print(f"  weight traffic: experts {moe_bytes / 1e6:.0f} MB vs dense {dense_bytes / 1e6:.0f} MB; streaming "
          f"{bw / 1e9:.1f} GB/s -> the 3 passes over the extra bytes take {extra * 1e3:.0f} ms = "
          f"{1 + extra / dense_s:.2f}x dense if not hidden under compute", flush=True)


def run_shape(name: str, backends: list[str], repeats: int, tile: int,
              dtype: str = "float32") -> list[tuple[str, float, float]]:
    s = SHAPES[name]
    b, t, d, e, k, h = s["batch"], s["seq"], s["d"], s["experts"], s["top_k"], s["hidden"]
    rng = np.random.default_rng(0)
    f32 = lambda *shape, std=0.02: jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * std)  # noqa: E731
    x = f32(b, t, d, std=1.0)
    ct = f32(b, t, d, std=1.0)
    moe_params = {"router": f32(d, e, std=0.5), "w_gate": f32(e, d, h), "w_up": f32(e, d, h), "w_down": f32(e, h, d)}
    dense_params = {"w_gate": f32(d, k * h), "w_up": f32(d, k * h), "w_down": f32(k * h, d)}
    variants = {"dense": (make_dense_step(), dense_params)}
    if dtype != "float32":  # activations in dtype, weights float32 (master weights), as runtime.compute_dtype does
        variants["dense[float32]"] = (make_dense_step(), dense_params, x, ct)
        x, ct = x.astype(dtype), ct.astype(dtype)
    for be in backends:
        cf = None
        label = be
        if "@cf" in be:
            be, cf = be.split("@cf")[0], float(be.split("@cf")[1])
        cfg = RuntimeConfig(gmm=be, gmm_tile=tile, capacity_factor=cf)
        variants[label] = (make_moe_step(cfg, k, e), moe_params)
        if be in ("tiled", "blas") and cf is None:  # the same routing's group sizes, rows pre-sorted
            idx = np.argsort(-np.asarray(matmul_2d(x, moe_params["router"])), -1)[..., :k]
            sizes = jnp.asarray(np.bincount(idx.reshape(-1), minlength=e).astype(np.int32))
            xs, cts = f32(b * t * k, d, std=1.0).astype(dtype), f32(b * t * k, d, std=1.0).astype(dtype)
            variants[f"{be}:experts"] = (make_experts_only_step(sizes, cfg), moe_params, xs, cts)
    times: dict[str, list[float]] = {v: [] for v in variants}
    dropped: dict[str, float] = {}
    print(f"[shape {name}] {s}  tokens={b * t} assignments={b * t * k}", flush=True)
    for label, (fn, params, *inputs) in variants.items():  # compile + warm up
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(params, *(inputs or (x, ct))))
        if not label.startswith("dense"):
            dropped[label] = float(out[0][1]) / (b * t * k)
        print(f"  compiled {label:16s} {time.perf_counter() - t0:6.1f}s", flush=True)
    fresh: dict[str, list[bool]] = {v: [] for v in variants}  # the call faulted in fresh host memory
    for r in range(repeats):
        for label, (fn, params, *inputs) in variants.items():
            flt0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
            jax.block_until_ready(fn(params, *(inputs or (x, ct))))
            times[label].append(time.perf_counter() - t0)
            fresh[label].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - flt0 > FRESH_PAGES)
        print(f"  repeat {r + 1}/{repeats}: " + " ".join(f"{v}={times[v][-1] * 1e3:.0f}ms{'*' if fresh[v][-1] else ''}"
                                                        for v in variants), flush=True)
    n_fresh = sum(map(sum, fresh.values()))
    if n_fresh:
        print(f"  * {n_fresh} calls faulted in more than {FRESH_PAGES} fresh pages (malloc grew the heap, the OS "
              "zeroed the pages); the ratio in brackets leaves those calls out", flush=True)
    dense = statistics.median(times["dense"])
    clean = lambda v: [t for t, f in zip(times[v], fresh[v]) if not f] or times[v]  # noqa: E731
    weight_traffic_estimate(moe_params, dense_params, dense)
    rows = []
    if "dense[float32]" in variants:
        print(f"  dense in {dtype} / dense in float32: {dense / statistics.median(times['dense[float32]']):.2f}x",
              flush=True)
    for label in variants:
        if label.startswith("dense"):
            continue
        ratio = statistics.median(times[label]) / dense
        rows.append((label, ratio, dropped[label]))
        steady = f" [{statistics.median(clean(label)) / statistics.median(clean('dense')):.2f}x]" if n_fresh else ""
        print(f"  {label:16s} {ratio:5.2f}x dense{steady}   dropped {dropped[label]:.2%}", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="a,b")
    ap.add_argument("--backends", default=None,
                    help="comma list; default a: blas,tiled,einsum,ragged_dot,tiled@cf1.25  b: blas,tiled,einsum")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tile", type=int, default=RuntimeConfig.gmm_tile)
    ap.add_argument("--batch-b", type=int, default=SHAPES["b"]["batch"], help="batch of shape b")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="activations' dtype (weights stay float32 master weights, as with runtime.compute_dtype); "
                         "bfloat16 adds a dense[float32] row to compare against")
    ap.add_argument("--malloc", choices=["default", "resident"], default="resident",
                    help="resident: glibc keeps freed memory (no fresh-page faults for either side); see above")
    args = ap.parse_args(argv)
    SHAPES["b"]["batch"] = args.batch_b
    kernels.install(kernels_from_env())  # a default kernels section (environment overrides: config.KERNELS_ENV)
    if args.malloc == "resident" and not keep_freed_memory("resident"):
        raise SystemExit("--malloc resident: glibc mallopt refused (not glibc?)")
    print(f"jax {jax.__version__} on {jax.default_backend()}, {os.cpu_count()} CPUs, malloc {args.malloc}", flush=True)
    for name in args.shapes.split(","):
        default = "blas,tiled,einsum,ragged_dot,tiled@cf1.25" if name == "a" else "blas,tiled,einsum"
        run_shape(name, (args.backends or default).split(","), args.repeats, args.tile, args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())

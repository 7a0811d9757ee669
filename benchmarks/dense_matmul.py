"""Dense float32 matmul forward+backward on the CPU: XLA's dot vs the BLAS kernel, side by side.

    python -m benchmarks.dense_matmul [--shapes 2048x256x256,2048x256x4096] [--repeats 15]

For each m x k x n: y = x [m, k] @ w [k, n], gradients w.r.t. x and w (3 products, 6 m k n FLOPs),
once through XLA:CPU's dot (kernels.dense_matmul: xla) and once through `layers.matmul_2d`'s CPU
default, blas_gmm.matmul (the grouped-GEMM kernels with one group: one sgemm per thread part, BLAS
as kernels/cpu/library.py loads it). Interleaved, median of `repeats`; prints GFLOP/s of each and the
ratio XLA time / BLAS time. The default shapes are the projections of benchmarks/vs_hf.py's model
(8 x 256 tokens, d 256: q/o, k/v, a 1024-wide MLP, its down projection, the 4096-token LM head).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from farskip_jax.kernels.host_memory import keep_freed_memory  # noqa: E402

keep_freed_memory()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from farskip_jax import kernels  # noqa: E402
from farskip_jax.config import kernels_from_env, replace  # noqa: E402
from farskip_jax.kernels.cpu import library  # noqa: E402
from farskip_jax.model.layers import matmul_2d  # noqa: E402

DEFAULT_SHAPES = "2048x256x256,2048x256x128,2048x256x1024,2048x1024x256,2048x256x4096"


def step_for(choice: str, g: jax.Array, x: jax.Array, w: jax.Array):
    """jit(grad) of sum(matmul_2d(x, w) * g) w.r.t. x and w, traced (first call) with
    kernels.dense_matmul=choice installed."""
    kernels.install(replace(kernels_from_env(), dense_matmul=choice))
    f = jax.jit(jax.grad(lambda x, w: jnp.sum(matmul_2d(x, w) * g), argnums=(0, 1)))
    jax.block_until_ready(f(x, w))
    return f


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated MxKxN")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)
    print(f"jax {jax.__version__} on {jax.default_backend()}, {os.cpu_count()} CPUs; BLAS: {library.load()}",
          flush=True)
    rng = np.random.default_rng(0)
    for spec in args.shapes.split(","):
        m, k, n = (int(v) for v in spec.lower().split("x"))
        x = jnp.asarray(rng.standard_normal((m, k), np.float32))
        w = jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.05)
        g = jnp.asarray(rng.standard_normal((m, n), np.float32))
        fns = {choice: step_for(choice, g, x, w) for choice in ("xla", "auto")}
        times = {c: [] for c in fns}
        for _ in range(args.repeats):
            for c, f in fns.items():
                t0 = time.perf_counter()
                jax.block_until_ready(f(x, w))
                times[c].append(time.perf_counter() - t0)
        med = {c: statistics.median(v) for c, v in times.items()}
        flops = 6 * m * k * n
        print(f"  {m}x{k}x{n}: XLA dot {flops / med['xla'] / 1e9:6.0f} GF/s   BLAS kernel "
              f"{flops / med['auto'] / 1e9:6.0f} GF/s   XLA/BLAS time {med['xla'] / med['auto']:.2f}x", flush=True)
    kernels.install(kernels_from_env())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

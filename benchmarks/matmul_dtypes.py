"""GFLOP/s of one matmul in fp32 and bf16 (fp32 accumulation) on this CPU: XLA vs torch, by layout.

    python -m benchmarks.matmul_dtypes [--m 4096 --k 256 --n 1024] [--repeats 20]

The three dots of a linear layer's training step on x [m, k], w [k, n], dy [m, n]:
  forward   y  = x @ w          (contract k)
  input     dx = dy @ w^T       (contract n)
  weight    dw = x^T @ dy       (contract m: the token dimension)
  weight_t  the same with x^T given as a [k, m] input (no transpose inside the program)
Each is timed for XLA (jit, fp32 in/out; bf16 in with preferred_element_type=f32) and torch (fp32;
bf16 in/out, which torch accumulates in fp32), interleaved, best of `repeats`. On CPUs with AMX or
AVX512-BF16 the bf16 rows show what a bf16 compute path could gain, and which layouts XLA:CPU
sends to its fast bf16 kernels (it does not for every one: on the Xeon this was written on, the
weight-gradient layout ran at fp32 speed while forward and input-gradient ran 4-5x faster, and the
same product with x^T handed over pre-transposed ran fast too: the transpose XLA folds into the dot
is what loses the fast kernel).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

DIMS = {"forward": (((1,), (0,)), ((), ())), "input": (((1,), (1,)), ((), ())), "weight": (((0,), (0,)), ((), ())),
        "weight_t": (((1,), (0,)), ((), ()))}


def operands(m: int, k: int, n: int) -> dict:
    """Shapes of (lhs, rhs) per dot: forward x[m,k] w[k,n]; input dy[m,n] w[k,n]; weight x[m,k] dy[m,n];
    weight_t: the same product with x^T handed over already transposed ([k, m], a program input)."""
    return {"forward": ((m, k), (k, n)), "input": ((m, n), (k, n)), "weight": ((m, k), (m, n)),
            "weight_t": ((k, m), (m, n))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, default=4096, help="rows (tokens)")
    ap.add_argument("--k", type=int, default=256, help="input features")
    ap.add_argument("--n", type=int, default=1024, help="output features")
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args(argv)
    flops = 2 * a.m * a.k * a.n
    print(f"jax {jax.__version__} / torch {torch.__version__}, {os.cpu_count()} CPUs; m={a.m} k={a.k} n={a.n}")
    fns = {}
    for name, (ls, rs) in operands(a.m, a.k, a.n).items():
        dims = DIMS[name]
        for dt, pref in (("fp32", None), ("bf16", jnp.float32)):
            jdt = jnp.float32 if dt == "fp32" else jnp.bfloat16
            lhs, rhs = jnp.ones(ls, jdt), jnp.ones(rs, jdt)
            f = jax.jit(lambda x, y, d=dims, p=pref: jax.lax.dot_general(x, y, d, preferred_element_type=p))
            fns[(name, "xla", dt)] = lambda f=f, x=lhs, y=rhs: f(x, y).block_until_ready()
            tdt = torch.float32 if dt == "fp32" else torch.bfloat16
            x, y = torch.ones(ls, dtype=tdt), torch.ones(rs, dtype=tdt)
            if name in ("forward", "weight_t"):
                fns[(name, "torch", dt)] = lambda x=x, y=y: x @ y
            elif name == "input":
                fns[(name, "torch", dt)] = lambda x=x, y=y: x @ y.T
            else:
                fns[(name, "torch", dt)] = lambda x=x, y=y: x.T @ y
    for fn in fns.values():
        fn()
    best = {key: float("inf") for key in fns}
    for _ in range(a.repeats):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[key] = min(best[key], time.perf_counter() - t0)
    print(f"{'dot':8s} {'':6s} {'fp32 GF/s':>10s} {'bf16 GF/s':>10s} {'bf16/fp32':>10s}")
    for name in DIMS:
        for lib in ("xla", "torch"):
            g32, g16 = (flops / best[(name, lib, dt)] / 1e9 for dt in ("fp32", "bf16"))
            print(f"{name:8s} {lib:6s} {g32:10.0f} {g16:10.0f} {g16 / g32:9.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

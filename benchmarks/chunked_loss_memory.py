"""Chunked cross entropy (losses/chunked.py) vs full logits: temporaries and CPU time per chunk size.

    JAX_PLATFORMS=cpu python -m benchmarks.chunked_loss_memory \
        --out benchmarks/results/memory/chunked_loss.json

Memory: the loss and its gradient w.r.t. the final stream and the unembedding (value_and_grad, jitted)
compiled (not run) at a real shape (default DeepSeek-V2-Lite: d 2048, vocab 102,400, bf16 compute,
one sequence of 4096, and two for the bytes per sequence): XLA's memory_analysis temporaries per chunk size (0 = full logits,
train/step.token_ce). Time: the same function run on this CPU at a small shape (--time-shape), median
of --reps runs after one warm-up, for every chunk size side by side (interleaved)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time



def loss_and_grad(chunk: int, cd):
    import jax

    from farskip_jax.losses.chunked import chunked_ce
    from farskip_jax.model.layers import matmul_2d
    from farskip_jax.losses.ce import token_ce

    def f(final, w, targets, mask):
        if chunk:
            return chunked_ce(final, (w, False), targets, mask, chunk=chunk, compute_dtype=cd)[0]
        logits = matmul_2d(final.astype(cd), w).astype("float32")
        return token_ce(logits, targets, mask)[0]

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))


def args_of(b, s, d, v, dtype="float32"):
    import jax
    import jax.numpy as jnp

    return (jax.ShapeDtypeStruct((b, s, d), jnp.dtype(dtype)), jax.ShapeDtypeStruct((d, v), jnp.float32),
            jax.ShapeDtypeStruct((b, s), jnp.int32), jax.ShapeDtypeStruct((b, s), jnp.float32))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", default="0,128,256,512,1024,2048")
    p.add_argument("--shape", default="1,4096,2048,102400", help="b,s,d,V compiled for memory")
    p.add_argument("--compute-dtype", default="bfloat16")
    p.add_argument("--time-shape", default="8,512,256,8192", help="b,s,d,V timed on this CPU (float32)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    chunks = [int(c) for c in a.chunks.split(",")]
    b, s, d, v = (int(x) for x in a.shape.split(","))
    cd = jnp.dtype(a.compute_dtype)
    rows = {}
    for c in chunks:
        m = loss_and_grad(c, cd).lower(*args_of(b, s, d, v, a.compute_dtype)).compile().memory_analysis()
        m2 = loss_and_grad(c, cd).lower(*args_of(2 * b, s, d, v, a.compute_dtype)).compile().memory_analysis()
        rows[c] = dict(temp_bytes=int(m.temp_size_in_bytes), argument_bytes=int(m.argument_size_in_bytes),
                       output_bytes=int(m.output_size_in_bytes),
                       per_seq_bytes=(int(m2.temp_size_in_bytes) - int(m.temp_size_in_bytes)) / b)
    tb, ts, td, tv = (int(x) for x in a.time_shape.split(","))
    r = np.random.RandomState(0)
    targs = (jnp.asarray(r.randn(tb, ts, td), jnp.float32), jnp.asarray(r.randn(td, tv) * 0.05, jnp.float32),
             jnp.asarray(r.randint(0, tv, (tb, ts)), jnp.int32), jnp.ones((tb, ts), jnp.float32))
    fns = {c: loss_and_grad(c if c < ts else ts, jnp.float32) if c else loss_and_grad(0, jnp.float32) for c in chunks}
    times = {c: [] for c in chunks}
    for c in chunks:
        jax.block_until_ready(fns[c](*targs))
    for _ in range(a.reps):
        for c in chunks:
            t0 = time.perf_counter()
            jax.block_until_ready(fns[c](*targs))
            times[c].append(time.perf_counter() - t0)
    base = statistics.median(times[chunks[0]])
    print(f"value_and_grad of the mean CE; memory: compiled at b,s,d,V = {a.shape} ({a.compute_dtype} compute); "
          f"time: this CPU at {a.time_shape} (float32), median of {a.reps}")
    print(f"{'chunk':>6} {'temp GiB':>9} {'GiB/seq':>8} {'temp/full':>9} {'ms':>8} {'t/t[0]':>7}")
    for c in chunks:
        rows[c]["ms"] = 1e3 * statistics.median(times[c])
        print(f"{c:>6} {rows[c]['temp_bytes'] / 2**30:>9.3f} {rows[c]['per_seq_bytes'] / 2**30:>8.3f} {rows[c]['temp_bytes'] / rows[chunks[0]]['temp_bytes']:>9.3f} "
              f"{rows[c]['ms']:>8.2f} {statistics.median(times[c]) / base:>7.3f}")
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(dict(shape=a.shape, compute_dtype=a.compute_dtype, time_shape=a.time_shape, reps=a.reps,
                           rows={str(k): v for k, v in rows.items()}), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

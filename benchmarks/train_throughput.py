"""Train-step throughput and MFU of a config on this machine, with the matmul peak measured in the
same run (so the ratio means something on a shared CPU).

    python -m benchmarks.train_throughput                       # configs/tiny.yaml, standard + farskip
    python -m benchmarks.train_throughput --config configs/small.yaml --steps 5 --presets standard
    python -m benchmarks.train_throughput --presets standard --dtypes float32,bfloat16   # bf16 compute
    python -m benchmarks.train_throughput --presets standard --dense-matmul xla,auto     # BLAS projections
    python -m benchmarks.train_throughput --loss-chunks 0,64                             # chunked cross entropy

Each variant (connectivity preset x runtime.compute_dtype [x kernels.dense_matmul, installed while the
variant's step is traced: `xla` = XLA's dot for the float32 projections, `auto` = the BLAS kernel])
gets its own model and optimizer state from the same seed and the same batches of the embedded
corpus; the variants' steps are timed interleaved (one step of each in turn), so ratios between
them are taken side by side. Prints per
variant: tokens/s (median step), loss after the same steps, MFU against the measured matmul peak of
its dtype (one device x devices); then farskip/standard and bfloat16/float32 step-time ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time



def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant (after 2 warm-up steps)")
    p.add_argument("--presets", nargs="*", default=["standard", "farskip"])
    p.add_argument("--dtypes", default=None,
                   help="comma list of runtime.compute_dtype values to compare (default: the config's)")
    p.add_argument("--malloc", choices=["resident", "default"], default="resident",
                   help="resident (as train.py on CPU): glibc keeps freed memory (farskip_jax/kernels/host_memory.py)")
    p.add_argument("--dense-matmul", default=None,
                   help="comma list of kernels.dense_matmul values to compare (xla,auto); default: the config's")
    p.add_argument("--loss-chunks", default=None,
                   help="comma list of train.loss_chunk values to compare (0 = full logits); default: the config's")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    if a.malloc == "resident":
        from farskip_jax.kernels.host_memory import keep_freed_memory
        keep_freed_memory()

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from farskip_jax.config import load_config, replace
    from farskip_jax.data.pipeline import make_iterator
    from farskip_jax import kernels
    from farskip_jax.model.transformer import Transformer
    from farskip_jax.train.flops import measure_matmul_peak, total_params, train_flops_per_token
    from farskip_jax.loading.optimizer import make_optimizer
    from farskip_jax.loading.train_state import init_state
    from farskip_jax.train.step import make_train_step

    cfg = load_config(a.config, a.overrides)
    kernels.install(cfg.kernels)  # the CPU kernels of cfg (parallel/build.config_on does this in train.py)
    t = cfg.train
    dtypes = a.dtypes.split(",") if a.dtypes else [cfg.runtime.compute_dtype]
    flops_tok = train_flops_per_token(cfg, t.seq_len)
    print(f"{a.config}: {total_params(cfg) / 1e6:.2f}M params, {flops_tok / 1e6:.1f} MFLOP/token, "
          f"batch {t.batch_size} x {t.seq_len}, device {jax.devices()[0].device_kind}, "
          f"{os.cpu_count()} cpus", flush=True)
    it = make_iterator(cfg.data, "train", batch_size=t.batch_size, seq_len=t.seq_len, seed=0)
    batches = [{k: jnp.asarray(v) for k, v in next(it).items()} for _ in range(a.steps + 2)]
    dense = a.dense_matmul.split(",") if a.dense_matmul else [None]
    chunks = [int(x) for x in a.loss_chunks.split(",")] if a.loss_chunks else [None]
    variants = {}
    for preset in a.presets:
        for dtype in dtypes:
            for dm in dense:
                for lc in chunks:
                    ch = {"farskip.preset": preset, "runtime.compute_dtype": dtype}
                    if lc is not None:
                        ch["train.loss_chunk"] = lc
                    c = replace(cfg, **ch)
                    tx, schedule = make_optimizer(c.train)
                    graphdef, state = init_state(Transformer(c, rngs=nnx.Rngs(0)), tx, 0)
                    variants[(preset, dtype, dm, lc)] = [
                        jax.jit(make_train_step(graphdef, c, tx, schedule), donate_argnums=0), state, [], None]
    for i, b in enumerate(batches):
        for (_, _, dm, _), v in variants.items():
            if dm is not None:  # read when the step is traced (its first call)
                kernels.install(replace(cfg.kernels, dense_matmul=dm))
            t0 = time.perf_counter()
            v[1], m = v[0](v[1], b)
            v[3] = float(jax.block_until_ready(m["loss"]))
            if i >= 2:
                v[2].append(time.perf_counter() - t0)
    med = {k: statistics.median(v[2]) for k, v in variants.items()}
    peaks = {d: measure_matmul_peak(jnp.float32 if d == "float32" else jnp.bfloat16, seconds=1.0) for d in dtypes}
    for (preset, dtype, dm, lc), v in variants.items():
        tps = t.batch_size * t.seq_len / med[(preset, dtype, dm, lc)]
        mfu = 100 * tps * flops_tok / (peaks[dtype] * jax.device_count())
        tag = (f" dense={dm}" if dm else "") + (f" loss_chunk={lc}" if lc is not None else "")
        print(f"  {preset:>9} {dtype:>8}{tag}: {tps:,.0f} tokens/s (median step {1e3 * med[(preset, dtype, dm, lc)]:.1f} "
              f"ms), loss {v[3]:.4f} after {len(batches)} steps, MFU {mfu:.1f}%", flush=True)
    print("measured matmul peak (1024^3 chain) per device: " +
          ", ".join(f"{d} {pk / 1e9:.0f} GFLOP/s" for d, pk in peaks.items()))
    lc0 = chunks[0]
    for dm in dense:
        tag = f", dense={dm}" if dm else ""
        for dtype in dtypes:
            if ("standard", dtype, dm) in med and ("farskip", dtype, dm) in med:
                print(f"farskip / standard step time ({dtype}{tag}): "
                      f"{med[('farskip', dtype, dm, lc0)] / med[('standard', dtype, dm, lc0)]:.3f}")
        for preset in a.presets:
            if "float32" in dtypes and "bfloat16" in dtypes:
                print(f"bfloat16 / float32 step time ({preset}{tag}): "
                      f"{med[(preset, 'bfloat16', dm, lc0)] / med[(preset, 'float32', dm, lc0)]:.3f}")
    if len(dense) > 1:
        for preset in a.presets:
            for dtype in dtypes:
                print(f"{dense[1]} / {dense[0]} dense-matmul step time ({preset}, {dtype}): "
                      f"{med[(preset, dtype, dense[1], lc0)] / med[(preset, dtype, dense[0], lc0)]:.3f}")
    if len(chunks) > 1:
        for preset in a.presets:
            for dtype in dtypes:
                for lc in chunks[1:]:
                    print(f"loss_chunk={lc} / loss_chunk={chunks[0]} step time ({preset}, {dtype}): "
                          f"{med[(preset, dtype, dense[0], lc)] / med[(preset, dtype, dense[0], chunks[0])]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Train-step throughput and MFU of a config on this machine, with the matmul peak measured in the
same run (so the ratio means something on a shared CPU).

    python benchmarks/train_throughput.py                       # configs/tiny.yaml, standard + farskip
    python benchmarks/train_throughput.py --config configs/small.yaml --steps 5 --presets standard

Prints, per connectivity preset: tokens/s (median step), model FLOPs/token, MFU against the measured
fp32/bf16 matmul peak of one device x devices. Steps are real optimizer steps on the embedded corpus.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--steps", type=int, default=20, help="timed steps per preset (after 2 warm-up steps)")
    p.add_argument("--presets", nargs="*", default=["standard", "farskip"])
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from farskip_jax.config import load_config, replace
    from farskip_jax.data.pipeline import make_iterator
    from farskip_jax.model.transformer import Transformer
    from farskip_jax.train.flops import measure_matmul_peak, total_params, train_flops_per_token
    from farskip_jax.train.optimizer import make_optimizer
    from farskip_jax.train.step import init_state, make_train_step

    cfg = load_config(a.config, a.overrides)
    t = cfg.train
    dt = jnp.float32 if cfg.model.compute_dtype == "float32" else jnp.bfloat16
    peak0 = measure_matmul_peak(dt, seconds=1.0)
    flops_tok = train_flops_per_token(cfg, t.seq_len)
    print(f"{a.config}: {total_params(cfg) / 1e6:.2f}M params, {flops_tok / 1e6:.1f} MFLOP/token, "
          f"batch {t.batch_size} x {t.seq_len}, device {jax.devices()[0].device_kind}, "
          f"{os.cpu_count()} cpus", flush=True)
    results = {}
    for preset in a.presets:
        c = replace(cfg, **{"farskip.preset": preset})
        tx, schedule = make_optimizer(c.train)
        graphdef, state = init_state(Transformer(c, rngs=nnx.Rngs(0)), tx, 0)
        step = jax.jit(make_train_step(graphdef, c, tx, schedule), donate_argnums=0)
        it = make_iterator(c.data, "train", batch_size=t.batch_size, seq_len=t.seq_len, seed=0)
        batches = [{k: jnp.asarray(v) for k, v in next(it).items()} for _ in range(a.steps + 2)]
        times = []
        for i, b in enumerate(batches):
            t0 = time.perf_counter()
            state, m = step(state, b)
            jax.block_until_ready(m["loss"])
            if i >= 2:
                times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        results[preset] = med
        print(f"  {preset:>9}: {t.batch_size * t.seq_len / med:,.0f} tokens/s (median step {1e3 * med:.1f} ms, "
              f"loss {float(m['loss']):.3f})", flush=True)
    peak = max(peak0, measure_matmul_peak(dt, seconds=1.0))
    print(f"measured matmul peak ({jnp.dtype(dt).name}, 1024^3 chain): {peak / 1e9:.1f} GFLOP/s per device")
    for preset, med in results.items():
        tps = t.batch_size * t.seq_len / med
        print(f"  {preset:>9}: MFU {100 * tps * flops_tok / (peak * jax.device_count()):.1f}%")
    if "standard" in results and "farskip" in results:
        print(f"farskip / standard step time: {results['farskip'] / results['standard']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

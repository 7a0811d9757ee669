"""Where the optimizer update lives in memory: the non-finite guard as a lax.cond vs a select, side by
side, on the real train step compiled deviceless for 8 H200s (XLA:GPU's memory analysis).

    JAX_PLATFORMS=cpu python -m benchmarks.optimizer_memory --config configs/deepseek_v2_lite.yaml \\
        --layers 2,3 --seq 256 [--mode pretrain,fcsd] [overrides ...]

At a short sequence the activations are small, so the temporaries show the update phase: the
gradients (one fp32 copy of the parameters) and, under a cond, a second copy of the parameters and
both AdamW moments (a cond's branch outputs cannot alias the donated state). `train/step.apply_if_finite`
lowers the select on GPU/TPU and keeps the cond on the CPU (faster there). Prints GiB per GPU and the
ratio temporaries / parameters; --out writes JSON."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GIB = 2**30


def compile_temp(cfg, mode: str, layers: int, seq: int, guard: str) -> dict:
    import farskip_jax.train.step as step
    from farskip_jax.analysis import memory as mp
    from farskip_jax.parallel.mesh import make_mesh

    c = mp.cut_depth(mp.mode_config(cfg, mode, cfg.runtime.remat, cfg.mesh.fsdp), layers)
    mesh = make_mesh(c.mesh, mp.plan_devices(c))
    original = step.apply_if_finite
    step.apply_if_finite = functools.partial(original, guard=guard)
    try:
        t0 = time.time()
        fn, args, parts = mp.abstract_program(c, mode, mesh, 1, seq)
        m = fn.lower(*args).compile(compiler_options=mp.compile_flags()).memory_analysis()
    finally:
        step.apply_if_finite = original
    return dict(mode=mode, layers=layers, seq=seq, guard=guard, temp=int(m.temp_size_in_bytes),
                argument=int(m.argument_size_in_bytes), alias=int(m.alias_size_in_bytes),
                params=int(parts["params"]), optimizer=int(parts["optimizer"]), compile_s=time.time() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=os.path.join(ROOT, "configs/deepseek_v2_lite.yaml"))
    ap.add_argument("--layers", default="2,3")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--mode", default="pretrain")
    ap.add_argument("--out", default=None)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    import farskip_jax  # noqa: F401  (quiet start before jax)
    from farskip_jax.config import load_config

    cfg = load_config(a.config, a.overrides)
    rows = []
    print(f"{'mode':8s} {'layers':>6s} {'params':>8s} {'moments':>8s} {'temp cond':>10s} {'temp select':>12s} "
          f"{'cond/params':>11s} {'select/params':>13s} {'saved':>8s}  (GiB per GPU)", flush=True)
    for mode in a.mode.split(","):
        for layers in (int(x) for x in a.layers.split(",")):
            r = {g: compile_temp(cfg, mode, layers, a.seq, g) for g in ("cond", "select")}
            p = r["cond"]["params"]
            print(f"{mode:8s} {layers:6d} {p / GIB:8.2f} {r['cond']['optimizer'] / GIB:8.2f} {r['cond']['temp'] / GIB:10.2f} "
                  f"{r['select']['temp'] / GIB:12.2f} {r['cond']['temp'] / p:11.2f} {r['select']['temp'] / p:13.2f} "
                  f"{(r['cond']['temp'] - r['select']['temp']) / GIB:8.2f}", flush=True)
            rows += list(r.values())
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(dict(config=a.config, overrides=a.overrides, seq=a.seq, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

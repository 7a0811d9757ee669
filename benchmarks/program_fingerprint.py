"""Fingerprint of the lowered train step of a config: for refactors that must not change the program.

    python benchmarks/program_fingerprint.py OUT.mlir [--config configs/tiny.yaml] [overrides ...]

Builds the train step as benchmarks/train_throughput.py does (a Transformer by hand, the config's
kernels installed, one batch of the embedded corpus), lowers it for this machine's CPU and writes the
StableHLO without location info to OUT.mlir; prints its line count, a hash and the custom calls it
makes. Two checkouts (run each with PYTHONPATH=<checkout>) that print the same hash compile the same
program: same numerics, same speed (docs/cpu_speed.md, "The kernel seam" section). A checkout from
before farskip_jax/kernels/ existed chose its kernels inside model/ (the FARSKIP_* variables).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from farskip_jax.config import load_config
    from farskip_jax.data.pipeline import make_iterator
    from farskip_jax.model.transformer import Transformer
    from farskip_jax.train.optimizer import make_optimizer
    from farskip_jax.train.step import init_state, make_train_step

    cfg = load_config(a.config, a.overrides)
    try:
        from farskip_jax import kernels

        kernels.install(cfg.kernels)
    except ImportError:  # a checkout from before the kernel seam
        pass
    tx, schedule = make_optimizer(cfg.train)
    graphdef, state = init_state(Transformer(cfg, rngs=nnx.Rngs(0)), tx, 0)
    it = make_iterator(cfg.data, "train", batch_size=cfg.train.batch_size, seq_len=cfg.train.seq_len, seed=0)
    batch = {k: jnp.asarray(v) for k, v in next(it).items()}
    text = jax.jit(make_train_step(graphdef, cfg, tx, schedule)).lower(state, batch).as_text(debug_info=False)
    text = re.sub(r"#loc\d*", "", text)
    with open(a.out, "w") as f:
        f.write(text)
    calls = sorted(set(re.findall(r"custom_call @([\w.]+)\(", text)))
    print(f"{a.out}: {len(text.splitlines())} lines, sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}, "
          f"custom calls {({c: text.count(f'@{c}(') for c in calls})}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

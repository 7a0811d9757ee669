"""Step time of each connectivity relative to `standard`, measured side by side in one run.

FarSkip changes only which stream each sub-block reads; on one device (no collectives to hide) it
should cost nothing. This times a forward+backward+SGD step of the same model under every preset,
interleaving the variants for `--repeats` rounds and reporting the median ratio to standard.

    python -m benchmarks.connectivity_cost [--config configs/tiny.yaml] [key=value ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from farskip_jax.config import FarSkipConfig, load_config  # noqa: E402
from farskip_jax.model import Transformer  # noqa: E402

VARIANTS = {
    "standard": FarSkipConfig(preset="standard"),
    "farskip": FarSkipConfig(preset="farskip"),
    "attn_only": FarSkipConfig(preset="attn_only"),
    "mlp_only": FarSkipConfig(preset="mlp_only"),
    "skip_distance=2": FarSkipConfig(preset="farskip", skip_distance=2),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.yaml" if os.path.exists("configs/tiny.yaml") else None)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5, help="steps per timed round")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = load_config(args.config, args.overrides)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    b, s = cfg.train.batch_size, cfg.train.seq_len
    tokens = jax.random.randint(jax.random.key(0), (b, s + 1), 0, cfg.model.vocab_size)

    def make_step(fs):
        def loss_fn(st):
            out = nnx.merge(graphdef, st)(tokens[:, :-1], farskip=fs)
            lp = jax.nn.log_softmax(out.logits)
            return -jnp.take_along_axis(lp, tokens[:, 1:, None], -1).mean() + 0.01 * out.aux_loss

        @jax.jit
        def step(st):
            loss, g = jax.value_and_grad(loss_fn)(st)
            return jax.tree.map(lambda p, d: p - 1e-3 * d, st, g), loss

        return step

    steps = {name: make_step(fs) for name, fs in VARIANTS.items()}
    for name, fn in steps.items():  # compile + warm up
        jax.block_until_ready(fn(state))
    times = {name: [] for name in steps}
    for r in range(args.repeats):
        for name, fn in steps.items():
            st = state
            t0 = time.perf_counter()
            for _ in range(args.steps):
                st, loss = fn(st)
            jax.block_until_ready(loss)
            times[name].append((time.perf_counter() - t0) / args.steps)
        print(f"round {r + 1}/{args.repeats} done", flush=True)
    base = statistics.median(times["standard"])
    print(f"\nmodel: {cfg.model.num_layers} layers, d_model {cfg.model.d_model}, {cfg.moe.num_experts} experts "
          f"top-{cfg.moe.top_k}; batch {b} x seq {s}; device {jax.devices()[0].platform}")
    print(f"{'variant':<18}{'median step ms':>16}{'ratio to standard':>20}")
    for name in steps:
        med = statistics.median(times[name])
        print(f"{name:<18}{med * 1e3:>16.2f}{med / base:>20.3f}")


if __name__ == "__main__":
    main()

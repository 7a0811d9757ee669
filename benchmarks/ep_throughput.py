"""Expert parallelism on 8 CPU devices: train-step tokens/s of EP=8 vs EP=1 data parallelism, and the
bytes each all-to-all moves compared with the analytic minimum. Side by side in one run.

    python -m benchmarks.ep_throughput [--steps 10] [--batch 32] [--seq 64] [--d-model 64]
                                       [--experts 8] [--top-k 2] [--capacity-factor 1.25]

Variants (same weights, same batch, train step = jax.value_and_grad of the next-token loss + SGD):
  dp8        mesh data=8, runtime.dispatch=local: experts replicated, each device routes its own tokens
  ep8        mesh expert=8, runtime.dispatch=all_to_all, dropless (capacity = worst case)
  ep8@cfX    the same with runtime.capacity_factor=X (fixed buffers ~X times the useful rows)
Timing: steps interleaved (one of each variant per round), median per variant; the ratios are
against dp8. On a CPU the 8 "devices" share the host's cores and an all-to-all is a memory copy, so
the ratio measures the overhead of the exchange code (packing, buffers, extra collectives), not
network time.

Bytes: every all-to-all of the compiled step (forward and backward), its per-device buffer from
the HLO shapes; moved = buffer x devices x (ep-1)/ep; minimum = tokens x top_k x d_model x bytes x
(ep-1)/ep (each routed row crosses once). Fixed dropless buffers hold E/top_k times the rows.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

DEVICES = 8


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10, help="timed rounds (after one warm-up)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-hidden", type=int, default=128)
    p.add_argument("--capacity-factor", type=float, default=1.25, help="for the ep8@cf variant (0: skip it)")
    p.add_argument("--gmm", default="auto", help="grouped matmul backend (auto = tiled on CPU)")
    p.add_argument("--xla-preset", default="cpu", help="XLA flag preset applied before JAX starts")
    return p.parse_args(argv)


_A2A = re.compile(r"^\s*(%all-to-all[\w.\-]*)\s*=\s*(.*?)\s+all-to-all\(.*op_name=\"([^\"]*)\"")
_SHAPE = re.compile(r"\b(f32|bf16|f16|s32|u32|f64|s64)\[([\d,]*)\]")
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f64": 8, "s64": 8}


def all_to_alls(hlo_text: str) -> list[dict]:
    """Every all-to-all of the ENTRY computation: name, op_name, per-device bytes of its buffer."""
    out = []
    for line in hlo_text.splitlines():
        m = _A2A.match(line)
        if not m:
            continue
        shapes = _SHAPE.findall(m.group(2))
        nbytes = sum(_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d) for t, dims in shapes)
        op = m.group(3)
        layer = re.search(r"layer_(\d+)", op)
        out.append(dict(name=m.group(1), op_name=op, bytes=nbytes, dtype=shapes[0][0] if shapes else "?",
                        layer=int(layer.group(1)) if layer else -1,
                        step="dispatch" if "/dispatch" in op else "combine" if "/combine" in op else "?",
                        direction="bwd" if "transpose(" in op else "fwd"))
    return out


def main(argv=None) -> int:
    a = parse_args(argv)
    from farskip_jax.parallel.xla_flags import apply_xla_preset

    apply_xla_preset(a.xla_preset, host_devices=DEVICES)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from farskip_jax.config import Config, MeshConfig, ModelConfig, MoEConfig, RuntimeConfig, TrainConfig
    from farskip_jax.parallel import create_model, make_mesh, shard_batch

    def config(dispatch, expert, cf=None):
        return Config(
            model=ModelConfig(d_model=a.d_model, num_layers=a.layers, num_heads=4, num_kv_heads=2, vocab_size=256,
                              mlp_hidden=4 * a.d_model, max_seq_len=a.seq),
            moe=MoEConfig(num_experts=a.experts, top_k=a.top_k, expert_hidden=a.expert_hidden),
            runtime=RuntimeConfig(dispatch=dispatch, capacity_factor=cf, gmm=a.gmm),
            mesh=MeshConfig(data=DEVICES // expert, expert=expert), train=TrainConfig(seq_len=a.seq, batch_size=a.batch))

    variants = {"dp8": config("local", 1), "ep8": config("all_to_all", DEVICES)}
    if a.capacity_factor > 0:
        variants[f"ep8@cf{a.capacity_factor:g}"] = config("all_to_all", DEVICES, a.capacity_factor)

    def loss_fn(model, toks):
        out = model(toks)
        logp = jax.nn.log_softmax(out.logits[:, :-1])
        ce = -jnp.mean(jnp.take_along_axis(logp, toks[:, 1:, None], axis=-1))
        return ce + 0.01 * out.aux_loss, out.dropped

    def make_step(graphdef):
        def step(params, toks):
            (loss, dropped), g = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), toks), has_aux=True)(params)
            return jax.tree.map(lambda p, g: p - 1e-2 * g, params, g), loss, dropped

        return jax.jit(step, donate_argnums=0)

    toks_np = np.random.RandomState(0).randint(0, 256, (a.batch, a.seq)).astype(np.int32)
    tokens = a.batch * a.seq
    runs = {}
    for name, cfg in variants.items():
        mesh = make_mesh(cfg.mesh)
        graphdef, params = nnx.split(create_model(cfg, mesh, seed=0))
        toks = shard_batch(toks_np, mesh)
        t0 = time.perf_counter()
        compiled = make_step(graphdef).lower(params, toks).compile()
        print(f"compiled {name:12s} in {time.perf_counter() - t0:5.1f} s", flush=True)
        params, loss, dropped = compiled(params, toks)  # warm-up
        jax.block_until_ready(params)
        runs[name] = dict(step=compiled, params=params, toks=toks, times=[], hlo=compiled.as_text(),
                          loss=float(loss), dropped=int(dropped))

    for _ in range(a.steps):
        for r in runs.values():
            t0 = time.perf_counter()
            r["params"], loss, _ = r["step"](r["params"], r["toks"])
            jax.block_until_ready(loss)
            r["times"].append(time.perf_counter() - t0)

    print(f"\ntrain step, {DEVICES} CPU devices, batch {a.batch} x seq {a.seq} = {tokens} tokens, d_model {a.d_model}, "
          f"{a.layers} layers, {a.experts} experts top-{a.top_k}, gmm {a.gmm}, xla preset {a.xla_preset}, "
          f"median of {a.steps}")
    base = statistics.median(runs["dp8"]["times"])
    print(f"{'variant':14s} {'ms/step':>9s} {'tokens/s':>10s} {'vs dp8':>8s} {'dropped/step':>13s}")
    for name, r in runs.items():
        t = statistics.median(r["times"])
        print(f"{name:14s} {t * 1e3:9.1f} {tokens / t:10.0f} {base / t:8.2f}x {r['dropped']:13d}")

    ep = DEVICES
    bytes_el = 4  # fp32 compute
    minimum = tokens * a.top_k * a.d_model * bytes_el * (ep - 1) / ep
    for name, r in runs.items():
        if name == "dp8":
            assert not all_to_alls(r["hlo"]), "data parallelism must not exchange tokens"
            continue
        print(f"\nall-to-alls of {name} (per layer; minimum = tokens x top_k x d_model x 4 B x (ep-1)/ep = "
              f"{minimum / 1024:.1f} KiB)")
        print(f"{'layer':>5s} {'step':9s} {'dir':4s} {'dtype':5s} {'per device':>11s} {'moved':>10s} {'vs min':>7s}")
        for c in sorted(all_to_alls(r["hlo"]), key=lambda c: (c["layer"], c["direction"] == "bwd", c["step"], c["bytes"])):
            moved = c["bytes"] * DEVICES * (ep - 1) / ep
            ratio = f"{moved / minimum:6.2f}x" if c["dtype"] != "s32" else "  (counts)"
            print(f"{c['layer']:5d} {c['step']:9s} {c['direction']:4s} {c['dtype']:5s} {c['bytes'] / 1024:9.1f}Ki "
                  f"{moved / 1024:8.1f}Ki {ratio}")
    print("\nexpected: dropless fixed buffers move E/top_k = "
          f"{a.experts / a.top_k:g}x the minimum; capacity factor cf moves ~cf x (ragged_all_to_all: 1x, GPU only)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

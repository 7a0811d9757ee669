"""Measure scheduling levers one at a time: how much all-to-all time XLA hides, standard vs farskip.

    python -m farskip_jax.studies.overlap_levers [--layers 4] [--seq 4096] [--levers no_lhs,lhs_only,preset,moe_first]
                                        [--hardware mi300x] [--contention 0.8] [--attention fused|naive]
                                        [extra config overrides ...]

DeepSeek-V2-Lite shapes (MLA, 64 routed experts top-6, 2 shared, first layer dense), EP=8, batch 8
x seq 4096 (one sequence per GPU), all_to_all backend with capacity factor 1 (bytes = useful
bytes), compiled deviceless for 8 x H100 (the train step; its forward half is the forward). Levers:

  no_lhs      latency-hiding scheduler off (XLA's default order)
  lhs_only    LHS on, one collective in flight (XLA defaults otherwise)
  preset      parallel/xla_flags.py `cuda_hopper` (LHS, 2 collectives in flight, high-priority stream)
  moe_first   preset + the block issues its MoE before its attention when the MoE reads the outdated
              stream (FarSkip layers; a code-order change that leaves every value unchanged)
  blockwise   preset + runtime.attention_impl=blockwise (flash-style attention core, causal blocks
              skipped: a cheaper step, so a larger all-to-all share)

Prints one row per (lever, connectivity): hidden fraction fwd / bwd, hidden / structural bound,
modelled step time and farskip/standard speedup (and, two-stream model, its split into hiding
communication x compute difference: analysis/speedup.py), under XLA's cost model and the two-stream
model (contention and attention pricing as analysis/overlap.py);
then per (lever, model) the ceiling (standard's step with every all-to-all hidden) and farskip vs
standard WITHOUT overlap (all-to-alls synchronous: the paper's Megatron baseline, not XLA's standard).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
from farskip_jax.model.layer_step import LayerStep
from farskip_jax.analysis.deviceless import LHS_FLAGS, preset_options
from farskip_jax.analysis.cost_model import HARDWARE, with_contention
from farskip_jax.analysis.overlap import no_overlap_step, run_overlap
from farskip_jax.analysis.speedup import split_speedup
from farskip_jax.config import load_config, replace
from farskip_jax.errors import FarSkipError

DSV2_LITE = [
    "model.vocab_size=102400", "model.d_model=2048", "model.num_heads=16", "model.num_kv_heads=16",
    "model.attention=mla", "model.kv_lora_rank=512", "model.qk_nope_head_dim=128", "model.qk_rope_head_dim=64",
    "model.v_head_dim=128", "model.first_k_dense=1", "model.mlp_hidden=10944", "runtime.compute_dtype=bfloat16",
    "runtime.param_dtype=float32", "moe.num_experts=64", "moe.top_k=6", "moe.expert_hidden=1408",
    "moe.num_shared_experts=2", "runtime.dispatch=all_to_all", "runtime.capacity_factor=1.0", "mesh.data=1",
    "mesh.expert=8",
]


@contextlib.contextmanager
def moe_first():
    """The layer step (model/layer_step.py) issuing the MoE before attention when it reads R_{k-1}
    (moe input `outdated`; same values)."""

    orig = LayerStep.layer

    def layer(self, block, x, full, extra, site, plan, cache):
        if site.kinds[1] != "outdated":
            return orig(self, block, x, full, extra, site, plan, cache)
        out = block.ffn(full, **self.ffn_options(block, extra, site, plan))
        a, cache = block.attend(x, self.positions, self.segment_ids, cache, self.attention_of(site, plan))
        a, held = self.attention_sum(a, extra, site, plan)
        return self.finish(out, a, held, site, plan), cache

    LayerStep.layer = layer
    try:
        yield
    finally:
        LayerStep.layer = orig


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--levers", default="no_lhs,lhs_only,preset,moe_first")
    ap.add_argument("--programs", default="train")
    ap.add_argument("--hardware", default="mi300x")
    ap.add_argument("--target", default="h100_sxm", help="XLA target spec (h100_sxm, h200)")
    ap.add_argument("--contention", type=float, default=None,
                    help="two-stream model: compute speed under a collective in flight (default: the hardware's)")
    ap.add_argument("--attention", default="fused", choices=("fused", "naive"),
                    help="two-stream model: attention_core as flash kernels (fused) or as compiled")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()


    try:
        with_contention(HARDWARE[a.hardware], a.contention)
    except (FarSkipError, KeyError) as e:
        print(f"error: --hardware {a.hardware!r} / --contention {a.contention}: {e}", file=sys.stderr)
        return 2

    cfg = load_config(None, DSV2_LITE + [f"model.num_layers={a.layers}", f"model.max_seq_len={a.seq}",
                                         f"train.seq_len={a.seq}", f"train.batch_size={a.batch}"] + a.overrides)
    levers = {
        "no_lhs": (dict(LHS_FLAGS, xla_gpu_enable_latency_hiding_scheduler=False), contextlib.nullcontext),
        "lhs_only": (dict(LHS_FLAGS), contextlib.nullcontext),
        "preset": (dict(preset_options("cuda_hopper"), **LHS_FLAGS), contextlib.nullcontext),
        "moe_first": (dict(preset_options("cuda_hopper"), **LHS_FLAGS), moe_first),
        "blockwise": (dict(preset_options("cuda_hopper"), **LHS_FLAGS), contextlib.nullcontext),
    }
    lever_cfg = {"blockwise": replace(cfg, **{"runtime.attention_impl": "blockwise"})}
    log = lambda m: print(m, file=sys.stderr, flush=True)
    rows, extra = [], []
    for name in a.levers.split(","):
        flags, ctx = levers[name]
        t0 = time.time()
        with ctx():
            res = run_overlap(lever_cfg.get(name, cfg), ("standard", "farskip"), a.programs.split(","), a.batch,
                              a.seq, target=a.target, flags=flags, hardware=a.hardware, log=log,
                              contention=a.contention, fused_attention=a.attention == "fused")
        log(f"[levers] {name}: {time.time() - t0:.0f}s")
        for prog in a.programs.split(","):
            sel = {r.preset: r for r in res if r.program == prog}
            for model in ("xla", a.hardware):
                reps = {p: (r.report if model == "xla" else r.modelled) for p, r in sel.items()}
                base = reps["standard"].step_time
                serial = sel["standard"].serial if model != "xla" else None
                nov = no_overlap_step(reps["standard"], serial)
                sp = split_speedup(reps["standard"], reps["farskip"])
                extra.append((name, prog, model, reps["standard"].ceiling_speedup(), nov / 1e3,
                              nov / reps["farskip"].step_time, sp.hiding, sp.compute))
                for p, rep in reps.items():
                    f, b = rep.totals("fwd"), rep.totals("bwd")
                    rows.append((name, prog, model, p, 100 * f["hidden_frac"], 100 * f["of_bound"],
                                 100 * b["hidden_frac"] if b["count"] else float("nan"),
                                 100 * b["of_bound"] if b["count"] else float("nan"),
                                 f["empty"] + b["empty"], rep.step_time / 1000, base / rep.step_time))
        print_rows(rows)
        print(f"\n{'lever':<10}{'program':<8}{'model':<8}{'ceiling':>9}{'no-ovl ms':>11}{'fs/no-ovl':>10}"
              f"{'fs/std: hide':>13}{'x compute':>10}"
              "   (ceiling = standard / (standard - its exposed all-to-all); no-ovl = standard with "
              "synchronous all-to-alls, XLA model: step + hidden; fs/std split: analysis/speedup.py)")
        for e in extra:
            print(f"{e[0]:<10}{e[1]:<8}{e[2]:<8}{e[3]:>8.3f}x{e[4]:>11.2f}{e[5]:>9.3f}x{e[6]:>12.3f}x{e[7]:>9.3f}x",
                  flush=True)
    return 0


def print_rows(rows):
    print(f"\n{'lever':<10}{'program':<8}{'model':<8}{'conn':<10}{'fwd hid%':>9}{'/bound':>8}{'bwd hid%':>9}"
          f"{'/bound':>8}{'empty':>6}{'step ms':>9}{'speedup':>9}")
    for r in rows:
        print(f"{r[0]:<10}{r[1]:<8}{r[2]:<8}{r[3]:<10}{r[4]:>9.1f}{r[5]:>8.1f}{r[6]:>9.1f}{r[7]:>8.1f}{r[8]:>6d}"
              f"{r[9]:>9.2f}{r[10]:>8.3f}x", flush=True)


if __name__ == "__main__":
    sys.exit(main())

"""MoE vs Federation of Experts (FoE) vs FoE + FarSkip: tiny pretraining loss with the same budget, and the
modelled step time of each from the overlap tool (deviceless 8-GPU compile).

    python -m farskip_jax.studies.foe_compare --steps 250                      # both parts
    python -m farskip_jax.studies.foe_compare --skip-overlap / --skip-train

Training: configs/foe_tiny.yaml (H = 2) and its H = 1 variant (= the ordinary MoE of tiny.yaml), same
seed, data, steps and parameter count, one device. Overlap: the same architecture at a GPU-sized shape
(OVERLAP_SHAPE, bf16, expert parallelism over 8 GPUs; FoE: 2 groups of 4 GPUs), train step compiled
for --target with the latency-hiding scheduler, XLA's cost model and the two-stream --hardware model.
Writes runs/foe_compare/{results.json, loss.png}. Modelled times are model outputs, not measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from farskip_jax.studies.harness import REPO, figure
from farskip_jax.config import load_config
from farskip_jax.train.trainer import train
from farskip_jax.analysis.groups import foe_summary
from farskip_jax.analysis.overlap import run_overlap
import numpy as np

VARIANTS = {  # name -> overrides of configs/foe_tiny.yaml
    "moe": ["runtime.num_groups=1"],
    "moe+farskip": ["runtime.num_groups=1", "farskip.preset=farskip"],
    "foe": [],
    "foe+farskip": ["farskip.preset=farskip"],
}
OVERLAP_SHAPE = ["model.d_model=1024", "model.num_layers=4", "model.num_heads=16", "model.num_kv_heads=4",
                 "model.mlp_hidden=4096", "model.vocab_size=32768", "model.max_seq_len=2048",
                 "runtime.compute_dtype=bfloat16", "moe.num_experts=16", "moe.top_k=4", "moe.expert_hidden=1024",
                 "runtime.dispatch=all_to_all", "runtime.capacity_factor=1.0", "mesh.data=1", "mesh.expert=8",
                 "train.batch_size=8", "train.seq_len=2048"]


def train_part(steps: int, out: str) -> dict:

    res = {}
    for name, ov in VARIANTS.items():
        cfg = load_config(os.path.join(REPO, "configs/foe_tiny.yaml"),
                          ov + [f"train.steps={steps}", f"train.run_dir={os.path.join(out, name)}",
                                "train.overwrite=true", "train.tensorboard=false", "train.checkpoint_every=0",
                                f"train.eval_every={max(steps // 5, 1)}", "train.log_every=50"])
        t0 = time.time()
        r = train(cfg, stream=open(os.devnull, "w"))
        res[name] = dict(losses=r.losses, val_loss=r.val_loss, final_loss=r.final_loss, wall_s=time.time() - t0)
        print(f"[train] {name:<12} final train loss {r.final_loss:.4f}  val loss {r.val_loss:.4f}  "
              f"({time.time() - t0:.0f}s)", flush=True)
    return res


def overlap_part(target: str, hardware: str) -> dict:

    res = {}
    for name, ov in VARIANTS.items():
        cfg = load_config(os.path.join(REPO, "configs/foe_tiny.yaml"), OVERLAP_SHAPE + ov)
        t0 = time.time()
        (r,) = run_overlap(cfg, (cfg.farskip.preset,), ("train",), target=target, hardware=hardware)
        f = foe_summary(r.hlo_text, r.mesh) if r.mesh is not None else None
        tot = r.report.totals("all")
        res[name] = dict(step_us=r.report.step_time, modelled_step_us=r.modelled.step_time,
                         a2a_us=tot["duration"], a2a_exposed_us=tot["exposed"],
                         modelled_a2a_exposed_us=r.modelled.totals("all")["exposed"],
                         other_collectives_us=r.report.other_collective_time,
                         a2a_bytes=f.all_to_all_bytes if f else None,
                         cross_group_bytes=f.cross_group_bytes if f else None,
                         confined=f.confined if f else None, compile_s=time.time() - t0)
        print(f"[overlap] {name:<12} XLA {r.report.step_time / 1e3:8.2f} ms  {hardware} "
              f"{r.modelled.step_time / 1e3:8.2f} ms  ({time.time() - t0:.0f}s)", flush=True)
    return res


def table(results: dict) -> str:
    tr, ov = results.get("train", {}), results.get("overlap", {})
    names = list(VARIANTS)
    lines = [f"{'variant':<13}{'train loss':>11}{'val loss':>10}{'XLA step ms':>13}{'x moe':>7}"
             f"{'2-stream ms':>13}{'x moe':>7}{'a2a exposed us':>16}{'a2a MB/dev':>12}{'cross-grp MB':>14}"]
    for n in names:
        t, o = tr.get(n, {}), ov.get(n, {})
        base = ov.get("moe", {})
        f = lambda v, fmt: fmt.format(v) if v is not None else " " * (len(fmt.format(0.0)) - 1) + "-"  # noqa: E731
        sp = lambda k: (base[k] / o[k]) if o and base else None  # noqa: E731
        lines.append(f"{n:<13}{f(t.get('final_loss'), '{:>11.4f}')}{f(t.get('val_loss'), '{:>10.4f}')}"
                     f"{f(o.get('step_us', 0) / 1e3 if o else None, '{:>13.2f}')}{f(sp('step_us'), '{:>6.3f}x')}"
                     f"{f(o.get('modelled_step_us', 0) / 1e3 if o else None, '{:>13.2f}')}"
                     f"{f(sp('modelled_step_us'), '{:>6.3f}x')}{f(o.get('a2a_exposed_us'), '{:>16.0f}')}"
                     f"{f(o['a2a_bytes'] / 2**20 if o and o.get('a2a_bytes') is not None else None, '{:>12.2f}')}"
                     f"{f(o['cross_group_bytes'] / 2**20 if o and o.get('cross_group_bytes') is not None else None, '{:>14.2f}')}")
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:

    with figure(path, figsize=(7, 4), dpi=120) as (fig, ax):
        for n, t in results["train"].items():
            y = np.asarray(t["losses"])
            w = 10
            ys = np.convolve(y, np.ones(w) / w, mode="valid")
            ax.plot(np.arange(w, len(y) + 1), ys, label=f"{n} (val {t['val_loss']:.3f})")
        ax.set_xlabel("step")
        ax.set_ylabel("train loss (10-step mean)")
        ax.set_title("tiny pretraining: MoE vs FoE (H=2) vs + FarSkip, same budget")
        ax.legend()
        ax.grid(alpha=0.3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--out", default=os.path.join(REPO, "runs/foe_compare"))
    ap.add_argument("--target", default="h200")
    ap.add_argument("--hardware", default="mi300x")
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--skip-overlap", action="store_true")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "results.json")
    results = json.load(open(path)) if os.path.isfile(path) else {}
    if not a.skip_train:
        results["train"] = train_part(a.steps, a.out)
    if not a.skip_overlap:
        results["overlap"] = overlap_part(a.target, a.hardware)
        results["overlap_config"] = dict(shape=OVERLAP_SHAPE, target=a.target, hardware=a.hardware)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(table(results))
    if results.get("train"):
        plot(results, os.path.join(a.out, "loss.png"))
        print(f"wrote {os.path.join(a.out, 'loss.png')}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

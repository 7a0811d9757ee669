"""Peak host memory of importing an HF checkpoint, side by side with the checkpoint's size.

    python -m benchmarks.import_memory [--mb 300] [--keep DIR]

Generates a DeepSeek-V3-layout checkpoint (MLA, 1 dense + MoE layers, random fp32 weights, written
tensor by tensor in 4 shards, so generating it is also low-memory), then measures in fresh child
processes the peak RSS (VmHWM) above the process's RSS right before the import, for:

  cli_import     `python -m farskip_jax.convert import` path: HF -> our folder, no JAX arrays;
                 should stay near the largest single tensor, far below the checkpoint size
  import_hf      import_hf onto the (CPU) device: the parameters themselves live in host RAM here,
                 so ~1x the checkpoint is the floor; more would mean a second copy was materialised
  import_hf_bf16 import_hf(dtype="bfloat16"): ~0.5x (the parameters are cast slice by slice)

Ratios (peak delta / checkpoint bytes) are the numbers to read; absolute MB depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hf_config(mb: float) -> dict:
    d, e, hid, layers = 512, 32, 256, 2
    per_layer = 3 * e * d * hid * 4
    layers = max(2, int(mb * 1e6 // per_layer) + 1)
    return dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=4096, hidden_size=d,
                intermediate_size=1024, moe_intermediate_size=hid, num_hidden_layers=layers, num_attention_heads=8,
                num_key_value_heads=8, n_routed_experts=e, num_experts_per_tok=4, n_shared_experts=1,
                first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=16, qk_nope_head_dim=32,
                v_head_dim=32, n_group=4, topk_group=2, rms_norm_eps=1e-6, max_position_embeddings=1024,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)


def generate(path: str, mb: float) -> int:
    """Write the checkpoint; returns its tensor bytes."""
    from farskip_jax.loading.families import deepseek
    from farskip_jax.loading.hf_folder import hf_to_config
    from farskip_jax.loading.safetensors_io import write_file

    hf = hf_config(mb)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    shapes = {}
    for s in deepseek.specs(hf_to_config(hf)):
        shapes.update(s.hf_shapes())
    names = list(shapes)
    groups = np.array_split(np.arange(len(names)), 4)
    rng = np.random.default_rng(0)
    weight_map, total = {}, 0
    for gi, idx in enumerate(groups):
        fname = f"model-{gi + 1:05d}-of-00004.safetensors"
        group = [names[i] for i in idx]
        write_file(os.path.join(path, fname), [(n, shapes[n], np.float32) for n in group],
                   lambda n: rng.standard_normal(shapes[n], dtype=np.float32) * 0.02)
        for n in group:
            weight_map[n] = fname
            total += int(np.prod(shapes[n])) * 4
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total


CHILD = r"""
import os, sys, json, time
os.environ.setdefault("JAX_PLATFORMS", "cpu")
def rss(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
import jax, numpy as np
from farskip_jax.loading.hf_folder import import_hf
from farskip_jax.convert.native import write_native_from_hf
jax.numpy.zeros(1).block_until_ready()
base = rss("VmRSS")
t0 = time.time()
mode, src, out = sys.argv[1:4]
if mode == "cli_import":
    write_native_from_hf(src, out)
else:
    cfg, model = import_hf(src, dtype="bfloat16" if mode == "import_hf_bf16" else None)
    jax.block_until_ready(jax.tree.leaves(__import__("flax").nnx.state(model)))
print(json.dumps(dict(base=base, peak=rss("VmHWM"), seconds=time.time() - t0)))
"""


def measure(mode: str, src: str, out: str) -> dict:
    # run from the repository root: `python -c` finds this checkout's farskip_jax first
    res = subprocess.run([sys.executable, "-c", CHILD, mode, src, out], capture_output=True, text=True, cwd=ROOT)
    if res.returncode:
        raise SystemExit(f"{mode} failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=300.0, help="approximate checkpoint size in MB")
    ap.add_argument("--keep", default=None, help="folder to generate into (kept); default a temp folder")
    a = ap.parse_args()
    work = a.keep or tempfile.mkdtemp(prefix="import_memory-")
    src = os.path.join(work, "hf")
    t0 = time.time()
    size = generate(src, a.mb)
    biggest = max(int(np.prod(s)) * 4 for s in _shapes(src))
    print(f"checkpoint: {size / 1e6:.0f} MB in 4 shards (largest tensor {biggest / 1e6:.1f} MB), "
          f"generated in {time.time() - t0:.1f}s")
    print(f"{'mode':16s} {'peak - base (MB)':>17s} {'/ checkpoint':>13s} {'seconds':>8s}")
    for mode in ("cli_import", "import_hf", "import_hf_bf16"):
        r = measure(mode, src, os.path.join(work, f"out_{mode}"))
        delta = r["peak"] - r["base"]
        print(f"{mode:16s} {delta / 1e6:17.0f} {delta / size:13.2f} {r['seconds']:8.1f}", flush=True)
    if not a.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)


def _shapes(path):
    from farskip_jax.loading.reader import HFCheckpoint

    ck = HFCheckpoint(path)
    return [ck.shape(n) for n in ck.names()]


if __name__ == "__main__":
    main()

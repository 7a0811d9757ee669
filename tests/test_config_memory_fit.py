"""The shipped real-shape training configs fit the node their header names, per the memory plan
(analysis/memory.py): the real train step compiled deviceless (no GPU, nothing allocated) at the
config's full depth (scanned layers) and two per-device batches, and the largest per-GPU batch
that fits in 0.75 x the device memory is at least the config's train.batch_size per GPU.
Slow: two full-depth compiles of a real model per config (one to several minutes each on 2 cores)."""

import os

import pytest

from farskip_jax.analysis import memory as mp
from farskip_jax.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NODES = {  # config -> the device its header names
    "deepseek_v2_lite": "mi300x",
    "qwen3_30b_a3b": "mi300x",
    "llama4_scout": "mi300x",
}


def test_real_configs_name_their_node_and_the_memory_settings():
    for name, device in NODES.items():
        cfg = load_config(os.path.join(ROOT, "configs", f"{name}.yaml"))
        assert cfg.runtime.capacity_factor is not None, name  # dropless all_to_all sizes buffers for the worst case
        assert cfg.train.loss_chunk, name  # no [b, s, V] f32 logits
        assert cfg.runtime.scan_layers, name  # the plan compiles the full depth
        with open(os.path.join(ROOT, "configs", f"{name}.yaml")) as f:
            header = "".join(line for line in f if line.startswith("#"))
        assert "MI300X" in header and device == "mi300x"


# minutes each (two full-depth compiles of a real model): -m extended; the plan itself is checked against
# compiled programs in the default run by tests/test_memory_plan.py
@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("name", sorted(NODES))
def test_real_config_fits_its_node(name):
    cfg = load_config(os.path.join(ROOT, "configs", f"{name}.yaml"))
    (row,) = mp.build_rows(cfg, ["pretrain"], [cfg.runtime.remat], [cfg.mesh.fsdp], mp.default_depths(cfg), [1, 2],
                           cfg.train.seq_len)
    per_gpu = cfg.train.batch_size // cfg.train.grad_accum // row.gpus
    capacity = mp.USABLE_FRACTION * mp.DEVICE_MEMORY[NODES[name]]
    assert row.max_batch(capacity) >= max(per_gpu, 1), mp.format_plan(name, [row], mp.USABLE_FRACTION)

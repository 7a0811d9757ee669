"""The shipped configs: every file loads; the real-shape 8 x MI300X configs build their full train
state abstractly (no memory) with the expected parameter count and expert sharding, and their train
step lowers (`jax.jit(step).lower(...)` on ShapeDtypeStructs, not run) at the real widths; depth is
cut to the first layers of each kind to keep the lowering in CI time."""

import glob
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from farskip_jax.config import load_config
from farskip_jax.parallel.mesh import make_mesh
from farskip_jax.parallel.sharding import batch_sharding
from farskip_jax.train.flops import total_params
from farskip_jax.loading.optimizer import make_optimizer
from farskip_jax.train.step import abstract_train_state, make_train_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REAL = {  # config -> (total params in billions (published), overrides that cut the depth for lowering)
    "deepseek_v2_lite": (15.7, ["model.num_layers=2"]),
    "qwen3_30b_a3b": (30.5, ["model.num_layers=2"]),
    "llama4_scout": (107.8, ["model.num_layers=4", "model.nope_layers=[3]", "model.chunked_layers=[0,1,2]"]),
}


def test_every_config_loads():
    names = [os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "configs", "*.yaml"))]
    for n in ("tiny.yaml", "small.yaml", "deepseek_v2_lite.yaml", "qwen3_30b_a3b.yaml", "llama4_scout.yaml"):
        assert n in names
    for n in names:
        if n.startswith("_"):  # base fragments (e.g. _mi300x_8.yaml) are only complete inside a config
            continue
        load_config(os.path.join(ROOT, "configs", n))
    small = load_config(os.path.join(ROOT, "configs", "small.yaml"))
    assert 50e6 <= total_params(small) <= 100e6


# DeepSeek-V2-Lite in the default run; the other real shapes with -m extended (their stacks are
# checked in the default run by test_scan_layers.test_plan_segments_of_the_real_shapes)
@pytest.mark.parametrize("name", [n if n == "deepseek_v2_lite" else pytest.param(n, marks=pytest.mark.extended)
                                  for n in sorted(REAL)])
def test_real_shape_train_step_lowers(name):
    billions, cut = REAL[name]
    one_node = ["mesh.fsdp=1"]  # the lowering needs only one node's 8 host devices (llama4_scout names 4 nodes)
    cut = cut + one_node
    cfg = load_config(os.path.join(ROOT, "configs", f"{name}.yaml"), one_node)
    assert cfg.mesh.expert == 8 and cfg.runtime.compute_dtype == "bfloat16" and cfg.runtime.param_dtype == "float32"
    mesh = make_mesh(cfg.mesh)
    tx, schedule = make_optimizer(cfg.train)
    _, full = abstract_train_state(cfg, mesh, tx)  # every layer, nothing allocated
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(full["params"]))
    assert abs(n / 1e9 - billions) / billions < 0.02, n
    assert abs(n - total_params(cfg)) / n < 0.01  # the MFU/size formula agrees with the model
    experts = [x for x in jax.tree.leaves(full["params"])  # [E, a, b], or [layers, E, a, b] under runtime.scan_layers
               if x.ndim in (3, 4) and x.shape[-3] == cfg.moe.num_experts]
    assert experts and all("expert" in str(x.sharding.spec) for x in experts)

    cfg = load_config(os.path.join(ROOT, "configs", f"{name}.yaml"), cut)
    graphdef, state = abstract_train_state(cfg, mesh, tx)
    b, s = cfg.train.batch_size, cfg.train.seq_len
    bs = batch_sharding(mesh)
    batch = {k: jax.ShapeDtypeStruct((b, s), jnp.float32 if k == "loss_mask" else jnp.int32, sharding=bs)
             for k in ("tokens", "targets", "positions", "segment_ids", "loss_mask")}
    lowered = jax.jit(make_train_step(graphdef, cfg, tx, schedule), donate_argnums=0).lower(state, batch)
    text = lowered.as_text()
    assert "all_to_all" in text or "all-to-all" in text  # expert parallelism is in the program
    assert "bf16" in text

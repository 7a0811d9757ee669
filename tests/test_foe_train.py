"""Federation of Experts through the trainer (issue 9): `parallel.create_model` / `model_mesh` build the
FoE mesh (expert axis split into group x expert) when runtime.num_groups > 1 and mesh.expert > 1, and
`train()` on it equals a single-device loop; checkpoints written on one FoE mesh resume on another.

Oracle: the same train step (train/step.py) jitted on ONE device with the ordinary single-device
model (no mesh, no collectives), fed the same batches (data pipeline, same seed).
"""

import jax
import numpy as np
from flax import nnx

from farskip_jax.config import load_config, replace
from farskip_jax.data.pipeline import make_dataset
from farskip_jax.data.tokenizer import load_tokenizer
from farskip_jax.model import Transformer
from farskip_jax.parallel.build import create_model, model_mesh
from farskip_jax.loading.optimizer import make_optimizer
from farskip_jax.loading.train_state import init_state
from farskip_jax.train.step import make_eval_step, make_train_step
from farskip_jax.train.trainer import train

STEPS = 4
SMALL = ["model.num_layers=2", "model.d_model=64", "model.mlp_hidden=128", "moe.expert_hidden=64",
         "train.batch_size=8", "train.seq_len=32", "train.warmup_steps=2", "train.eval_every=0",
         "train.eval_batches=2", "train.log_every=1", "train.checkpoint_every=0", "train.tensorboard=false",
         "train.peak_flops=1e11", "runtime.dispatch=all_to_all", f"train.steps={STEPS}"]


def _cfg(run_dir, *extra):
    return load_config("configs/foe_tiny.yaml", SMALL + [f"train.run_dir={run_dir}", *extra])


def _single_device_reference(cfg):
    """(per-step losses, val loss after the last step) of the train step on one device."""
    t = cfg.train
    model = Transformer(replace(cfg, **{"runtime.dispatch": "local"}), rngs=nnx.Rngs(t.seed))
    tx, schedule = make_optimizer(t)
    graphdef, state = init_state(model, tx, t.seed)
    step = jax.jit(make_train_step(graphdef, cfg, tx, schedule))
    tok = load_tokenizer(cfg.data.tokenizer)
    kw = dict(batch_size=t.batch_size, seq_len=t.seq_len, seed=t.seed, tokenizer=tok)
    it = iter(make_dataset(cfg.data, "train", **kw))
    losses = []
    for _ in range(t.steps):
        state, m = step(state, next(it))
        losses.append(float(m["loss"]))
    ev = jax.jit(make_eval_step(graphdef, cfg))
    vit = iter(make_dataset(cfg.data, "val", **kw))
    outs = [ev(state, next(vit)) for _ in range(t.eval_batches)]
    return losses, sum(float(o["ce_sum"]) for o in outs) / sum(float(o["tokens"]) for o in outs)


def test_model_mesh_and_create_model_build_the_foe_mesh():
    cfg = load_config("configs/foe_tiny.yaml", ["mesh.expert=4", "runtime.dispatch=all_to_all"])
    mesh = model_mesh(cfg)
    assert dict(mesh.shape) == dict(data=2, fsdp=1, group=2, expert=2, tensor=1)
    plain = model_mesh(replace(cfg, **{"runtime.num_groups": 1}))
    assert "group" not in plain.shape
    # a plain mesh is split over the same devices; experts land on their group's devices
    from farskip_jax.parallel.mesh import make_mesh

    model = create_model(cfg, make_mesh(cfg.mesh))
    w = model.layers[0].moe.experts.w_gate[...]
    assert w.sharding.mesh.shape == mesh.shape and tuple(w.sharding.spec)[0] == ("group", "expert")
    np.testing.assert_array_equal(w.sharding.mesh.devices, mesh.devices)
    for shard in w.addressable_shards:  # device (g, j) holds experts [g*4 + j*2, g*4 + j*2 + 2)
        g, j = [int(x) for x in np.argwhere(mesh.devices == shard.device)[0][2:4]]
        assert shard.index[0] == slice(g * 4 + j * 2, g * 4 + j * 2 + 2)


def test_trainer_on_foe_mesh_matches_single_device_and_resumes_across_meshes(tmp_path):
    run = str(tmp_path / "foe")
    ref_losses, ref_val = _single_device_reference(_cfg(run))
    # data 2 x group 2 x expert 2 (all-to-alls over 2 devices); a 1 ns time limit stops (and saves) after step 1
    a = train(_cfg(run, "mesh.expert=4", "train.time_limit_s=1e-9"))
    assert (a.status, a.step) == ("time_limit", 1)
    # resumed on group 2 x expert 4 (all-to-alls over 4 devices): steps 2-4, then the final eval
    b = train(_cfg(run, "mesh.expert=8"))
    assert (b.status, b.step, len(b.losses)) == ("done", STEPS, STEPS - 1)
    assert ref_losses[-1] < ref_losses[0] - 0.1  # it learns
    np.testing.assert_allclose(a.losses + b.losses, ref_losses, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(b.val_loss, ref_val, rtol=2e-5)

"""Shared helpers of the parallel tests, and the worker process of the multi-host test.

As a module: `tiny_config`, `loss_fn`, `loss_and_grads`, `step_summary` (imported by the tests).
As a script (launched by tests/test_parallel_multihost.py, one per process):

    python tests/multihost_worker.py --process-id 0 --num-processes 2 --port 12345 --local-devices 4 --out r.npz

it joins the others through `maybe_initialize` (gloo CPU collectives), builds the tiny EP model on a
mesh over every process's devices, feeds this process's rows of a fixed global batch and writes the
loss, the dropped count and every gradient (process 0 only, an .npz).
"""

from __future__ import annotations

import argparse
import os
import sys

BATCH, SEQ = 8, 16


def tiny_config(ep: int = 1, dispatch: str = "all_to_all", preset: str = "standard", data: int = -1, fsdp: int = 1,
                capacity_factor=None, gmm: str = "einsum", num_layers: int = 2, num_processes=None, process_id=None,
                port=None):
    from farskip_jax.config import Config, FarSkipConfig, MeshConfig, ModelConfig, MoEConfig, RuntimeConfig, TrainConfig

    mesh = MeshConfig(data=data, fsdp=fsdp, expert=ep)
    if num_processes:
        mesh = MeshConfig(data=data, fsdp=fsdp, expert=ep, distributed="on", coordinator_address=f"127.0.0.1:{port}",
                          num_processes=num_processes, process_id=process_id)
    return Config(
        model=ModelConfig(d_model=32, num_layers=num_layers, num_heads=4, num_kv_heads=2, vocab_size=64, mlp_hidden=64,
                          max_seq_len=SEQ),
        moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=32, num_shared_experts=1),
        runtime=RuntimeConfig(dispatch=dispatch, capacity_factor=capacity_factor, gmm=gmm),
        farskip=FarSkipConfig(preset=preset), mesh=mesh, train=TrainConfig(seq_len=SEQ, batch_size=BATCH),
    )


def tokens(seed: int = 0):
    import numpy as np

    return np.random.RandomState(seed).randint(0, 64, (BATCH, SEQ)).astype(np.int32)


def loss_fn(model, toks, preset=None):
    """Next-token cross-entropy + the router aux loss (so router gradients flow); aux = model output.
    preset: the connectivity of this call (default: the model's config)."""
    import jax
    import jax.numpy as jnp

    from farskip_jax.config import FarSkipConfig

    out = model(toks, farskip=None if preset is None else FarSkipConfig(preset=preset))
    logp = jax.nn.log_softmax(out.logits[:, :-1])
    ce = -jnp.mean(jnp.take_along_axis(logp, toks[:, 1:, None], axis=-1))
    return ce + 0.01 * out.aux_loss, out


def loss_and_grads(model, toks):
    """jit(value_and_grad) of loss_fn -> (loss, ModelOutput, grads State)."""
    from flax import nnx

    (loss, out), grads = nnx.jit(nnx.value_and_grad(loss_fn, has_aux=True))(model, toks)
    return loss, out, grads


def loss_and_grads_presets(model, toks, presets):
    """One jit computing loss_fn's value and gradients under each connectivity preset (the weights
    are shared) -> {preset: (loss, ModelOutput, grads)}."""
    import functools

    from flax import nnx

    def f(m, t):
        return {p: nnx.value_and_grad(functools.partial(loss_fn, preset=p), has_aux=True)(m, t) for p in presets}

    return {p: (loss, out, grads) for p, ((loss, out), grads) in nnx.jit(f)(model, toks).items()}


def assert_matches_reference(res, ref, presets, rtol=1e-5, atol=1e-6):
    """res {preset: (loss, ModelOutput, grads)} of a distributed model equals ref {preset: (loss,
    logits, [grad leaves])} of the single-device one: nothing dropped, loss / logits to rtol / atol,
    every gradient leaf non-zero and equal to rtol with atol scaled by the leaf's largest entry."""
    import jax
    import numpy as np

    for p in presets:
        loss, out, grads = res[p]
        r_loss, r_logits, r_grads = ref[p]
        assert int(out.dropped) == 0, p
        np.testing.assert_allclose(np.asarray(jax.device_get(loss)), r_loss, rtol=rtol)
        np.testing.assert_allclose(np.asarray(jax.device_get(out.logits)), r_logits, rtol=rtol, atol=atol)
        grads = [np.asarray(jax.device_get(g)) for g in jax.tree.leaves(grads)]
        assert len(grads) == len(r_grads), p
        for g, r in zip(grads, r_grads):
            scale = np.abs(r).max()
            assert scale > 0, p  # every parameter (experts, router, shared, attention, embed) gets a gradient
            np.testing.assert_allclose(g, r, rtol=rtol, atol=atol * max(scale, 1.0), err_msg=p)


def step_summary(model, global_tokens) -> dict:
    """Loss, dropped count and every gradient (as numpy, replicated to each process) of one step on
    `global_tokens` (each process feeds its own rows when several run)."""
    import jax
    import numpy as np

    from farskip_jax.parallel import shard_batch

    mesh = model_mesh(model)
    n = jax.process_count()
    rows = global_tokens.shape[0] // n
    local = global_tokens[jax.process_index() * rows:(jax.process_index() + 1) * rows]
    loss, out, grads = loss_and_grads(model, shard_batch(local, mesh))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    grads = jax.jit(lambda g: g, out_shardings=replicated)(jax.tree.leaves(grads))
    return {"loss": np.asarray(loss), "dropped": np.asarray(out.dropped),
            **{f"grad{i}": np.asarray(g) for i, g in enumerate(grads)}}


def model_mesh(model):
    from flax import nnx

    import jax

    leaf = jax.tree.leaves(nnx.state(model))[0]
    return leaf.sharding.mesh


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--local-devices", type=int, required=True)
    p.add_argument("--ep", type=int, default=4)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)

    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from farskip_jax.parallel.xla_flags import apply_xla_preset

    apply_xla_preset("cpu", host_devices=a.local_devices)
    from farskip_jax.parallel.distributed import maybe_initialize

    cfg = tiny_config(ep=a.ep, num_layers=1, num_processes=a.num_processes, process_id=a.process_id, port=a.port)
    assert maybe_initialize(cfg.mesh)
    import jax
    import numpy as np

    jax.config.update("jax_default_matmul_precision", "highest")
    from farskip_jax.parallel import create_model, make_mesh

    assert jax.process_count() == a.num_processes and len(jax.devices()) == a.num_processes * a.local_devices
    model = create_model(cfg, make_mesh(cfg.mesh), seed=0)
    res = step_summary(model, tokens())
    if a.process_id == 0:
        np.savez(a.out, process_count=jax.process_count(), **res)
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

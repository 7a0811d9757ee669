"""Helpers shared by the training and FCSD tests: a tiny batch, a student state with its fp32 teacher
copy, a teacher run folder written without training, a log stream that sends SIGTERM at a step, and
fault injection (a train step whose loss is NaN at chosen updates; tests/conftest.py `nan_at_steps`)."""

import os
import signal


def write_scaled_teacher(run_dir: str, overrides: list, scale: float) -> str:
    """A run folder (config.yaml + a step-0 checkpoint) holding the untrained MoE of configs/tiny.yaml
    with `overrides`, every parameter multiplied by `scale` (opinionated predictions, so that a
    conversion changes them): the loop tests need no trained teacher, and writing one costs no compile."""
    import jax
    from flax import nnx

    from farskip_jax.config import dump_config, load_config
    from farskip_jax.loading.load import build_model
    from farskip_jax.loading.checkpoint import Checkpointer
    from farskip_jax.loading.optimizer import make_optimizer
    from farskip_jax.loading.train_state import init_state

    cfg = load_config("configs/tiny.yaml", [*overrides, f"train.run_dir={run_dir}"])
    model = build_model(cfg, None, seed=0)
    nnx.update(model, jax.tree.map(lambda x: x * scale, nnx.state(model, nnx.Param)))
    tx, _ = make_optimizer(cfg.train)
    _, state = init_state(model, tx, cfg.train.seed)
    ck = Checkpointer(run_dir, keep=1, async_save=False)
    ck.save(0, state, {})
    ck.close()
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        f.write(dump_config(cfg))
    return run_dir


class SigtermAt:
    """A log stream that sends this process SIGTERM once the progress line of step `at` is printed."""

    def __init__(self, at):
        self.at, self.sent, self.text = at, False, []

    def write(self, s):
        self.text.append(s)
        if not self.sent and s.startswith(f"step {self.at:>6d}/"):
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)

    def flush(self):
        pass


def tiny_batch(seed=0):
    """A [2, 16] batch of ids < 64 with 4 padding positions at the end of row 1 (loss_mask 0)."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    tok = rng.integers(0, 64, size=(2, 17)).astype(np.int32)
    mask = np.ones((2, 16), np.float32)
    mask[1, 12:] = 0.0  # padding at the end of row 1
    seg = mask.astype(np.int32)
    pos = np.broadcast_to(np.arange(16, dtype=np.int32), (2, 16))
    return dict(tokens=jnp.asarray(tok[:, :-1]), targets=jnp.asarray(tok[:, 1:]), positions=jnp.asarray(pos),
                segment_ids=jnp.asarray(seg), loss_mask=jnp.asarray(mask))


def student_and_teacher(cfg):
    """(graphdef, student train state, fp32 teacher copy of the same weights, tx, schedule) of a fresh
    Transformer(cfg) (seed 0) and the optimizer of cfg.train."""
    import jax.numpy as jnp
    from flax import nnx

    from farskip_jax.eval.metrics import cast_state
    from farskip_jax.model.transformer import Transformer
    from farskip_jax.loading.optimizer import make_optimizer
    from farskip_jax.loading.train_state import init_state

    tx, schedule = make_optimizer(cfg.train)
    graphdef, state = init_state(Transformer(cfg, rngs=nnx.Rngs(0)), tx, 0)
    return graphdef, state, cast_state(state, jnp.float32), tx, schedule


def nan_at(step_fn, steps):
    """step_fn(state, batch, *frozen) with the batch's loss_mask NaN at the 1-based updates `steps`
    (the step counter of the state it is given, as logged): loss and gradient are not finite there,
    as in a run that overflows, whatever the task's loss. Traced, so it jits with the step."""
    import jax.numpy as jnp

    at = tuple(int(s) for s in steps)

    def poisoned(state, batch, *frozen):
        hit = jnp.any(state["step"] + 1 == jnp.asarray(at, jnp.int32))
        return step_fn(state, dict(batch, loss_mask=jnp.where(hit, jnp.nan, batch["loss_mask"])), *frozen)

    return poisoned

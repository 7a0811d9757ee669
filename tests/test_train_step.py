"""Train step: non-finite skip (+ counter, + clean stop), gradient accumulation vs an averaged-gradient
oracle, the aux-loss-free router-bias rule, the LR schedule, loss weighting."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from run_helpers import nan_at

from farskip_jax.config import Config, DataConfig, ModelConfig, MoEConfig, RuntimeConfig, TrainConfig, replace
from farskip_jax.model.transformer import Transformer
from farskip_jax.loading.optimizer import make_optimizer
from farskip_jax.losses.ce import token_ce
from farskip_jax.loading.train_state import init_state
from farskip_jax.train.step import make_loss_fn, make_train_step
from farskip_jax.train.trainer import train


def _cfg(**train_kw):
    t = dict(steps=20, batch_size=4, seq_len=16, warmup_steps=2, lr=1e-2)
    t.update(train_kw)
    return Config(model=ModelConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2,
                                    mlp_hidden=64, max_seq_len=16),
                  moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=32, selection_bias=True),
                  runtime=RuntimeConfig(bias_update_rate=0.01, gmm="einsum", z_loss_weight=1e-3),
                  train=TrainConfig(**t))


def _batch(seed=0, b=4, s=16):
    r = np.random.RandomState(seed)
    toks = r.randint(0, 64, (b, s + 1)).astype(np.int32)
    return {"tokens": jnp.asarray(toks[:, :-1]), "targets": jnp.asarray(toks[:, 1:]),
            "positions": jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)),
            "segment_ids": jnp.ones((b, s), jnp.int32), "loss_mask": jnp.ones((b, s), jnp.float32)}


def _setup(cfg):
    tx, sched = make_optimizer(cfg.train)
    g, st = init_state(Transformer(cfg, rngs=nnx.Rngs(0)), tx, 0)
    return g, st, tx, sched


def test_nonfinite_step_is_skipped_and_counted():
    cfg = _cfg()
    g, st, tx, sched = _setup(cfg)
    step = jax.jit(nan_at(make_train_step(g, cfg, tx, sched), (2,)))
    st1, m1 = step(st, _batch(0))
    st2, m2 = step(st1, _batch(1))
    assert bool(m1["finite"]) and not bool(m2["finite"])
    assert int(st2["nonfinite_total"]) == 1 and int(st2["nonfinite_streak"]) == 1 and int(st2["step"]) == 2
    for a, b in zip(jax.tree.leaves((st1["params"], st1["opt"], st1["bias"])),
                    jax.tree.leaves((st2["params"], st2["opt"], st2["bias"]))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # nothing moved
    st3, m3 = step(st2, _batch(2))
    assert bool(m3["finite"]) and int(st3["nonfinite_streak"]) == 0 and int(st3["nonfinite_total"]) == 1
    assert not np.array_equal(np.asarray(jax.tree.leaves(st3["params"])[0]), np.asarray(jax.tree.leaves(st2["params"])[0]))


def test_grad_accumulation_equals_mean_of_microbatch_gradients():
    cfg = _cfg(grad_accum=2)
    g, st, tx, sched = _setup(cfg)
    batch = _batch(3)
    new, m = jax.jit(make_train_step(g, cfg, tx, sched))(st, batch)
    loss_fn = make_loss_fn(g, cfg)
    halves = [jax.tree.map(lambda x: x[i * 2:(i + 1) * 2], batch) for i in range(2)]
    grad = jax.jit(jax.grad(lambda p, h: loss_fn(p, st["bias"], st["rest"], h)[0]))
    grads = [grad(st["params"], h) for h in halves]
    mean = jax.tree.map(lambda a, b: (a + b) / 2, *grads)
    upd, _ = tx.update(mean, st["opt"], st["params"])
    want = optax.apply_updates(st["params"], upd)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(new["params"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(m["grad_norm"]), float(optax.global_norm(mean)), rtol=1e-5)


def test_router_bias_rule_and_loss_weights():
    cfg = _cfg()
    g, st, tx, sched = _setup(cfg)
    batch = _batch(4)
    new, m = jax.jit(make_train_step(g, cfg, tx, sched))(st, batch)
    model = nnx.merge(g, st["params"], st["bias"], st["rest"])
    out = nnx.jit(lambda m, b: m(b["tokens"], b["positions"], b["segment_ids"]))(model, batch)
    new_model = nnx.merge(g, new["params"], new["bias"], new["rest"])
    for j, (blk, nblk) in enumerate(zip(model.layers, new_model.layers)):
        load = np.asarray(out.load[j])
        want = np.asarray(blk.moe.router.bias[...]) + 0.01 * np.sign(load.mean() - load)
        np.testing.assert_allclose(np.asarray(nblk.moe.router.bias[...]), want, rtol=1e-6, atol=1e-7)
    logp = jax.nn.log_softmax(out.logits)
    ce = -np.mean(np.take_along_axis(np.asarray(logp), np.asarray(batch["targets"])[..., None], -1))
    np.testing.assert_allclose(float(m["ce"]), ce, rtol=1e-5)
    np.testing.assert_allclose(float(m["loss"]), ce + 0.01 * float(out.aux_loss) + 1e-3 * float(out.z_loss), rtol=1e-5)
    assert 0 < float(m["load_entropy"]) <= 1 and float(m["load_min"]) <= 1 <= float(m["load_max"])


def test_schedule_warmup_cosine():
    _, sched = make_optimizer(TrainConfig(steps=100, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1))
    assert float(sched(0)) == 0.0
    np.testing.assert_allclose(float(sched(10)), 1e-3, rtol=1e-6)
    np.testing.assert_allclose(float(sched(100)), 1e-4, rtol=1e-5)
    assert float(sched(50)) < float(sched(20))


def test_consecutive_nonfinite_stops_cleanly_with_last_good_checkpoint(tmp_path, nan_at_steps):
    from farskip_jax.loading.checkpoint import Checkpointer
    from farskip_jax.train.logger import read_metrics

    nan_at_steps(3, 6, 7, 8)
    cfg = replace(_cfg(batch_size=8, max_nonfinite=3, checkpoint_every=2, log_every=5,
                       eval_every=0, tensorboard=False, run_dir=str(tmp_path / "run")),
                  data=DataConfig(tokenizer="byte", max_docs=50))
    cfg = replace(cfg, **{"model.vocab_size": 259})
    res = train(cfg)
    assert res.status == "diverged" and res.step == 8 and res.nonfinite_total == 4
    recs = read_metrics(res.run_dir)
    assert [r["finite"] for r in recs] == [True, True, False, True, True, False, False, False]
    assert Checkpointer(res.run_dir).latest_step() == 4  # steps 6/8 were mid-streak: not saved


def test_token_ce_custom_vjp_matches_log_softmax_autodiff():
    """token_ce's hand-written VJP (softmax - onehot) equals autodiff of the textbook log-softmax form,
    masked tokens included, and passes a numerical gradient check."""
    from jax.test_util import check_grads

    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((3, 5, 11)).astype(np.float32) * 3)
    targets = jnp.asarray(rng.integers(0, 11, (3, 5)))
    mask = jnp.asarray((rng.random((3, 5)) > 0.3).astype(np.float32))

    def textbook(lg):
        logp = jax.nn.log_softmax(lg, -1)
        return -jnp.sum(jnp.take_along_axis(logp, targets[..., None], -1)[..., 0] * mask) / jnp.sum(mask)

    (val, grad), (ref_val, ref_grad) = (jax.value_and_grad(f)(logits) for f in
                                        (lambda lg: token_ce(lg, targets, mask)[0], textbook))
    assert abs(float(val - ref_val)) < 1e-6 * abs(float(ref_val))
    assert float(jnp.max(jnp.abs(grad - ref_grad)) / jnp.max(jnp.abs(ref_grad))) < 1e-5
    assert float(jnp.max(jnp.abs(grad[mask == 0]))) == 0.0
    check_grads(lambda lg: token_ce(lg, targets, mask)[0], (logits,), order=1, modes=["rev"])

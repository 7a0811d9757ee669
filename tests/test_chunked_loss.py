"""losses/chunked.py against the full-logit losses (losses/ce.token_ce, losses/divergence.token_divergence):
values and gradients w.r.t. the final stream and the unembedding equal in fp32 (1e-6 relative), for
untied and tied unembeddings, chunks that do and do not divide the sequence, and padding masks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from farskip_jax.losses.divergence import masked_mean, token_divergence
from farskip_jax.losses.chunked import chunked_ce, chunked_fcsd
from farskip_jax.losses.chunked import from_chunks, to_chunks
from farskip_jax.model.layers import matmul_2d
from farskip_jax.losses.ce import token_ce

B, S, D, V = 2, 37, 16, 50


def rel(a, b):
    """||a - b|| / ||b|| (2-norm over all elements)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def data(tied: bool, seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 6)
    final = jax.random.normal(k[0], (B, S, D))
    w = jax.random.normal(k[1], (V, D) if tied else (D, V)) * 0.5
    t_final = jax.random.normal(k[2], (B, S, D))
    t_w = jax.random.normal(k[3], (V, D) if tied else (D, V)) * 0.5
    targets = jax.random.randint(k[4], (B, S), 0, V)
    mask = (jax.random.uniform(k[5], (B, S)) > 0.25).astype(jnp.float32)
    return final, w, t_final, t_w, targets, mask


def logits(x, w, tied):
    return matmul_2d(x, w, transpose_w=tied).astype(jnp.float32)


def test_chunks_round_trip():
    x = jnp.arange(2 * 7 * 3).reshape(2, 7, 3)
    c = to_chunks(x, 3)
    assert c.shape == (3, 2, 3, 3) and int(c[2, :, 1:].sum()) == 0  # padded positions are zeros
    np.testing.assert_array_equal(from_chunks(c, 7), x)


@pytest.mark.parametrize("tied,chunk", [(False, 8), (True, 37), (False, 64), (True, 1)])
def test_chunked_ce_equals_full_logits(tied, chunk):
    final, w, _, _, targets, mask = data(tied)

    def full(final, w):
        ce, n = token_ce(logits(final, w, tied), targets, mask)
        return 3.0 * ce + 0.1 * jnp.sum(final ** 2), (ce, n)  # an outer scale and another use of final

    def chunk_loss(final, w):
        ce, n = chunked_ce(final, (w, tied), targets, mask, chunk=chunk)
        return 3.0 * ce + 0.1 * jnp.sum(final ** 2), (ce, n)

    (l0, (ce0, n0)), g0 = jax.jit(jax.value_and_grad(full, argnums=(0, 1), has_aux=True))(final, w)
    (l1, (ce1, n1)), g1 = jax.jit(jax.value_and_grad(chunk_loss, argnums=(0, 1), has_aux=True))(final, w)
    assert float(n1) == float(n0) == float(mask.sum())
    assert rel(ce1, ce0) < 1e-6 and rel(l1, l0) < 1e-6
    assert rel(g1[0], g0[0]) < 1e-6 and rel(g1[1], g0[1]) < 1e-6
    # without differentiation: the loss only, same value
    ce2, _ = jax.jit(lambda f, w: chunked_ce(f, (w, tied), targets, mask, chunk=chunk))(final, w)
    assert rel(ce2, ce0) < 1e-6


def test_chunked_ce_empty_mask_and_bad_chunk():
    final, w, _, _, targets, mask = data(False)
    zero = jnp.zeros_like(mask)
    ce, n = chunked_ce(final, (w, False), targets, zero, chunk=8)
    assert float(ce) == 0.0 and float(n) == 0.0
    g = jax.grad(lambda f: chunked_ce(f, (w, False), targets, zero, chunk=8)[0])(final)
    assert float(jnp.max(jnp.abs(g))) == 0.0
    with pytest.raises(ValueError, match="chunk"):
        chunked_ce(final, (w, False), targets, mask, chunk=0)


@pytest.mark.parametrize("kind,temperature,top_k,tied,chunk", [
    ("forward", 1.0, 0, False, 8), ("reverse", 2.0, 0, True, 16), ("both", 0.7, 0, False, 64),
    ("forward", 2.0, 5, True, 8), ("both", 1.0, 7, False, 16)])
def test_chunked_fcsd_equals_full_logits(kind, temperature, top_k, tied, chunk):
    final, w, t_final, t_w, targets, mask = data(tied, seed=1)

    def full(final, w, t_final, t_w):
        t_logits = jax.lax.stop_gradient(logits(t_final, t_w, tied))
        s_logits = logits(final, w, tied)
        kl = masked_mean(token_divergence(t_logits, s_logits, kind=kind, temperature=temperature, top_k=top_k), mask)
        ce, _ = token_ce(s_logits, targets, mask)
        return 0.7 * kl + 0.3 * ce, (kl, ce)

    def chunk_loss(final, w, t_final, t_w):
        kl, ce, _ = chunked_fcsd(final, (w, tied), t_final, (t_w, tied), targets, mask, chunk=chunk, kind=kind,
                                 temperature=temperature, top_k=top_k)
        return 0.7 * kl + 0.3 * ce, (kl, ce)

    args = (final, w, t_final, t_w)
    (l0, (kl0, ce0)), g0 = jax.jit(jax.value_and_grad(full, argnums=(0, 1, 2, 3), has_aux=True))(*args)
    (l1, (kl1, ce1)), g1 = jax.jit(jax.value_and_grad(chunk_loss, argnums=(0, 1, 2, 3), has_aux=True))(*args)
    assert rel(kl1, kl0) < 1e-6 and rel(ce1, ce0) < 1e-6 and rel(l1, l0) < 1e-6
    assert rel(g1[0], g0[0]) < 1e-6 and rel(g1[1], g0[1]) < 1e-6
    assert float(jnp.max(jnp.abs(g1[2]))) == 0.0 and float(jnp.max(jnp.abs(g1[3]))) == 0.0  # frozen teacher


def _step_cfg(tied: bool, **train_kw):
    from farskip_jax.config import Config, ModelConfig, MoEConfig, RuntimeConfig, TrainConfig

    t = dict(steps=2, batch_size=4, seq_len=16, warmup_steps=1, lr=1e-2)
    t.update(train_kw)
    return Config(model=ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                    mlp_hidden=64, max_seq_len=16, tie_embeddings=tied),
                  moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=32),
                  runtime=RuntimeConfig(gmm="einsum", z_loss_weight=1e-3),
                  train=TrainConfig(**t))


# the tied head in the chunked loss is checked by test_chunked_ce_equals_full_logits; its steps with -m extended
@pytest.mark.parametrize("tied,chunk", [(False, 5), pytest.param(True, 16, marks=pytest.mark.extended)])
def test_train_and_eval_steps_with_loss_chunk_equal_full_logits(tied, chunk):
    from flax import nnx

    from farskip_jax.model.transformer import Transformer
    from farskip_jax.loading.optimizer import make_optimizer
    from farskip_jax.loading.train_state import init_state
    from farskip_jax.train.step import make_eval_step, make_loss_fn, make_train_step

    base = _step_cfg(tied)
    chunked = _step_cfg(tied, loss_chunk=chunk)
    tx, sched = make_optimizer(base.train)
    g, st = init_state(Transformer(base, rngs=nnx.Rngs(0)), tx, 0)
    r = np.random.RandomState(0)
    toks = r.randint(0, 64, (4, 17)).astype(np.int32)
    mask = np.ones((4, 16), np.float32)
    mask[1, 10:] = 0  # padding
    batch = {"tokens": jnp.asarray(toks[:, :-1]), "targets": jnp.asarray(toks[:, 1:]),
             "positions": jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (4, 16)),
             "segment_ids": jnp.ones((4, 16), jnp.int32), "loss_mask": jnp.asarray(mask)}
    outs = []
    for cfg in (base, chunked):
        loss_fn = make_loss_fn(g, cfg)
        (loss, aux), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(st["params"], st["bias"], st["rest"], batch)
        ev = jax.jit(make_eval_step(g, cfg))(st, batch)
        new, m = jax.jit(make_train_step(g, cfg, tx, sched))(st, batch)
        outs.append((loss, aux["ce"], grads, ev, new["params"], m["loss"]))
    (l0, ce0, g0, ev0, p0, ml0), (l1, ce1, g1, ev1, p1, ml1) = outs
    assert rel(l1, l0) < 1e-6 and rel(ce1, ce0) < 1e-6 and rel(ml1, ml0) < 1e-6
    assert rel(ev1["ce_sum"], ev0["ce_sum"]) < 1e-6 and float(ev1["tokens"]) == float(ev0["tokens"]) == mask.sum()
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        assert rel(a, b) < 1e-6
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p0)):  # one AdamW step from equal gradients
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_loss_chunk_config_validation():
    from farskip_jax.config import load_config
    from farskip_jax.errors import ConfigError

    assert load_config("configs/tiny.yaml", ["train.loss_chunk=64"]).train.loss_chunk == 64
    assert load_config("configs/tiny.yaml", ["train.loss_chunk=0"]).train.loss_chunk == 0
    assert load_config("configs/tiny.yaml", ["train.loss_chunk=null"]).train.loss_chunk is None
    for bad in ("-1", "1.5", "abc"):
        with pytest.raises(ConfigError, match="train.loss_chunk"):
            load_config("configs/tiny.yaml", [f"train.loss_chunk={bad}"])

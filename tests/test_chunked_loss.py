"""losses/chunked.py against the full-logit losses (train/step.token_ce, eval/divergence.token_divergence):
values and gradients w.r.t. the final stream and the unembedding equal in fp32 (1e-6 relative), for
untied and tied unembeddings, chunks that do and do not divide the sequence, and padding masks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from farskip_jax.eval.divergence import masked_mean, token_divergence
from farskip_jax.losses import chunked_ce, chunked_fcsd
from farskip_jax.losses.chunked import from_chunks, to_chunks
from farskip_jax.model.layers import matmul_2d
from farskip_jax.train.step import token_ce

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

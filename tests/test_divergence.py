"""topk_forward_kl: forward KL over the teacher's top-k tokens plus one tail bucket (losses/divergence.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from farskip_jax.losses.divergence import forward_kl, token_divergence, topk_forward_kl


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _softmax(x):
    return np.exp(_log_softmax(x))


def bucket_kl_oracle(t, s, k, temperature=1.0, idx=None):
    """Independent float64 reference: KL over the k + 1 categories {teacher's top-k tokens, the rest}."""
    t, s = np.asarray(t, np.float64) / temperature, np.asarray(s, np.float64) / temperature
    lp, lq = _log_softmax(t), _log_softmax(s)
    p, q = np.exp(lp), np.exp(lq)
    if idx is None:
        idx = np.argsort(-t, axis=-1, kind="stable")[..., :k]
    top = np.zeros(t.shape, bool)
    np.put_along_axis(top, np.asarray(idx), True, -1)
    head = np.where(top, p * (lp - lq), 0.0).sum(-1)
    tail_t, tail_s = np.where(top, 0.0, p).sum(-1), np.where(top, 0.0, q).sum(-1)  # sums, not 1 - sum
    has = tail_t > 0  # an empty (or underflowed) teacher tail adds 0
    tail = np.where(has, tail_t * (np.log(np.where(has, tail_t, 1.0)) - np.log(np.where(has, tail_s, 1.0))), 0.0)
    return head + tail


def _logits(seed, shape=(2, 3, 37), scale=2.5):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32) * scale


@pytest.mark.parametrize("k", [1, 2, 5, 20, 36])
def test_bucket_kl_matches_numpy_oracle(k):
    t, s = _logits(0), _logits(1)
    np.testing.assert_allclose(topk_forward_kl(t, s, k), bucket_kl_oracle(t, s, k), rtol=1e-5, atol=1e-7)


def test_bucket_kl_at_full_vocab_is_forward_kl():
    t, s = _logits(2), _logits(3)
    v = t.shape[-1]
    np.testing.assert_allclose(topk_forward_kl(t, s, v), forward_kl(t, s), rtol=1e-5)
    np.testing.assert_allclose(topk_forward_kl(t, s, v + 10), forward_kl(t, s), rtol=1e-5)  # k > vocab: clamped
    # and the gradient of the student is the full KL's
    g_top = jax.grad(lambda x: jnp.sum(topk_forward_kl(t, x, v)))(jnp.asarray(s))
    g_full = jax.grad(lambda x: jnp.sum(forward_kl(t, x)))(jnp.asarray(s))
    np.testing.assert_allclose(g_top, g_full, rtol=1e-5, atol=1e-7)


def test_bucket_kl_between_zero_and_full_kl():
    t, s = _logits(4, scale=3.0), _logits(5, scale=3.0)
    full = np.asarray(forward_kl(t, s))
    prev = np.zeros_like(full)
    for k in (1, 2, 3, 8, 16, 30, 36, 37):
        b = np.asarray(topk_forward_kl(t, s, k))
        assert np.all(b >= -1e-7), k
        assert np.all(b <= full * (1 + 1e-5) + 1e-7), k
        assert np.all(b >= prev - 1e-5 * full - 1e-7), k  # refining the partition never lowers the KL
        prev = b


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_bucket_kl_temperature_like_forward_kl(temperature):
    t, s, k = _logits(6), _logits(7), 4
    ref = bucket_kl_oracle(t, s, k, temperature)
    np.testing.assert_allclose(topk_forward_kl(t, s, k, temperature), ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(topk_forward_kl(t, s, k, temperature),
                               bucket_kl_oracle(t / temperature, s / temperature, k), rtol=1e-5, atol=1e-7)
    # token_divergence scales by T^2, as for the full KL
    np.testing.assert_allclose(token_divergence(t, s, temperature=temperature, top_k=k), temperature ** 2 * ref,
                               rtol=1e-5, atol=1e-7)
    v = t.shape[-1]
    np.testing.assert_allclose(topk_forward_kl(t, s, v, temperature), forward_kl(t, s, temperature), rtol=1e-5)


def test_student_equal_to_teacher_gives_zero_unlike_the_renormalised_form():
    x = _logits(8, shape=(2, 3, 50))
    for k in (1, 5, 49):
        np.testing.assert_allclose(topk_forward_kl(x, x, k), 0.0, atol=1e-6)
    # the old loss (teacher's top-k renormalised, student's full log-probs) is -log sum_{topk} p > 0 here
    p = _softmax(x.astype(np.float64))
    idx = np.argsort(-x, -1)[..., :5]
    pk = np.take_along_axis(p, idx, -1)
    old = ((pk / pk.sum(-1, keepdims=True)) * (np.log(pk / pk.sum(-1, keepdims=True)) - np.log(pk))).sum(-1)
    assert np.all(old > 1e-3)


def test_tied_teacher_logits_use_the_selected_tokens():
    # all-equal (bf16) teacher: the tail bucket must hold exactly the tokens that top_k did not pick
    t = jnp.zeros((2, 3, 16), jnp.bfloat16)
    s = _logits(9, shape=(2, 3, 16))
    k = 5
    idx = jax.lax.top_k(t.astype(jnp.float32), k)[1]
    np.testing.assert_allclose(topk_forward_kl(t, s, k), bucket_kl_oracle(np.asarray(t, np.float32), s, k, idx=idx),
                               rtol=1e-5, atol=1e-7)


def _grads(t, s, k, temperature=1.0):
    f = lambda a, b: jnp.sum(topk_forward_kl(a, b, k, temperature))  # noqa: E731
    val = f(t, s)
    gt, gs = jax.grad(f, argnums=(0, 1))(jnp.asarray(t), jnp.asarray(s))
    return np.asarray(val), np.asarray(gt), np.asarray(gs)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_gradients_finite_at_edge_cases(temperature):
    t, s = _logits(10), _logits(11)
    v = t.shape[-1]
    for args in [(t, s, v), (t, s, v + 3), (t, t, v), (t, t, 3)]:  # empty tail; student = teacher
        val, gt, gs = _grads(*args, temperature)
        assert np.isfinite(val) and np.all(np.isfinite(gt)) and np.all(np.isfinite(gs)), args[2]
    # a teacher with ~all its mass on one token: its tail underflows (exp(-400) = 0 in float32)
    peaked = np.zeros_like(t)
    peaked[..., 7] = 400.0
    for k in (1, 2, v - 1, v):
        for student in (s, peaked, -peaked):
            val, gt, gs = _grads(peaked, student, k, temperature)
            assert np.isfinite(val) and np.all(np.isfinite(gt)) and np.all(np.isfinite(gs)), k
    np.testing.assert_allclose(topk_forward_kl(peaked, s, 1, temperature),
                               bucket_kl_oracle(peaked, s, 1, temperature), rtol=1e-5, atol=1e-6)
    # bf16 inputs (the teacher copy's dtype)
    val, gt, gs = _grads(jnp.asarray(t, jnp.bfloat16), jnp.asarray(s, jnp.bfloat16), 4, temperature)
    assert np.isfinite(val) and np.all(np.isfinite(np.asarray(gs, np.float32)))


def test_gradient_matches_the_naive_formula():
    # away from the edge cases, the guarded tail has the gradient of the plain 1 - sum formula
    t, s, k = _logits(12, scale=1.0), _logits(13, scale=1.0), 6

    def naive(b):
        lt, ls = jax.nn.log_softmax(jnp.asarray(t), -1), jax.nn.log_softmax(b, -1)
        top_lt, idx = jax.lax.top_k(lt, k)
        top_ls = jnp.take_along_axis(ls, idx, -1)
        tt, ts = 1 - jnp.exp(top_lt).sum(-1), 1 - jnp.exp(top_ls).sum(-1)
        return jnp.sum(jnp.sum(jnp.exp(top_lt) * (top_lt - top_ls), -1) + tt * (jnp.log(tt) - jnp.log(ts)))

    g = jax.grad(lambda b: jnp.sum(topk_forward_kl(t, b, k)))(jnp.asarray(s))
    np.testing.assert_allclose(g, jax.grad(naive)(jnp.asarray(s)), rtol=1e-4, atol=1e-6)

"""MoE block against a per-expert Python-loop oracle (fp32, 1e-5), routing variants and gradients."""

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads

from farskip_jax.config import ModelConfig, MoEConfig, RuntimeConfig
from farskip_jax.model.moe import MoEBlock

D, E = 16, 8


def _np(x):
    return np.asarray(x, np.float64)


def _silu(x):
    return x / (1 + np.exp(-x))


def oracle(block: MoEBlock, x, cfg: MoEConfig):
    """Token by token, expert by expert, in float64 numpy. Returns (routed, shared, kept mask)."""
    xs = _np(x).reshape(-1, x.shape[-1])
    wr = _np(block.router.w[...])
    bias = _np(block.router.bias[...]) if block.router.bias is not None else np.zeros(E)
    wg, wu, wd = (_np(getattr(block.experts, n)[...]) for n in ("w_gate", "w_up", "w_down"))
    n_assign = xs.shape[0] * cfg.top_k
    cf = block.runtime.capacity_factor
    cap = n_assign if cf is None else max(1, int(np.ceil(cf * n_assign / E)))
    used = np.zeros(E, int)
    routed = np.zeros_like(xs)
    for t, xt in enumerate(xs):
        logits = xt @ wr
        if cfg.scoring == "softmax":
            scores = np.exp(logits - logits.max())
            scores /= scores.sum()
        else:
            scores = 1 / (1 + np.exp(-logits))
        sel = scores + bias
        allowed = np.ones(E, bool)
        if cfg.n_group > 1:
            per = E // cfg.n_group
            gsc = []
            for g in range(cfg.n_group):
                grp = np.sort(sel[g * per:(g + 1) * per])[::-1]
                gsc.append(grp[:2].sum() if cfg.group_score == "top2_sum" else grp[0])
            best = np.argsort(gsc)[::-1][:cfg.topk_group]
            allowed = np.zeros(E, bool)
            for g in best:
                allowed[g * per:(g + 1) * per] = True
        chosen = [e for e in np.argsort(np.where(allowed, sel, -np.inf))[::-1][:cfg.top_k]]
        w = np.array([scores[e] for e in chosen])
        if cfg.norm_topk_prob:
            w = w / w.sum()
        w = w * cfg.routed_scaling_factor
        for e, we in zip(chosen, w):
            if used[e] >= cap:  # capacity exhausted: the assignment is dropped (contributes 0)
                continue
            used[e] += 1
            h = _silu(xt @ wg[e]) * (xt @ wu[e])
            routed[t] += we * (h @ wd[e])
    shared = None
    if block.shared is not None:
        s = block.shared
        shared = (_silu(xs @ _np(s.gate.w[...])) * (xs @ _np(s.up.w[...]))) @ _np(s.down.w[...])
        shared = shared.reshape(x.shape)
    return routed.reshape(x.shape), shared


VARIANTS = {
    "softmax_norm": dict(),
    "softmax_nonorm_scaled": dict(norm_topk_prob=False, routed_scaling_factor=2.5),
    "sigmoid_bias": dict(scoring="sigmoid", selection_bias=True),
    "group_limited_max": dict(n_group=4, topk_group=2, top_k=3),
    "group_limited_top2sum_sigmoid": dict(scoring="sigmoid", selection_bias=True, n_group=4, topk_group=2,
                                          group_score="top2_sum", routed_scaling_factor=1.5),
    "top1_no_shared": dict(top_k=1, num_shared_experts=0),
    "capacity_drops": dict(capacity_factor=0.5),
    "gmm_einsum": dict(gmm="einsum"),
    "gmm_ragged_dot": dict(gmm="ragged_dot"),
    "gmm_tile_3": dict(gmm="tiled", gmm_tile=3),
}


def _block(**kw):
    rt = {k: kw.pop(k) for k in list(kw) if k in {f.name for f in dataclasses.fields(RuntimeConfig)}}
    cfg = MoEConfig(**{**dict(num_experts=E, top_k=2, expert_hidden=24, num_shared_experts=1), **kw})
    mcfg = ModelConfig(d_model=D, init_std=0.3)
    block = MoEBlock(mcfg, cfg, RuntimeConfig(**rt), rngs=nnx.Rngs(0))
    if cfg.selection_bias:  # a non-zero selection bias so biased selection is really exercised
        block.router.bias[...] = jax.random.normal(jax.random.key(9), (E,)) * 0.2
    return block, cfg


@pytest.mark.parametrize("name", list(VARIANTS))
def test_moe_matches_per_expert_loop(name):
    block, cfg = _block(**VARIANTS[name])
    x = jax.random.normal(jax.random.key(1), (3, 7, D))
    out = block(x)
    routed, shared = oracle(block, x, cfg)
    np.testing.assert_allclose(out.routed, routed, rtol=1e-5, atol=1e-5)
    if shared is None:
        assert out.shared is None
    else:
        np.testing.assert_allclose(out.shared, shared, rtol=1e-5, atol=1e-5)
    assert np.abs(routed).mean() > 1e-2
    if name == "capacity_drops":
        assert int(out.dropped) > 0
    else:
        assert int(out.dropped) == 0


def test_weights_are_unbiased_and_load_sums_to_one():
    block, cfg = _block(scoring="sigmoid", selection_bias=True, norm_topk_prob=False)
    x = jax.random.normal(jax.random.key(2), (2, 5, D))
    route = block.router(x)
    logits = jnp.einsum("bsd,de->bse", x, block.router.w[...])
    scores = jax.nn.sigmoid(logits)
    np.testing.assert_allclose(route.weights, jnp.take_along_axis(scores, route.indices, -1), rtol=1e-6)
    np.testing.assert_allclose(float(route.load.sum()), 1.0, rtol=1e-6)
    # a huge bias on one expert forces its selection without changing weights' definition
    block.router.bias[...] = jnp.zeros(E).at[5].set(100.0)
    route = block.router(x)
    assert bool(jnp.all(jnp.any(route.indices == 5, axis=-1)))


def _dense_oracle_jnp(params, x, cfg):
    """Differentiable oracle: every expert on every token, masked by the routing (independent code path)."""
    wr, wg, wu, wd = params
    logits = x @ wr
    scores = jax.nn.softmax(logits, -1)
    _, idx = jax.lax.top_k(jax.lax.stop_gradient(scores), cfg.top_k)
    mask = jax.nn.one_hot(idx, E).sum(-2)
    w = scores * mask
    w = w / w.sum(-1, keepdims=True)
    h = jax.nn.silu(jnp.einsum("bsd,edh->bseh", x, wg)) * jnp.einsum("bsd,edh->bseh", x, wu)
    y = jnp.einsum("bseh,ehd->bsed", h, wd)
    return jnp.einsum("bse,bsed->bsd", w, y)


@pytest.mark.parametrize("gmm", ["tiled", "einsum", "ragged_dot"])
def test_gradients_match_dense_oracle(gmm):
    block, cfg = _block(num_shared_experts=0, gmm=gmm, gmm_tile=4)
    x = jax.random.normal(jax.random.key(3), (2, 6, D))
    params = (block.router.w[...], block.experts.w_gate[...], block.experts.w_up[...], block.experts.w_down[...])
    graphdef, state = nnx.split(block)

    def ours(params, x):
        st = jax.tree.map(lambda v: v, state)
        m = nnx.merge(graphdef, st)
        m.router.w[...], m.experts.w_gate[...], m.experts.w_up[...], m.experts.w_down[...] = params
        return jnp.sum(jnp.sin(m(x).routed))

    def ref(params, x):
        return jnp.sum(jnp.sin(_dense_oracle_jnp(params, x, cfg)))

    g_ours = jax.grad(ours, argnums=(0, 1))(params, x)
    g_ref = jax.grad(ref, argnums=(0, 1))(params, x)
    for a, b in zip(jax.tree.leaves(g_ours), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        assert float(jnp.abs(b).max()) > 1e-4


def test_check_grads_numerically():
    block, cfg = _block(num_shared_experts=1, gmm="tiled", gmm_tile=4)
    x = jax.random.normal(jax.random.key(4), (1, 4, D))

    def f(x):
        out = block(x)
        return out.routed + out.shared

    check_grads(f, (x,), order=1, modes=("rev",), atol=2e-2, rtol=2e-2, eps=1e-3)

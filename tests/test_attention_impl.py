"""runtime.attention_impl=blockwise (flash-style core, causal blocks skipped, recomputing VJP),
causal_blocks (query blocks against their key prefix) and fused_cpu (the C++ CPU kernel) against the naive core: values and gradients in fp32 at 1e-5, document masks, GQA and MLA head dims, ragged
last block; the whole model with either core; config validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from farskip_jax.config import load_config
from farskip_jax.errors import ConfigError
from farskip_jax.kernels.attention import (attention_core, blockwise_attention_core, causal_blocks_attention_core,
                                          resolve_attention_impl)
from farskip_jax.model.attention import attention_mask
from farskip_jax.kernels.cpu.attention import fused_attention_core


def _inputs(b=2, t=40, h=4, kv=2, d=12, dv=8, seed=0, docs=True):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, t, h, d), jnp.float32)
    k = jax.random.normal(ks[1], (b, t, kv, d), jnp.float32)
    v = jax.random.normal(ks[2], (b, t, kv, dv), jnp.float32)
    if docs:  # packed documents: positions restart at every document boundary
        bounds = [[0, 7, 23, t], [0, 31, t]]
        seg = np.zeros((b, t), np.int32)
        pos = np.zeros((b, t), np.int32)
        for i, bd in enumerate(bounds[:b]):
            for j, (a, e) in enumerate(zip(bd[:-1], bd[1:])):
                seg[i, a:e], pos[i, a:e] = j, np.arange(e - a)
        seg, pos = jnp.asarray(seg), jnp.asarray(pos)
    else:
        pos = jnp.broadcast_to(jnp.arange(t), (b, t))
        seg = None
    return q, k, v, attention_mask(pos, pos, seg, seg)


@pytest.mark.parametrize("block,docs", [(13, True), (16, False)])
def test_blockwise_matches_naive_values_and_grads(block, docs):
    q, k, v, mask = _inputs(docs=docs)
    scale = 12 ** -0.5
    ct = jax.random.normal(jax.random.key(9), (2, 40, 4, 8), jnp.float32)
    f_naive = lambda q, k, v: jnp.sum(attention_core(q, k, v, mask, scale) * ct)
    f_block = lambda q, k, v: jnp.sum(blockwise_attention_core(q, k, v, mask, scale, block) * ct)
    np.testing.assert_allclose(jax.jit(lambda q, k, v: blockwise_attention_core(q, k, v, mask, scale, block))(q, k, v),
                               attention_core(q, k, v, mask, scale), atol=1e-5, rtol=1e-5)
    g_naive = jax.jit(jax.grad(f_naive, argnums=(0, 1, 2)))(q, k, v)
    g_block = jax.jit(jax.grad(f_block, argnums=(0, 1, 2)))(q, k, v)
    for a, b_ in zip(g_block, g_naive):
        np.testing.assert_allclose(a, b_, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block", [13])
def test_causal_blocks_matches_naive_values_and_grads(block):
    q, k, v, mask = _inputs()
    ct = jax.random.normal(jax.random.key(9), (2, 40, 4, 8), jnp.float32)
    f_naive = lambda q, k, v: jnp.sum(attention_core(q, k, v, mask, 0.3) * ct)
    f_cb = lambda q, k, v: jnp.sum(causal_blocks_attention_core(q, k, v, mask, 0.3, block) * ct)
    np.testing.assert_allclose(causal_blocks_attention_core(q, k, v, mask, 0.3, block),
                               attention_core(q, k, v, mask, 0.3), atol=1e-5, rtol=1e-5)
    for a, b_ in zip(jax.jit(jax.grad(f_cb, argnums=(0, 1, 2)))(q, k, v),
                     jax.jit(jax.grad(f_naive, argnums=(0, 1, 2)))(q, k, v)):
        np.testing.assert_allclose(a, b_, atol=1e-5, rtol=1e-5)
    jaxpr = str(jax.make_jaxpr(lambda q, k, v: causal_blocks_attention_core(q, k, v, mask, 0.3, 16))(q, k, v))
    assert jaxpr.count("dot_general") == 2 * 3  # 3 query blocks (16, 16, 8): QK^T and PV each
    assert "f32[2,2,2,16,32]" in jaxpr  # the second query block sees its 32-key prefix, not all 40


def _masks(kind: str, b: int, t: int, s: int, rng):
    pos, kpos = jnp.broadcast_to(jnp.arange(t), (b, t)), jnp.broadcast_to(jnp.arange(s), (b, s))
    if kind == "chunked":
        return attention_mask(pos, kpos, None, None, chunk_size=7)
    # arbitrary pattern, cross-attention shape, one query row that sees no key (uniform in the naive core)
    return jnp.asarray(rng.random((b, 1, t, s)) < 0.3).at[:, :, 3].set(False)


@pytest.mark.parametrize("case", ["docs_gqa", "causal_mla_dims", "chunked", "arbitrary_rect_empty_row"])
def test_fused_cpu_matches_naive_values_and_grads(case):
    """The C++ core (per kv-head tasks, 64-row query blocks, key range cut to the allowed keys,
    max/sum saved for the backward) against the naive core: fp32 values and q/k/v gradients at 1e-5,
    with document masks and GQA, a ragged last query block and q/k vs v head dims (MLA), a chunked
    mask, and an arbitrary rectangular mask with a query row that sees no key."""
    rng = np.random.default_rng(4)
    if case == "docs_gqa":
        q, k, v, mask = _inputs(b=2, t=70, h=6, kv=3)
    elif case == "causal_mla_dims":
        q, k, v, mask = _inputs(b=1, t=130, h=4, kv=4, d=12, dv=8, docs=False)
    else:
        s = 40 if case == "chunked" else 52
        q, _, _, _ = _inputs(b=2, t=40, h=4, kv=2)
        k = jnp.asarray(rng.standard_normal((2, s, 2, 12)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((2, s, 2, 8)), jnp.float32)
        mask = _masks(case, 2, 40, s, rng)
    ct = jnp.asarray(rng.standard_normal(q.shape[:3] + (v.shape[-1],)), jnp.float32)
    y = jax.jit(lambda q, k, v: fused_attention_core(q, k, v, mask, 0.3))(q, k, v)
    np.testing.assert_allclose(y, attention_core(q, k, v, mask, 0.3), atol=1e-5, rtol=1e-5)
    g_f = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fused_attention_core(q, k, v, mask, 0.3) * ct), (0, 1, 2)))(q, k, v)
    g_n = jax.grad(lambda q, k, v: jnp.sum(attention_core(q, k, v, mask, 0.3) * ct), (0, 1, 2))(q, k, v)
    for a, b_, name in zip(g_f, g_n, "qkv"):
        np.testing.assert_allclose(a, b_, atol=1e-5, rtol=1e-5, err_msg=name)


def test_fused_cpu_bf16_and_resolution():
    q, k, v, mask = (x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x for x in _inputs())
    a = jax.jit(lambda q, k, v: fused_attention_core(q, k, v, mask, 0.3))(q, k, v)
    assert a.dtype == jnp.bfloat16
    b = attention_core(q, k, v, mask, 0.3).astype(jnp.float32)
    assert float(jnp.max(jnp.abs(a.astype(jnp.float32) - b))) < 2e-2  # bf16 output rounding
    assert resolve_attention_impl("auto", "cpu") == "fused_cpu"  # the kernel builds wherever the tests run
    assert resolve_attention_impl("auto", "cpu", devices=4) == "naive"  # partitioned: a custom call would be gathered
    assert resolve_attention_impl("auto", "gpu") == "naive"
    assert resolve_attention_impl("blockwise", "gpu") == "blockwise"
    with pytest.raises(ValueError, match="CPU kernel"):
        resolve_attention_impl("fused_cpu", "gpu")


def test_blockwise_skips_blocks_above_the_diagonal():
    q, k, v, mask = _inputs(b=1, t=64, docs=False)
    jaxpr = jax.make_jaxpr(lambda q, k, v: blockwise_attention_core(q, k, v, mask, 0.3, 16))(q, k, v)
    dots = str(jaxpr).count("dot_general")
    assert dots == 2 * (4 * 5 // 2)  # 4 query blocks: 1+2+3+4 key blocks, QK^T and PV each (not 2 * 16)


def test_blockwise_bf16_close_to_naive():
    q, k, v, mask = (x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x for x in _inputs())
    a = jax.jit(lambda q, k, v: blockwise_attention_core(q, k, v, mask, 0.3, 16))(q, k, v).astype(jnp.float32)
    b = attention_core(q, k, v, mask, 0.3).astype(jnp.float32)
    assert a.dtype == b.dtype and float(jnp.max(jnp.abs(a - b))) < 2e-2  # bf16 output rounding


def test_blockwise_rejects_cross_attention():
    q, k, v, mask = _inputs()
    with pytest.raises(ValueError, match="self-attention"):
        blockwise_attention_core(q[:, :8], k, v, mask[:, :, :8], 0.3, 16)


@pytest.mark.parametrize("impl", ["blockwise", "causal_blocks", "fused_cpu"])
def test_model_with_blockwise_core_matches_naive(impl, attention="mla"):  # MLA: q/k and v head dims differ
    from farskip_jax.model import Transformer

    base = ["model.num_layers=2", "model.d_model=64", "model.num_heads=4", "model.num_kv_heads=2",
            "model.vocab_size=97", "moe.num_experts=0",  # dense layers: the attention core is the subject
            "model.max_seq_len=64", "train.seq_len=64", f"model.attention={attention}", "farskip.preset=farskip"]
    if attention == "mla":
        base += ["model.num_kv_heads=4", "model.kv_lora_rank=16", "model.qk_nope_head_dim=8",
                 "model.qk_rope_head_dim=4", "model.v_head_dim=8"]
    cfg_n = load_config(None, base + ["runtime.attention_impl=naive"])
    cfg_b = load_config(None, base + [f"runtime.attention_impl={impl}", "runtime.attention_block=16"])
    m_n = Transformer(cfg_n, rngs=nnx.Rngs(0))
    m_b = Transformer(cfg_b, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 48), 0, 97)

    @nnx.jit
    def loss_and_grad(model):
        def loss(model):
            logits = model(tokens, farskip=cfg_n.farskip).logits
            return jnp.mean(logits ** 2), logits
        return nnx.value_and_grad(loss, has_aux=True)(model)

    (ln, logits_n), gn = loss_and_grad(m_n)
    (lb, logits_b), gb = loss_and_grad(m_b)
    np.testing.assert_allclose(logits_b, logits_n, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(lb, ln, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(gb), jax.tree.leaves(gn)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-4)


def test_config_validates_attention_impl():
    with pytest.raises(ConfigError, match="attention_block"):
        load_config(None, ["runtime.attention_block=0"])
    with pytest.raises(ConfigError, match="attention_impl"):
        load_config(None, ["runtime.attention_impl=flash"])

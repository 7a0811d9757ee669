"""KV-cache generation equals recomputing the full forward for every prefix (standard and FarSkip)."""

import numpy as np
import pytest
from flax import nnx

from farskip_jax.config import Config, FarSkipConfig, ModelConfig, MoEConfig
from farskip_jax.serving.generate import generate, sample_next
from farskip_jax.model.transformer import Transformer


def tiny_model(**model_kw):
    m = dict(vocab_size=64, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, mlp_hidden=64, max_seq_len=128,
             first_k_dense=1)
    m.update(model_kw)
    cfg = Config(model=ModelConfig(**m), moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=32, num_shared_experts=1))
    model = Transformer(cfg, rngs=nnx.Rngs(3))
    # larger weights than the init so the greedy path is not trivially constant
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax_tree_scale(state, 4.0))
    return model


def jax_tree_scale(state, s):
    import jax

    return jax.tree.map(lambda x: x * s, state)


def full_logits(model, tokens, fs):
    """Oracle: one full causal forward gives the logits of every prefix (recompute, no cache)."""
    return np.asarray(nnx.jit(lambda m, t: m(t, farskip=fs).logits)(model, tokens))


@pytest.mark.parametrize("fs", [FarSkipConfig(), FarSkipConfig(preset="farskip", layers="last:2", skip_distance=2)],
                         ids=["standard", "farskip_last2_d2"])
def test_cached_greedy_equals_full_recompute(fs):
    model = tiny_model()
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 64, size=(2, 5)).astype(np.int32)
    out = generate(model, prompt, 6, farskip=fs)
    full = full_logits(model, out.tokens[:, :-1], fs)[:, 4:]  # logits after each prefix of length 5..10
    np.testing.assert_allclose(out.logits, full, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out.tokens[:, 5:], full.argmax(-1))  # greedy
    assert len(set(out.tokens[0, 5:].tolist())) > 1  # a non-degenerate path


def test_cached_farskip_chunked_attention_and_gate():
    model = tiny_model(attention_chunk_size=4, gated_attention=True)
    fs = FarSkipConfig(preset="farskip")
    prompt = np.arange(3, 9, dtype=np.int32)[None]
    out = generate(model, prompt, 5, farskip=fs)
    full = full_logits(model, out.tokens[:, :-1], fs)[:, 5:]
    np.testing.assert_allclose(out.logits, full, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out.tokens[:, 6:], full.argmax(-1))
    # the cache path really differs between connectivities (the test would catch a connectivity bug)
    std = full_logits(model, out.tokens[:, :-1], FarSkipConfig())[:, 5:]
    assert np.abs(std - full).max() > 1e-3


def test_top_p_sampling_keeps_the_nucleus():
    import jax
    import jax.numpy as jnp

    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    seen = {int(sample_next(logits, jax.random.key(i), 1.0, 0.7)[0]) for i in range(200)}
    assert seen == {0, 1}  # 0.5 < 0.7 so token 1 is in; 0.8 >= 0.7 so tokens 2, 3 are out
    assert int(sample_next(logits, jax.random.key(0), 0.0, 1.0)[0]) == 0


@pytest.mark.parametrize("fs", [FarSkipConfig(), FarSkipConfig(preset="farskip", layers="first:2")],
                         ids=["standard", "farskip_first2"])
def test_cached_foe_equals_full_recompute(fs):
    """Federation of Experts (2 groups): group h's heads read its own representation, which under
    standard connectivity differs per group (the other groups' routed outputs are missing) -- the
    cache must hold per-group keys/values for that to match the full forward."""
    import dataclasses

    model = tiny_model()
    cfg = model.cfg
    foe_cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, num_groups=2))
    foe = Transformer(foe_cfg, rngs=nnx.Rngs(3))
    nnx.update(foe, nnx.state(model, nnx.Param))  # the parameter tree does not depend on num_groups
    prompt = np.random.default_rng(1).integers(0, 64, size=(2, 4)).astype(np.int32)
    out = generate(foe, prompt, 5, farskip=fs)
    full = full_logits(foe, out.tokens[:, :-1], fs)[:, 3:]
    np.testing.assert_allclose(out.logits, full, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out.tokens[:, 4:], full.argmax(-1))
    plain = full_logits(model, out.tokens[:, :-1], fs)[:, 3:]  # FoE really is a different function
    assert np.abs(plain - full).max() > 1e-3


def test_cached_mla_equals_full_recompute():
    """MLA layers cache their decompressed per-head keys/values (v_head_dim != qk head dim)."""
    model = tiny_model(attention="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
    fs = FarSkipConfig(preset="farskip")
    prompt = np.arange(5, 10, dtype=np.int32)[None].repeat(2, 0)
    out = generate(model, prompt, 4, farskip=fs)
    full = full_logits(model, out.tokens[:, :-1], fs)[:, 4:]
    np.testing.assert_allclose(out.logits, full, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out.tokens[:, 5:], full.argmax(-1))

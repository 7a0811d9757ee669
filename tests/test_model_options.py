"""Model options: remat policies (same gradients), bf16 compute with fp32 params, tied embeddings, layouts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from farskip_jax.config import load_config
from farskip_jax.model import Transformer

BASE = ["model.vocab_size=64", "model.d_model=32", "model.num_layers=3", "model.num_heads=4", "model.num_kv_heads=1",
        "model.mlp_hidden=64", "moe.num_experts=4", "moe.top_k=2", "moe.expert_hidden=32", "farskip.preset=farskip"]


def _grads(cfg, tokens):
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def loss(st):
        out = nnx.merge(graphdef, st)(tokens)
        return jnp.mean(out.logits ** 2) + out.aux_loss

    return jax.jit(jax.grad(loss))(state)


@pytest.mark.parametrize("policy", ["full", "dots", "minimal"])
def test_remat_policies_give_identical_gradients(policy):
    tokens = jax.random.randint(jax.random.key(0), (2, 8), 0, 64)
    ref = _grads(load_config(None, BASE), tokens)
    got = _grads(load_config(None, BASE + [f"runtime.remat={policy}"]), tokens)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_bf16_compute_keeps_fp32_params_and_tracks_fp32():
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 64)
    m32 = Transformer(load_config(None, BASE), rngs=nnx.Rngs(0))
    m16 = Transformer(load_config(None, BASE + ["runtime.compute_dtype=bfloat16"]), rngs=nnx.Rngs(0))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(m16, nnx.Param)))
    l32, l16 = m32(tokens).logits, m16(tokens).logits
    assert l16.dtype == jnp.float32  # logits are returned in fp32 for the loss
    np.testing.assert_allclose(l16, l32, atol=3e-2)


def test_tied_embeddings_and_layer_layout():
    cfg = load_config(None, BASE + ["model.tie_embeddings=true", "model.num_layers=6", "model.first_k_dense=1",
                                    "model.moe_every=2"])
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    assert model.lm_head is None
    assert [b.is_moe for b in model.layers] == [False, True, False, True, False, True]
    out = model(jnp.zeros((1, 4), jnp.int32))
    assert out.load.shape == (3, 4)
    cfg = load_config(None, BASE + ["model.moe_layers=[0, 2]"])
    assert [b.is_moe for b in Transformer(cfg, rngs=nnx.Rngs(0)).layers] == [True, False, True]


def test_document_masking_blocks_cross_document_attention():
    cfg = load_config(None, BASE)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    a = jax.random.randint(jax.random.key(2), (1, 5), 0, 64)
    b = jax.random.randint(jax.random.key(3), (1, 6), 0, 64)
    packed = jnp.concatenate([a, b], 1)
    seg = jnp.array([[1] * 5 + [2] * 6])
    pos = jnp.array([list(range(5)) + list(range(6))])
    out = model(packed, positions=pos, segment_ids=seg).logits
    np.testing.assert_allclose(out[:, :5], model(a).logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[:, 5:], model(b).logits, rtol=1e-5, atol=1e-5)


def test_bf16_compute_on_amx_matches_the_float32_kernels(monkeypatch, kernels_config):
    """bf16 compute on a CPU with AMX runs the experts and the dense projections on the AMX kernels
    (seen in the lowered program) and matches the same model on the float32 kernels (kernels.amx: off:
    the same bf16-rounded operands) to bf16 rounding: logits and every parameter gradient."""
    from farskip_jax import kernels
    from farskip_jax.kernels.cpu import dispatch

    if not kernels.amx_available():
        pytest.skip("no usable AMX-BF16 on this CPU")
    monkeypatch.setattr(dispatch, "process_devices", lambda: 1)  # the suite's process has 8 CPU devices
    cfg = load_config(None, BASE + ["runtime.compute_dtype=bfloat16"])
    tokens = jax.random.randint(jax.random.key(2), (2, 8), 0, 64)
    graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))

    def loss(st):
        out = nnx.merge(graphdef, st)(tokens)
        return jnp.mean(out.logits ** 2) + out.aux_loss, out.logits

    f = jax.jit(jax.value_and_grad(loss, has_aux=True))
    assert f.lower(state).as_text().count("farskip_gmm_bf16") >= 3 * cfg.model.num_layers
    (_, logits_amx), g_amx = f(state)
    kernels_config(amx="off")
    f_ref = jax.jit(jax.value_and_grad(loss, has_aux=True))
    assert "farskip_gmm_bf16" not in f_ref.lower(state).as_text()
    (_, logits_ref), g_ref = f_ref(state)
    np.testing.assert_allclose(logits_amx, logits_ref, atol=8e-3)  # measured 2.0e-3 (one bf16 ulp at 0.38)
    for a, b in zip(jax.tree.leaves(g_amx), jax.tree.leaves(g_ref)):
        assert a.dtype == b.dtype == jnp.float32
        # measured at most 0.83% of the gradient norm
        assert np.linalg.norm(np.asarray(a) - np.asarray(b)) <= 2e-2 * np.linalg.norm(np.asarray(b)) + 1e-6

"""FarSkip connectivity: every sub-block receives exactly the stream docs/design.md section 1 defines.

The model is run with a recording layer step (tests/layer_recorder.py); from the recorded sub-block outputs a_j, s_j (shared or dense
MLP), r_j (routed) and the embedding, the expected input of every sub-block is rebuilt by the algebra
(full R, partial = R minus routed of the last d layers, outdated = R minus the MoE outputs of the last
d layers) and compared with what the sub-block actually received.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from farskip_jax.config import FarSkipConfig, load_config
from farskip_jax.model import Transformer
from layer_recorder import record

TOL = dict(rtol=1e-5, atol=1e-5)


def _cfg(*extra):
    return load_config(None, ["model.vocab_size=64", "model.d_model=32", "model.num_layers=5", "model.num_heads=4",
                              "model.num_kv_heads=2", "model.mlp_hidden=64", "model.first_k_dense=1",
                              "model.init_std=0.15", "moe.num_experts=4", "moe.top_k=2", "moe.expert_hidden=32",
                              "moe.num_shared_experts=1", *extra])


@pytest.fixture(scope="module")
def model_and_tokens():
    cfg = _cfg()
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, cfg.model.vocab_size)
    return model, tokens


def _expected_inputs(emb, trace, fs: FarSkipConfig, n):
    """Rebuild each layer's (attn_in, moe_in) from the recorded outputs by the algebra of docs/design.md section 1."""
    d = fs.skip_distance
    zero = jnp.zeros_like(emb)
    a = [t["attn"] for t in trace]
    s = [t["shared"] if t["shared"] is not None else zero for t in trace]
    r = [t["routed"] if t["routed"] is not None else zero for t in trace]
    out = []
    for k in range(n):
        full_prev = emb + sum((a[j] + s[j] + r[j] for j in range(k)), zero)
        attn_kind, moe_kind = fs.layer_inputs(k, n)
        recent = range(max(k - d, 0), k)  # the last d layers
        if attn_kind == "full":
            x_attn = full_prev
        elif attn_kind == "partial":
            x_attn = full_prev - sum((r[j] for j in recent), zero)
        else:
            x_attn = full_prev - sum((s[j] + r[j] for j in recent), zero)
        x_moe = full_prev + a[k] if moe_kind == "full" else full_prev
        out.append((attn_kind, moe_kind, x_attn, x_moe))
    return out


CASES = [
    dict(preset="standard"),
    dict(preset="farskip"),
    dict(preset="attn_only"),
    dict(preset="mlp_only"),
    dict(preset="farskip", attn_input="outdated"),  # all-outdated
    dict(preset="farskip", layers="first:2"),
    dict(preset="farskip", layers="last:2"),
    dict(preset="farskip", layers="range:1:3"),
    dict(preset="farskip", layers=(1, 3, 4)),
    dict(preset="farskip", skip_distance=2),
    dict(preset="farskip", skip_distance=3, attn_input="outdated"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_each_subblock_reads_the_designed_stream(model_and_tokens, case):
    model, tokens = model_and_tokens
    fs = FarSkipConfig(**case)
    trace = record(model, tokens, fs)
    emb = model.embed(tokens)
    n = len(model.layers)
    assert len(trace) == n
    for k, (t, (ak, mk, x_attn, x_moe)) in enumerate(zip(trace, _expected_inputs(emb, trace, fs, n))):
        assert (t["attn_kind"], t["moe_kind"]) == (ak, mk)
        np.testing.assert_allclose(t["attn_in"], x_attn, **TOL, err_msg=f"layer {k} attention input")
        np.testing.assert_allclose(t["moe_in"], x_moe, **TOL, err_msg=f"layer {k} MoE input")
    # the contributions are far above the tolerance, so a wrong stream cannot pass
    assert min(float(jnp.abs(t["routed"]).mean()) for t in trace if t["routed"] is not None) > 1e-2
    assert min(float(jnp.abs(t["attn"]).mean()) for t in trace) > 1e-2


def test_farskip_attention_reads_partial_literally(model_and_tokens):
    """Under `farskip`, attention of layer k gets R_{k-2} + a_{k-1} + shared_{k-1}; MoE gets R_{k-1}."""
    model, tokens = model_and_tokens
    tr = record(model, tokens, FarSkipConfig(preset="farskip"))
    emb = model.embed(tokens)
    R = [emb]
    for t in tr:
        R.append(R[-1] + t["attn"] + t["shared"] + (t["routed"] if t["routed"] is not None else 0))
    for k in range(2, len(tr)):
        np.testing.assert_allclose(tr[k]["attn_in"], R[k - 1] + tr[k - 1]["attn"] + tr[k - 1]["shared"], **TOL)
        np.testing.assert_allclose(tr[k]["moe_in"], R[k], **TOL)
    np.testing.assert_allclose(tr[0]["attn_in"], emb, **TOL)  # layer 0: streams start as the embedding
    np.testing.assert_allclose(tr[1]["attn_in"], emb + tr[0]["attn"] + tr[0]["shared"], **TOL)


def _plain_prenorm(model, tokens):
    """An independent standard pre-norm transformer over the same parameters."""
    h = model.embed(tokens)
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    for blk in model.layers:
        h = h + blk.attn(blk.attn_norm(h), pos, None)[0]
        x = blk.ffn_norm(h)
        if blk.moe is None:
            h = h + blk.mlp(x)
        else:
            o = blk.moe(x)
            h = h + (o.routed + (o.shared if o.shared is not None else 0))
    h = model.final_norm(h)
    return model.lm_head(h) if model.lm_head is not None else model.embed.attend(h)


def test_standard_equals_plain_prenorm_transformer(model_and_tokens):
    model, tokens = model_and_tokens
    np.testing.assert_allclose(model(tokens, farskip=FarSkipConfig()).logits, _plain_prenorm(model, tokens), **TOL)


def test_same_parameters_run_under_every_connectivity(model_and_tokens):
    """No layout change: one parameter state serves every preset; the outputs differ as they should."""
    model, tokens = model_and_tokens
    _, state_before = nnx.split(model)
    logits = {}
    for case in CASES:
        fs = FarSkipConfig(**case)
        logits[str(case)] = model(tokens, farskip=fs).logits
        assert bool(jnp.all(jnp.isfinite(logits[str(case)])))
    _, state_after = nnx.split(model)
    assert jax.tree.all(jax.tree.map(lambda x, y: bool(jnp.array_equal(x, y)), state_before, state_after))
    std = logits[str(dict(preset="standard"))]
    assert float(jnp.abs(logits[str(dict(preset="farskip"))] - std).max()) > 1e-3
    # a model built for farskip loads the standard model's state unchanged
    cfg_fs = _cfg("farskip.preset=farskip")
    other = Transformer(cfg_fs, rngs=nnx.Rngs(5))
    nnx.update(other, nnx.state(model))
    np.testing.assert_allclose(other(tokens).logits, logits[str(dict(preset="farskip"))], **TOL)
    np.testing.assert_allclose(other(tokens, farskip=FarSkipConfig()).logits, std, **TOL)


def test_no_shared_experts_partial_is_r_plus_attention():
    """Qwen3-MoE style (no shared experts): partial = R_{k-2} + a_{k-1}."""
    cfg = _cfg("moe.num_shared_experts=0", "model.first_k_dense=0")
    model = Transformer(cfg, rngs=nnx.Rngs(3))
    tokens = jax.random.randint(jax.random.key(2), (1, 8), 0, 64)
    tr = record(model, tokens, FarSkipConfig(preset="farskip"))
    R = [model.embed(tokens)]
    for t in tr:
        assert t["shared"] is None
        R.append(R[-1] + t["attn"] + t["routed"])
    for k in range(2, len(tr)):
        np.testing.assert_allclose(tr[k]["attn_in"], R[k - 1] + tr[k - 1]["attn"], **TOL)


def test_farskip_jit_and_grad_finite(model_and_tokens):
    model, tokens = model_and_tokens
    graphdef, state = nnx.split(model)

    @jax.jit
    def loss(state):
        m = nnx.merge(graphdef, state)
        out = m(tokens, farskip=FarSkipConfig(preset="farskip", skip_distance=2))
        lp = jax.nn.log_softmax(out.logits[:, :-1])
        return -jnp.take_along_axis(lp, tokens[:, 1:, None], -1).mean() + 0.01 * out.aux_loss

    g = jax.grad(loss)(state)
    leaves = jax.tree.leaves(g)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in leaves)
    assert sum(float(jnp.abs(x).sum()) for x in leaves) > 0

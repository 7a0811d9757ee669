"""Two-batch overlap (runtime.micro_batches = 2): the same values, and micro-batches that do not wait for
each other, read off the compiled HLO.

Values: the forward, the loss (CE + aux + z) and every gradient equal the plain model's (fp32, rtol
1e-5), unrolled and scanned, standard and FarSkip; on 8 CPU devices with expert parallelism they
equal the one-device plain model; KV-cache generation with micro-batches equals it (split caches).

Independence: in the compiled ENTRY computation of the EP forward (all_to_all dispatch) no op of
micro-batch B (scope layer_k/mb1) is reachable from a collective of micro-batch A (layer_k/mb0) of
the same layer, so B's attention and shared experts can run under A's dispatch / combine. The same
reachability check finds the path it should in the same program (A's dispatch of layer k reaches
A's own attention of layer k + 1 under standard connectivity), so it can fail; and in the tp_ep
layout no op of B is reachable from A's attention / routed all-reduces.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import multihost_worker as mw
from farskip_jax.config import FarSkipConfig, load_config, replace
from farskip_jax.errors import ConfigError
from farskip_jax.model.transformer import Transformer
from farskip_jax.parallel import create_model, make_mesh, shard_batch
from test_parallel_overlap import entry_graph, reachable_from

TOL = dict(rtol=1e-5, atol=1e-6)
OPTS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
BASE = ["model.vocab_size=64", "model.d_model=32", "model.num_layers=4", "model.num_heads=4", "model.num_kv_heads=2",
        "model.mlp_hidden=48", "model.first_k_dense=1", "model.init_std=0.15", "moe.num_experts=4", "moe.top_k=2",
        "moe.expert_hidden=32", "moe.num_shared_experts=1", "runtime.gmm=einsum", "runtime.z_loss_weight=1e-3"]


def _loss_and_grads(cfg, tokens):
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        out = nnx.merge(graphdef, p, rest)(tokens)
        logp = jax.nn.log_softmax(out.logits[:, :-1])
        ce = -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
        return ce + 0.01 * out.aux_loss + 1e-3 * out.z_loss, out

    (value, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True), compiler_options=OPTS)(params)
    return value, out, {k: np.asarray(v) for k, v in nnx.to_flat_state(grads)}


@pytest.mark.parametrize("preset,scan", [("standard", False), ("farskip", False), ("farskip", True)])
def test_values_and_gradients_equal_the_plain_model(preset, scan):
    tokens = jax.random.randint(jax.random.key(1), (4, 12), 0, 64)
    extra = [f"farskip.preset={preset}", f"runtime.scan_layers={str(scan).lower()}"]
    v1, o1, g1 = _loss_and_grads(load_config(None, [*BASE, *extra]), tokens)
    v2, o2, g2 = _loss_and_grads(load_config(None, [*BASE, *extra, "runtime.micro_batches=2"]), tokens)
    np.testing.assert_allclose(np.asarray(o2.logits), np.asarray(o1.logits), **TOL)
    for k in ("aux_loss", "z_loss", "load", "dropped"):
        np.testing.assert_allclose(np.asarray(getattr(o2, k)), np.asarray(getattr(o1, k)), err_msg=k, **TOL)
    np.testing.assert_allclose(float(v2), float(v1), **TOL)
    assert set(g1) == set(g2) and len(g1) > 10
    for k in g1:
        np.testing.assert_allclose(g2[k], g1[k], err_msg=str(k), **TOL)


def test_generation_with_micro_batches_equals_plain():
    from farskip_jax.serving.generate import generate, init_cache

    prompts = [[1, 2, 3, 4], [5, 6, 7], [9], [3, 3, 3]]
    outs = []
    for mb in (1, 2):
        cfg = load_config(None, [*BASE, "farskip.preset=farskip", "runtime.scan_layers=true", f"runtime.micro_batches={mb}"])
        model = Transformer(cfg, rngs=nnx.Rngs(0))
        outs.append(generate(model, prompts, max_new_tokens=3))
    np.testing.assert_array_equal(outs[1].tokens, outs[0].tokens)
    np.testing.assert_allclose(outs[1].logits, outs[0].logits, rtol=1e-5, atol=1e-5)
    cache = init_cache(model, 4, 8)
    assert len(cache) == 2 and cache[0][1][0][0].shape[1] == 2  # two caches of 2 rows (stacked: [repeats, b, ...])
    with pytest.raises(ConfigError, match="micro_batches"):
        init_cache(model, 3, 8)


def test_odd_batch_is_refused_before_anything_runs():
    with pytest.raises(ConfigError, match="micro_batches=2"):
        load_config(None, [*BASE, "runtime.micro_batches=2", "train.batch_size=3"])


# --------------------------------------------------------------------------------------------------
# expert parallelism: equal to one device; the compiled program keeps the micro-batches apart
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ep_programs():
    """{preset: (logits of the EP model with 2 micro-batches, entry graph)} and the one-device reference."""
    cfg = replace(mw.tiny_config(ep=4, num_layers=3), **{"runtime.micro_batches": 2})
    mesh = make_mesh(cfg.mesh)
    model = create_model(cfg, mesh)
    graphdef, state = nnx.split(model)
    toks = mw.tokens()
    out = {}
    for preset in ("standard", "farskip"):
        fs = FarSkipConfig(preset=preset)
        f = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t, farskip=fs).logits)
        compiled = f.lower(state, shard_batch(toks, mesh)).compile()
        out[preset] = (np.asarray(compiled(state, shard_batch(toks, mesh))), entry_graph(compiled.as_text()))
    plain = Transformer(mw.tiny_config(num_layers=3, dispatch="local"), rngs=nnx.Rngs(0))  # same seed, same weights
    return out, plain, toks


def _ops(op_name, opcode, scope, kinds=None):
    return {n for n, o in op_name.items() if scope in o and (kinds is None or opcode[n] in kinds)}


A2A = ("all-to-all", "all-to-all-start")


@pytest.mark.parametrize("preset", ["standard", "farskip"])
def test_ep_micro_batches_equal_one_device(ep_programs, preset):
    out, plain, toks = ep_programs
    want = plain(jnp.asarray(toks), farskip=FarSkipConfig(preset=preset)).logits
    np.testing.assert_allclose(out[preset][0], np.asarray(want), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("preset", ["standard", "farskip"])
def test_micro_batch_b_never_waits_for_a_collective_of_a(ep_programs, preset):
    out, _, _ = ep_programs
    users, op_name, opcode = out[preset][1]
    for k in range(3):
        a_coll = _ops(op_name, opcode, f"layer_{k}/mb0/", A2A)
        b_ops = _ops(op_name, opcode, f"layer_{k}/mb1/")
        b_attn = _ops(op_name, opcode, f"layer_{k}/mb1/attention")
        assert len(a_coll) >= 2 and b_attn, (k, len(a_coll))  # dispatch + combine of A
        waiting = b_ops & reachable_from(users, a_coll)
        assert not waiting, (k, sorted(op_name[n] for n in waiting)[:5])


def test_the_check_finds_a_path_that_exists(ep_programs):
    """Positive control: under standard connectivity A's dispatch of layer k reaches A's attention of
    layer k + 1 (its input holds A's routed output), so the reachability check can fail."""
    out, _, _ = ep_programs
    users, op_name, opcode = out["standard"][1]
    for k in range(2):
        a_disp = _ops(op_name, opcode, f"layer_{k}/mb0/moe/shard_map/dispatch", A2A)
        a_next = _ops(op_name, opcode, f"layer_{k + 1}/mb0/attention")
        assert a_disp and a_next & reachable_from(users, a_disp)


def test_tp_ep_micro_batch_b_never_waits_for_a_allreduce():
    from farskip_jax.serving.tp_ep import TpEpLayout, abstract_inference_model
    from test_inference_layout import tiny_cfg

    cfg = replace(tiny_cfg(num_layers=2, first_k_dense=0), **{"runtime.micro_batches": 2})
    mesh = make_mesh(cfg.mesh)
    layout = TpEpLayout(mesh)
    graphdef, state = abstract_inference_model(cfg, mesh)
    tokens = jax.ShapeDtypeStruct((4, 8), np.int32, sharding=layout.batch_sharding(2))
    fn = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t, farskip=FarSkipConfig(preset="farskip")).logits)
    users, op_name, opcode = entry_graph(fn.lower(state, tokens).compile(compiler_options=layout.compiler_options()).as_text())
    for k in range(2):
        a_ar = _ops(op_name, opcode, f"layer_{k}/mb0/", ("all-reduce", "all-reduce-start"))
        b_ops = _ops(op_name, opcode, f"layer_{k}/mb1/")
        assert len(a_ar) >= 2 and b_ops  # A's attention and routed all-reduces
        assert not b_ops & reachable_from(users, a_ar)

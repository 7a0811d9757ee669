"""The non-finite guard of the optimizer update (train/step.apply_if_finite): the cond (CPU) and the
select (GPU/TPU: it fuses into the update, which then writes into the donated state) give the same
state bit for bit, finite or not, and each platform lowers its own form (the compile target decides,
so a deviceless GPU compile on this CPU machine gets the select)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from farskip_jax.train.step import apply_if_finite

TX = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1))


def _tree(seed):
    r = np.random.RandomState(seed)
    return {"w": jnp.asarray(r.randn(8, 4), jnp.float32), "b": jnp.asarray(r.randn(4), jnp.float32)}


@pytest.mark.parametrize("finite", [True, False])
def test_cond_and_select_agree_bitwise(finite):
    params, grads = _tree(0), _tree(1)
    opt = TX.init(params)
    opt = TX.update(grads, opt, params)[1]  # non-zero moments and a count
    f = jnp.asarray(finite)
    outs = {g: jax.jit(lambda f, g_, o, p, g=g: apply_if_finite(TX, f, g_, o, p, guard=g))(f, grads, opt, params)
            for g in ("cond", "select", "platform")}
    for g in ("select", "platform"):
        for a, b in zip(jax.tree.leaves(outs["cond"]), jax.tree.leaves(outs[g])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    moved = not np.array_equal(np.asarray(outs["cond"][0]["w"]), np.asarray(params["w"]))
    assert moved == finite


def _compiled_text(devices, flags=None):
    sh = NamedSharding(jax.sharding.Mesh(np.array(devices[:1]), ("d",)), P())
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), _tree(0))
    opt = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), jax.eval_shape(TX.init, params))
    f = jax.ShapeDtypeStruct((), jnp.bool_, sharding=sh)
    lowered = jax.jit(lambda f, g, o, p: apply_if_finite(TX, f, g, o, p)).lower(f, params, opt, params)
    return lowered.compile(compiler_options=flags or {}).as_text()


def test_each_platform_compiles_its_own_form(h100x8):
    from farskip_jax.analysis.deviceless import LHS_FLAGS

    cpu, gpu = _compiled_text(jax.devices()), _compiled_text(h100x8, LHS_FLAGS)
    assert " conditional(" in cpu, "the CPU form is a cond"
    assert " conditional(" not in gpu and " select(" in gpu

"""FoE token layouts and group placements under expert parallelism (parallel/foe.py, model/foe.TokenLayout).

On 8 CPU devices (EP 8 = group x expert), fp32, against the one-device FoE model (same parameters,
no mesh, no collectives; FoE is its own model, so like is compared with like):
- runtime.foe_tokens=sharded (tokens split over the device groups between the groups' sub-blocks: the
  sums are reduce-scatters, views for a group's attention / experts all-gathers) with the contiguous
  and the strided group placement, H = 2 and H = 4, standard, farskip and a mixed layer set: loss,
  logits and every gradient equal the single-device model (rtol 1e-5);
- the compiled sharded forward has no all-reduce of a [.., d] activation left: the cross-group sums
  are reduce-scatters and all-gathers over the group axis (strided: over neighbouring devices);
- the replicated layout with the strided placement equals the single-device model too, and its
  all-to-alls stay inside the strided groups;
- a batch that cannot be split over the groups fails with a ConfigError naming the layout.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import multihost_worker as mw
from farskip_jax.analysis.groups import axis_groups, hlo_collectives
from farskip_jax.config import FarSkipConfig, load_config
from farskip_jax.errors import ConfigError
from farskip_jax.model import Transformer
from farskip_jax.parallel import shard_batch
from farskip_jax.parallel.build import create_foe_model
from farskip_jax.parallel.foe import make_foe_mesh

RTOL, ATOL = 1e-5, 1e-5  # test_foe.py's tolerances (fp32 sums in another order)
D = 32


def _cfg(h, *extra):
    return load_config(None, ["model.vocab_size=64", f"model.d_model={D}", "model.num_layers=3", "model.num_heads=4",
                              "model.num_kv_heads=4", "model.mlp_hidden=64", "model.first_k_dense=1",
                              "model.init_std=0.15", "moe.num_experts=8", "moe.top_k=4", "moe.expert_hidden=16",
                              "moe.num_shared_experts=1", "mesh.expert=8", "mesh.data=1", "runtime.dispatch=all_to_all",
                              f"runtime.num_groups={h}", *extra])


def _tokens(cfg, b=8, s=8):
    return np.asarray(jax.random.randint(jax.random.key(1), (b, s), 0, cfg.model.vocab_size))


CASES = {"standard": FarSkipConfig(preset="standard"), "farskip": FarSkipConfig(preset="farskip"),
         "mixed": FarSkipConfig(preset="farskip", layers="first:2")}


def _loss(model, toks, fs):
    out = model(toks, farskip=fs)
    logp = jax.nn.log_softmax(out.logits[:, :-1], axis=-1)
    ce = -jnp.mean(jnp.take_along_axis(logp, toks[:, 1:, None], axis=-1))
    return ce + 0.01 * out.aux_loss, out


def _all(model, toks):
    def f(m, t):
        return {k: nnx.value_and_grad(functools.partial(_loss, fs=fs), has_aux=True)(m, t) for k, fs in CASES.items()}

    return {k: (loss, out, grads) for k, ((loss, out), grads) in nnx.jit(f)(model, toks).items()}


def _reference(cfg, toks):
    res = _all(Transformer(cfg, rngs=nnx.Rngs(0)), jnp.asarray(toks))
    return {k: (np.asarray(loss), np.asarray(out.logits), [np.asarray(g) for g in jax.tree.leaves(grads)])
            for k, (loss, out, grads) in res.items()}


@pytest.mark.parametrize("h,placement,attention", [
    (2, "contiguous", "groups"),  # the layout itself in the default run; the other placements / H under -m extended
    (2, "contiguous", "local"),  # token-local attention where the groups' inputs coincide (runtime.foe_attention)
    pytest.param(2, "strided", "groups", marks=pytest.mark.extended),
    pytest.param(4, "strided", "groups", marks=pytest.mark.extended),
    pytest.param(4, "contiguous", "local", marks=pytest.mark.extended)])
def test_sharded_tokens_equal_single_device(h, placement, attention):
    cfg = _cfg(h, "runtime.foe_tokens=sharded", f"runtime.foe_attention={attention}")
    toks = _tokens(cfg)
    mesh = make_foe_mesh(cfg.mesh, h, placement=placement)
    model = create_foe_model(cfg, mesh, seed=0)
    res = _all(model, shard_batch(toks, mesh))
    mw.assert_matches_reference(res, _reference(cfg, toks), list(CASES), rtol=RTOL, atol=ATOL)
    # the logits come out on each device's own tokens (batch over expert x group)
    spec = res["farskip"][1].logits.sharding.spec
    assert "group" in tuple(spec)[0]


@pytest.mark.extended
def test_replicated_strided_equals_single_device():
    cfg = _cfg(2)
    toks = _tokens(cfg)
    mesh = make_foe_mesh(cfg.mesh, 2, placement="strided")
    assert [sorted(int(d.id) for d in mesh.devices[0, 0, g].flat) for g in range(2)] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    res = _all(create_foe_model(cfg, mesh, seed=0), shard_batch(toks, mesh))
    mw.assert_matches_reference(res, _reference(cfg, toks), ["standard", "farskip"], rtol=RTOL, atol=ATOL)


def _device_groups(mesh, groups):
    """Logical replica groups (positions in the program's device assignment) as sorted device-id tuples."""
    flat = list(mesh.devices.flat)
    return sorted(tuple(sorted(int(flat[i].id) for i in g)) for g in groups)


@pytest.mark.parametrize("placement,attention", [("contiguous", "groups"), ("contiguous", "local"),
                                                 pytest.param("strided", "groups", marks=pytest.mark.extended)])
def test_sharded_forward_sums_are_reduce_scatter_and_all_gather(placement, attention):
    cfg = _cfg(2, "runtime.foe_tokens=sharded", f"runtime.foe_attention={attention}")
    mesh = make_foe_mesh(cfg.mesh, 2, placement=placement)
    model = create_foe_model(cfg, mesh, seed=0)
    graphdef, state = nnx.split(model)
    fs = CASES["farskip"]
    fwd = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t, farskip=fs).logits)
    hlo = fwd.lower(state, shard_batch(_tokens(cfg), mesh)).compile().as_text()
    cols = hlo_collectives(hlo)
    group = _device_groups(mesh, axis_groups(mesh, ("group",)))
    inner = _device_groups(mesh, axis_groups(mesh, ("expert",)))
    acts = [c for c in cols if c.shapes and any(dims and dims[-1] == D for _, dims in c.shapes)]
    kinds = {c.op for c in acts}
    assert "all-reduce" not in kinds, kinds  # no replicated activation sum left
    rs = [c for c in acts if c.op == "reduce-scatter"]
    ag = [c for c in acts if c.op == "all-gather"]
    # farskip, 3 layers (1 dense + 2 MoE): a reduce-scatter per attention sum and per routed sum
    # (5); an all-gather per attention input after layer 0 and per MoE input (2 + 2). Local attention
    # (every farskip layer's groups read one input): only the routed sums and the MoE inputs are left
    want = (5, 4) if attention == "groups" else (2, 2)
    assert (len(rs), len(ag)) == want, (len(rs), len(ag))
    for c in rs + ag:
        assert _device_groups(mesh, c.groups) == group
    # the token exchanges stay inside a device group (the routing, computed on the own tokens, may be
    # redistributed over the groups: a few int / float entries per token)
    a2a = [c for c in cols if c.op == "all-to-all" and any(dims and dims[-1] == D for _, dims in c.shapes)]
    assert a2a and all(_device_groups(mesh, c.groups) == inner for c in a2a)
    if placement == "strided":  # a sum's devices are neighbours: {0, 1}, {2, 3}, ...
        assert group == [(0, 1), (2, 3), (4, 5), (6, 7)]


def test_unsplittable_batch_fails_clearly():
    cfg = _cfg(2, "runtime.foe_tokens=sharded")
    mesh = make_foe_mesh(cfg.mesh, 2)
    model = create_foe_model(cfg, mesh, seed=0)
    toks = _tokens(cfg, b=4)  # 4 rows over expert 4 x group 2
    with pytest.raises(ConfigError, match="foe_tokens"):
        nnx.jit(lambda m, t: m(t).logits)(model, shard_batch(toks, mesh))

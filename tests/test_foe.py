"""Federation of Experts (runtime.num_groups = H): model/foe.py.

- H = 1 through the FoE code path equals the ordinary model (same params, same logits, same routing);
  the parameter tree does not depend on num_groups (any checkpoint loads with any H).
- per-group routing never selects an expert outside the group of the choice slot, even when the
  selection bias pushes every token towards another group's experts.
- an independent oracle (per-group loop: group h's attention = the ordinary attention module with
  every other group's o_proj rows zeroed, run on group h's own stream; routing/experts as numpy
  loops per group and per token; streams rebuilt as sums from the definitions) matches the model
  under every connectivity preset, skip distance 2, a partial layer set, H = 2 and H = 4.
- configuration errors name the culprit; gradients under remat equal those without.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from farskip_jax.config import FarSkipConfig, load_config, replace
from farskip_jax.errors import ConfigError
from farskip_jax.model import Transformer
from farskip_jax.model.foe import FoEStep
from farskip_jax.model.layer_loop import run_layers
from layer_recorder import record

TOL = dict(rtol=1e-5, atol=1e-5)


def _cfg(*extra):
    return load_config(None, ["model.vocab_size=64", "model.d_model=32", "model.num_layers=3", "model.num_heads=4",
                              "model.num_kv_heads=2", "model.mlp_hidden=64", "model.first_k_dense=1",
                              "model.init_std=0.15", "moe.num_experts=8", "moe.top_k=4", "moe.expert_hidden=16",
                              "moe.num_shared_experts=1", *extra])


def _tokens(cfg, b=2, s=12, seed=1):
    return jax.random.randint(jax.random.key(seed), (b, s), 0, cfg.model.vocab_size)


def foe_forward(model, tokens, fs: FarSkipConfig, num_groups: int):
    """The FoE layer step (model/foe.FoEStep) with an explicit group count through the layer loop."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    step = FoEStep(model, positions, None, fs, num_groups=num_groups)
    res = run_layers(model, step.init(model.embed(tokens)), step, fs, scan=False)
    return model.output(res.carry.full, res.outs, None)


# --------------------------------------------------------------------------------------------------
# H = 1 is the ordinary model; parameters do not depend on H
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", [pytest.param("standard", marks=pytest.mark.extended), "farskip"])  # -m extended
def test_one_group_equals_ordinary(preset):
    cfg = _cfg()
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = _tokens(cfg)
    fs = FarSkipConfig(preset=preset)
    ref = model(tokens, farskip=fs)
    out = foe_forward(model, tokens, fs, num_groups=1)
    np.testing.assert_allclose(out.logits, ref.logits, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(out.load, ref.load)  # identical expert choices
    np.testing.assert_allclose(out.aux_loss, ref.aux_loss, rtol=1e-6)
    np.testing.assert_allclose(out.z_loss, ref.z_loss, rtol=1e-6)


def test_params_independent_of_num_groups():
    a = nnx.state(Transformer(_cfg(), rngs=nnx.Rngs(0)), nnx.Param)
    b = nnx.state(Transformer(_cfg("runtime.num_groups=2"), rngs=nnx.Rngs(0)), nnx.Param)
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b) and len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(x, y)


# --------------------------------------------------------------------------------------------------
# routing stays inside the group
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("groups,bias", [(2, False), (4, False), (2, True), (4, True)])
def test_routing_within_group(groups, bias):
    cfg = _cfg(f"runtime.num_groups={groups}", f"moe.selection_bias={str(bias).lower()}", "model.num_kv_heads=4")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    router = model.layers[1].moe.router
    e, k = cfg.moe.num_experts, cfg.moe.top_k
    if bias:  # every token would prefer group 0's experts if selection crossed groups
        router.bias[...] = jnp.where(jnp.arange(e) < e // groups, 10.0, 0.0)
    x = jax.random.normal(jax.random.key(3), (3, 10, cfg.model.d_model))
    r = router(x, groups)
    idx = np.asarray(r.indices)
    slot_group = np.arange(k) // (k // groups)
    np.testing.assert_array_equal(idx // (e // groups), np.broadcast_to(slot_group, idx.shape))
    for g in range(groups):  # distinct experts per group, weights normalised within the group
        sl = idx[..., slot_group == g]
        assert (np.sort(sl, -1)[..., 1:] != np.sort(sl, -1)[..., :-1]).all() if sl.shape[-1] > 1 else True
        np.testing.assert_allclose(np.asarray(r.weights)[..., slot_group == g].sum(-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(float(r.load.sum()), 1.0, rtol=1e-6)


# --------------------------------------------------------------------------------------------------
# per-group loop oracle
# --------------------------------------------------------------------------------------------------


def _softmax(x):
    x = x - x.max(-1, keepdims=True)
    p = np.exp(x)
    return p / p.sum(-1, keepdims=True)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _oracle_routed(block, hin, groups):
    """Numpy per-group, per-token, per-expert loop -> m [H, b, s, d]."""
    b, s, d = hin.shape
    x = np.asarray(hin, np.float64).reshape(-1, d)
    moe = block.moe
    e, k = moe.cfg.num_experts, moe.cfg.top_k
    eg, kg = e // groups, k // groups
    logits = x @ np.asarray(moe.router.w[...], np.float64)
    wg, wu, wd = (np.asarray(w[...], np.float64) for w in (moe.experts.w_gate, moe.experts.w_up, moe.experts.w_down))
    m = np.zeros((groups, x.shape[0], d))
    for g in range(groups):
        p = _softmax(logits[:, g * eg:(g + 1) * eg])
        for t in range(x.shape[0]):
            top = np.argsort(-p[t], kind="stable")[:kg]
            ws = p[t, top] / p[t, top].sum()
            for el, wt in zip(top, ws):
                ex = g * eg + el
                m[g, t] += wt * ((_silu(x[t] @ wg[ex]) * (x[t] @ wu[ex])) @ wd[ex])
    return m.reshape(groups, b, s, d).astype(np.float32)


def _oracle_logits(model, tokens, fs: FarSkipConfig, groups: int):
    cfg = model.cfg
    n, d = len(model.layers), fs.skip_distance
    hpg = cfg.model.num_heads // groups * cfg.model.resolved_head_dim  # o_proj rows per group
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    emb = np.asarray(model.embed(tokens))
    zero = np.zeros_like(emb)
    A, S, M = [], [], []  # per layer: attention [b,s,d], shared / dense MLP [b,s,d], routed [H,b,s,d]

    def stream(k, group=None, drop_routed=(), drop_shared=()):
        """emb + sum_{j<k} (a_j + s_j + sum_h m^h_j), leaving out the named parts; group=g leaves out
        the other groups' routed outputs of layer k-1 (group g's own representation)."""
        x = emb.copy()
        for j in range(k):
            x = x + A[j] + (zero if j in drop_shared else S[j])
            for h in range(groups):
                if j in drop_routed or (group is not None and j == k - 1 and h != group):
                    continue
                x = x + M[j][h]
        return x

    for k, block in enumerate(model.layers):
        attn_kind, moe_kind = fs.layer_inputs(k, n)
        recent = set(range(max(k - d, 0), k))
        a_k = zero
        for g in range(groups):
            if attn_kind == "full":
                x = stream(k, group=g)
            elif attn_kind == "partial":
                x = stream(k, drop_routed=recent)
            else:
                x = stream(k, drop_routed=recent, drop_shared=recent)
            attn_g = nnx.clone(block.attn)
            w = np.array(attn_g.o_proj.w[...])
            w[: g * hpg] = 0.0
            w[(g + 1) * hpg:] = 0.0
            attn_g.o_proj.w[...] = jnp.asarray(w)
            a_k = a_k + np.asarray(attn_g(block.attn_norm(jnp.asarray(x)), positions, None)[0])
        A.append(a_k)
        x_moe = stream(k) + a_k if moe_kind == "full" else stream(k)
        hin = block.ffn_norm(jnp.asarray(x_moe))
        if block.moe is None:
            S.append(np.asarray(block.mlp(hin)))
            M.append(np.zeros((groups, *emb.shape), np.float32))
            continue
        S.append(np.asarray(block.moe.shared(hin)) if block.moe.shared is not None else zero)
        M.append(_oracle_routed(block, hin, groups))
    x = model.final_norm(jnp.asarray(stream(n)))
    return np.asarray(model.lm_head(x))


ORACLE_CASES = [
    dict(preset="standard"),
    dict(preset="farskip"),
    dict(preset="attn_only"),
    dict(preset="mlp_only"),
    dict(preset="farskip", attn_input="outdated", skip_distance=2, layers="first:2"),
]


@pytest.fixture(scope="module")
def foe_model():
    cfg = _cfg("runtime.num_groups=2")
    return Transformer(cfg, rngs=nnx.Rngs(0)), _tokens(cfg)


@pytest.mark.parametrize("case", ORACLE_CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_matches_per_group_oracle(foe_model, case):
    model, tokens = foe_model
    fs = FarSkipConfig(**case)
    out = model(tokens, farskip=fs)
    np.testing.assert_allclose(out.logits, _oracle_logits(model, tokens, fs, 2), **TOL)


def test_matches_oracle_four_groups():
    cfg = _cfg("runtime.num_groups=4", "model.num_kv_heads=4", "model.num_layers=2")
    model = Transformer(cfg, rngs=nnx.Rngs(2))
    tokens = _tokens(cfg)
    for preset in ("standard", "farskip"):
        fs = FarSkipConfig(preset=preset)
        np.testing.assert_allclose(model(tokens, farskip=fs).logits, _oracle_logits(model, tokens, fs, 4), **TOL)


def test_farskip_attention_reads_the_synchronised_stream(foe_model):
    """Converted layers' groups all read the same stream; standard layers read group-specific ones."""
    model, tokens = foe_model
    std = record(model, tokens, FarSkipConfig(preset="standard"))
    fsk = record(model, tokens, FarSkipConfig(preset="farskip"))
    assert float(jnp.max(jnp.abs(std[2]["attn_in"][0] - std[2]["attn_in"][1]))) > 1e-3  # after an MoE layer
    np.testing.assert_array_equal(fsk[2]["attn_in"][0], fsk[2]["attn_in"][1])
    np.testing.assert_allclose(std[2]["routed"], std[2]["routed_groups"].sum(0), **TOL)


# --------------------------------------------------------------------------------------------------
# errors, gradients
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra,culprit", [
    (("runtime.num_groups=4",), "num_kv_heads"),
    (("runtime.num_groups=2", "moe.top_k=3"), "top_k"),
    (("runtime.num_groups=2", "model.attention=mla"), "model.attention"),
    (("runtime.num_groups=2", "moe.n_group=2"), "n_group"),
    (("runtime.num_groups=2", "model.qk_norm=true", "model.qk_norm_scope=all_heads"), "qk_norm_scope"),
])
def test_config_errors(extra, culprit):
    with pytest.raises(ConfigError, match=culprit):
        Transformer(_cfg(*extra), rngs=nnx.Rngs(0))


def test_gradients_with_remat_match():
    cfg = _cfg("runtime.num_groups=2", "model.num_layers=2")
    tokens = _tokens(cfg, s=8)

    def grads(remat):
        graphdef, params, rest = nnx.split(Transformer(replace(cfg, **{"runtime.remat": remat}), rngs=nnx.Rngs(0)),
                                           nnx.Param, ...)
        loss = lambda p: jnp.mean(nnx.merge(graphdef, p, rest)(tokens, farskip=FarSkipConfig(preset="farskip")).logits ** 2)
        return jax.jit(jax.grad(loss))(params)

    leaves0, leaves1 = jax.tree.leaves(grads("none")), jax.tree.leaves(grads("minimal"))
    assert len(leaves0) == len(leaves1) and all(float(jnp.max(jnp.abs(x))) > 0 for x in leaves0)
    for x, y in zip(leaves0, leaves1):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# expert parallelism on 8 CPU devices: equals the single-device run; collectives stay in their groups
# --------------------------------------------------------------------------------------------------


def _collectives(hlo: str, op: str) -> list[list[set[int]]]:
    """replica groups of every `op` (all-to-all / all-reduce) in compiled HLO text (explicit {{..}} form)."""
    out = []
    for line in hlo.splitlines():
        if re.search(rf" {op}(-start)?\(", line) and "replica_groups={{" in line:
            groups = re.search(r"replica_groups=\{(\{[\d,{}]*\})\}", line).group(1)
            out.append([set(map(int, g.split(","))) for g in re.findall(r"\{([\d,]+)\}", groups)])
    return out


def test_expert_parallel_matches_single_device_and_confines_all_to_all():
    from farskip_jax.parallel import shard_batch
    from farskip_jax.parallel.build import create_foe_model
    from farskip_jax.parallel.foe import make_foe_mesh

    cfg = _cfg("runtime.num_groups=2", "mesh.expert=8", "runtime.dispatch=all_to_all")
    tokens = np.asarray(_tokens(cfg, b=8, s=8))
    ref = Transformer(cfg, rngs=nnx.Rngs(0))  # single device, plain local routed compute
    mesh = make_foe_mesh(cfg.mesh, 2)  # group 2 x expert 4
    assert dict(mesh.shape) == dict(data=1, fsdp=1, group=2, expert=4, tensor=1)
    model = create_foe_model(cfg, mesh, seed=0)
    w = model.layers[1].moe.experts.w_gate[...]
    assert tuple(w.sharding.spec)[0] == ("group", "expert") and w.addressable_shards[0].data.shape[0] == 1
    fs = FarSkipConfig(preset="farskip")
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t, farskip=fs).logits)
    compiled = fwd.lower(state, shard_batch(tokens, mesh)).compile()
    logits = compiled(state, shard_batch(tokens, mesh))
    np.testing.assert_allclose(np.asarray(logits), ref(jnp.asarray(tokens), farskip=fs).logits, **TOL)

    hlo = compiled.as_text()
    dev = mesh.devices.reshape(2, 4)  # [group, expert-in-group] -> device id
    groups_devs = [set(int(d.id) for d in dev[g]) for g in range(2)]
    a2a = _collectives(hlo, "all-to-all")
    assert len(a2a) >= 2 * 2  # dispatch + combine of the 2 MoE layers
    for rg in a2a:  # every all-to-all runs inside one group's 4 devices
        assert sorted(map(sorted, rg)) == sorted(map(sorted, groups_devs))
    cross = [rg for rg in _collectives(hlo, "all-reduce")
             if sorted(map(sorted, rg)) == sorted(sorted(int(d.id) for d in dev[:, e]) for e in range(4))]
    assert cross  # the cross-group sum: an all-reduce over the group axis ({0,4},{1,5},...)

"""Node-deduplicated (hierarchical) dispatch, `runtime.dispatch=hierarchical` (parallel/ep.HierarchicalCompute).

On 8 CPU devices viewed as 2 "nodes" x 4 and 4 x 2 (runtime.gpus_per_node), in fp32:
- the exchange alone equals the all_to_all backend and the single-device path (outputs and the
  gradients of tokens, router weights and expert weights), dropless and with a capacity that drops
  (then the same assignments drop as in all_to_all, counted the same), on a data x expert mesh too;
- the whole model (standard and farskip) equals the single-device model, with DeepSeek-V3's
  group-limited routing (n_group / topk_group) and without;
- one node reduces to the all_to_all backend; meshes that do not split into nodes fail clearly;
- the compiled program's cross-node all-to-alls have one device per node in each replica group.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import multihost_worker as mw
from farskip_jax.config import RuntimeConfig, replace
from farskip_jax.errors import ConfigError
from farskip_jax.model.experts import ExpertWeights, local_routed_compute
from farskip_jax.model.router import RouteResult
from farskip_jax.parallel import create_model, make_mesh, shard_batch
from farskip_jax.config import MeshConfig
from farskip_jax.parallel.ep import (AllToAllCompute, HierarchicalCompute, expert_node_layout,
                                     routed_compute_for)
from farskip_jax.parallel.mesh import BATCH_AXES

RTOL, ATOL = 1e-5, 1e-6
T, D, H, E, K = 64, 16, 24, 16, 4


def _np(x):
    return np.asarray(jax.device_get(x))


def _inputs(seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(T, 1, D).astype(np.float32)
    scores = rng.rand(T, 1, E)
    scores[: T // 2, 0, :3] += 2.0  # skew: experts 0-2 (one node) overloaded in the first half
    idx = np.argsort(-scores, axis=-1)[..., :K].astype(np.int32)
    w = rng.rand(T, 1, K).astype(np.float32)
    ew = [rng.randn(E, D, H).astype(np.float32) * 0.3, rng.randn(E, D, H).astype(np.float32) * 0.3,
          rng.randn(E, H, D).astype(np.float32) * 0.3]
    return x, idx, w, ew


def _run(rc, mesh, cf, seed=0):
    """(y, dropped, grads of (x, w, w_gate, w_up, w_down)) of backend `rc` (None = single device)."""
    x, idx, w, ew = _inputs(seed)
    cfg = RuntimeConfig(capacity_factor=cf, gmm="einsum")
    if mesh is not None:
        tok = NamedSharding(mesh, P(BATCH_AXES, None, None))
        wsh = NamedSharding(mesh, P("expert", None, None))
        x, idx, w = (jax.device_put(a, tok) for a in (x, idx, w))
        ew = [jax.device_put(a, wsh) for a in ew]
    idx = jnp.asarray(idx)
    fn = rc or local_routed_compute

    def loss(x, w, wg, wu, wd):
        r = RouteResult(indices=idx, weights=w, aux_loss=None, z_loss=None, load=None)
        out = fn(x, r, ExpertWeights(wg, wu, wd), cfg)
        return jnp.sum(out.y * jnp.cos(out.y)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(x, w, *ew)
    return _np(out.y), int(out.dropped), [_np(g) for g in grads]


def _close(a, b):
    ya, da, ga = a
    yb, db, gb = b
    assert da == db
    np.testing.assert_allclose(ya, yb, rtol=RTOL, atol=ATOL)
    for x, y in zip(ga, gb):
        np.testing.assert_allclose(x, y, rtol=RTOL, atol=ATOL * max(1.0, np.abs(y).max()))


@functools.lru_cache(maxsize=None)
def _all_to_all(data, ep, cf, **opts):
    mesh = make_mesh(MeshConfig(data=data, expert=ep))
    return _run(AllToAllCompute(mesh, **opts), mesh, cf)


@functools.lru_cache(maxsize=None)
def _single_device():
    return _run(None, None, None)


EXT = pytest.mark.extended  # further cases of a property the default run checks (pytest -m extended)


@pytest.mark.parametrize("data,ep,per_node", [(1, 8, 2), pytest.param(1, 8, 4, marks=EXT),
                                              pytest.param(2, 4, 2, marks=EXT)])
def test_exchange_dropless_matches_single_device(data, ep, per_node):
    mesh = make_mesh(MeshConfig(data=data, expert=ep))
    hier = HierarchicalCompute(mesh, gpus_per_node=per_node)
    assert (hier.layout().nodes, hier.layout().per_node) == (ep // per_node, per_node)
    h = _run(hier, mesh, None)
    assert h[1] == 0
    _close(h, _single_device())  # = the all_to_all backend's (test_parallel_ep.py)


@pytest.mark.parametrize("per_node", [4, pytest.param(2, marks=EXT)])
def test_capacity_drops_as_all_to_all(per_node):
    mesh = make_mesh(MeshConfig(data=1, expert=8))
    h = _run(HierarchicalCompute(mesh, gpus_per_node=per_node), mesh, 1.0)
    assert h[1] > 0  # the skew makes the all_to_all backend drop
    _close(h, _all_to_all(1, 8, 1.0))


@EXT
def test_chunks_and_dispatch_dtype_options():
    mesh = make_mesh(MeshConfig(data=1, expert=8))
    opts = dict(chunks=2, dispatch_dtype="bfloat16")
    y, dropped, grads = _run(HierarchicalCompute(mesh, 4, **opts), mesh, 1.0)
    ya, da, ga = _all_to_all(1, 8, 1.0, **opts)
    assert dropped == da > 0
    np.testing.assert_allclose(y, ya, rtol=RTOL, atol=ATOL)  # the payload rounded once, at the source
    for g, r in zip(grads, ga):  # cotangents cross in bf16 too, summed in other orders
        np.testing.assert_allclose(g, r, rtol=2e-2, atol=2e-2 * np.abs(r).max())


# --------------------------------------------------------------------------------------------------
# whole model
# --------------------------------------------------------------------------------------------------

def _cfg(dispatch, ep, data=-1, group_limited=False, **runtime):
    cfg = mw.tiny_config(ep=ep, dispatch=dispatch, data=data)
    ov = {f"runtime.{k}": v for k, v in runtime.items()}
    if group_limited:  # 8 experts in 4 groups of 2, tokens pick from the best 2 groups
        ov.update({"moe.n_group": 4, "moe.topk_group": 2, "moe.scoring": "sigmoid", "moe.group_score": "top2_sum"})
    return replace(cfg, **ov) if ov else cfg


@functools.lru_cache(maxsize=None)
def _reference(group_limited, preset):
    cfg = _cfg("local", 1, data=1, group_limited=group_limited)
    model = create_model(cfg, make_mesh(cfg.mesh, devices=jax.devices()[:1]), seed=0)
    res = mw.loss_and_grads_presets(model, jnp.asarray(mw.tokens()), (preset,))
    return {p: (_np(l), _np(o.logits), [_np(g) for g in jax.tree.leaves(gr)]) for p, (l, o, gr) in res.items()}


@pytest.mark.parametrize("per_node,group_limited,preset", [(4, True, "farskip"),
                                                                pytest.param(2, False, "standard", marks=EXT)])
def test_model_matches_single_device(per_node, group_limited, preset):
    cfg = _cfg("hierarchical", 8, data=1, group_limited=group_limited, gpus_per_node=per_node)
    mesh = make_mesh(cfg.mesh)
    model = create_model(cfg, mesh, seed=0)
    assert isinstance(model.layers[1].moe.routed_compute, HierarchicalCompute)
    res = mw.loss_and_grads_presets(model, shard_batch(mw.tokens(), mesh), (preset,))
    mw.assert_matches_reference(res, _reference(group_limited, preset), (preset,), RTOL, ATOL)


# --------------------------------------------------------------------------------------------------
# layouts and errors
# --------------------------------------------------------------------------------------------------


def test_one_node_is_all_to_all_and_bad_layouts_fail():
    mesh = make_mesh(MeshConfig(data=2, expert=4))
    # EP inside a node (4 ranks on a node of 4 or 8): the all_to_all backend's program
    for per in (4, 8, None):  # None: process_index, one process on CPU = one node
        assert expert_node_layout(mesh, per).nodes == 1
    x, idx, w, ew = _inputs()
    cfg = RuntimeConfig(capacity_factor=1.0, gmm="einsum")
    r = RouteResult(indices=jnp.asarray(idx), weights=jnp.asarray(w), aux_loss=None, z_loss=None, load=None)
    progs = [str(jax.make_jaxpr(lambda x, ew: rc(x, r, ExpertWeights(*ew), cfg).y)(x, ew))
             for rc in (HierarchicalCompute(mesh, 8), AllToAllCompute(mesh))]
    assert progs[0] == progs[1]  # the same program
    with pytest.raises(ConfigError, match="equal blocks of consecutive"):
        expert_node_layout(make_mesh(MeshConfig(data=1, expert=8)), 3)  # 8 ranks over nodes of 3
    assert expert_node_layout(make_mesh(MeshConfig(data=4, expert=2)), 4).nodes == 1  # 2 expert groups per node
    with pytest.raises(ConfigError, match="gpus_per_node"):
        RuntimeConfig(dispatch="all_to_all", gpus_per_node=4)
    with pytest.raises(ConfigError, match=">= 1"):
        RuntimeConfig(dispatch="hierarchical", gpus_per_node=0)
    assert isinstance(routed_compute_for("hierarchical", mesh, 2), HierarchicalCompute)

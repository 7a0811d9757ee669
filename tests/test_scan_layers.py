"""runtime.scan_layers: the stacked, scanned model computes what the unrolled loop computes.

Oracle: the same config with scan_layers=false (the Python loop over layers), built from the same
seed (scan_layers stacks the very Blocks the loop would build, so the two start from equal weights;
test_init_equal checks that through model/stacking.py). Logits and every parameter gradient must
agree in fp32 to ~1e-5 for each connectivity preset, a converted-layer set that splits a stack into
scans of different static connectivity, skip_distance 2, dense-first / interleaved dense-MoE
layers, a model without shared experts and remat. Then: HF export -> import with scan on equals
off, a train step (with the router-bias rule) equal scanned vs looped, and a checkpoint written
with one layout restores into the other.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from farskip_jax.config import load_config, replace
from farskip_jax.loading import layer_keys as stacking
from farskip_jax.model.stacking import Segment, plan_segments
from farskip_jax.model.transformer import Transformer

TOL = dict(rtol=2e-5, atol=2e-6)
# fast XLA:CPU compiles (the tests are compile-bound); numerics are those of the default level
OPTS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
BASE = ["model.vocab_size=64", "model.d_model=32", "model.num_layers=4", "model.num_heads=4", "model.num_kv_heads=2",
        "model.mlp_hidden=48", "model.first_k_dense=1", "model.init_std=0.15", "moe.num_experts=4", "moe.top_k=2",
        "moe.expert_hidden=32", "moe.num_shared_experts=1", "runtime.gmm=einsum", "runtime.z_loss_weight=1e-3"]


def _cfg(*extra, scan: bool):
    return load_config(None, [*BASE, *extra, f"runtime.scan_layers={str(scan).lower()}"])


def _tokens(b=2, s=12):
    return jax.random.randint(jax.random.key(1), (b, s), 0, 64)


def _flat(state) -> dict:
    return {stacking.tuple_path_key(p): np.asarray(v.get_value() if hasattr(v, "get_value") else v)
            for p, v in nnx.to_flat_state(state)}


def _per_layer(state, cfg) -> dict:
    """{per-layer dotted key: array} of a state of either layout."""
    flat = _flat(state)
    return stacking.unstack_flat(flat, plan_segments(cfg)) if cfg.runtime.scan_layers else flat


def _forward(model, tokens, **kw):
    """jit(model(tokens, **kw)) with the fast compile options."""
    graphdef, state = nnx.split(model)

    def fn(st, t):
        return nnx.merge(graphdef, st)(t, **kw)

    return jax.jit(fn, compiler_options=OPTS)(state, tokens)


_CACHE: dict = {}


def _loss_and_grads(extra: tuple, scan: bool):
    key = (extra, scan)
    if key in _CACHE:
        return _CACHE[key]
    cfg = _cfg(*extra, scan=scan)
    tokens = _tokens()
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        out = nnx.merge(graphdef, p, rest)(tokens)
        return jnp.mean(jax.nn.log_softmax(out.logits)[..., 0]) + out.aux_loss + out.z_loss, out

    fn = jax.jit(jax.value_and_grad(loss, has_aux=True), compiler_options=OPTS)
    (_, out), grads = fn(params)
    _CACHE[key] = out, _per_layer(grads, cfg), str(jax.make_jaxpr(loss)(params))
    return _CACHE[key]


CASES = {  # 4 layers: layer 0 dense, layers 1-3 MoE (one stack of 3)
    "standard": (),
    "farskip": ("farskip.preset=farskip",),
    "attn_only": ("farskip.preset=attn_only",),
    "mlp_only": ("farskip.preset=mlp_only",),
    # layers 2-3 converted: the MoE stack runs layer 1 standard (a run of 1, unrolled), then one scan of 2
    "last2_split": ("farskip.preset=farskip", "farskip.layers=last:2"),
    # skip distance 2 with `outdated` attention, converted layers 1-2: a scan of 2, then layer 3 standard
    "skip2": ("farskip.preset=farskip", "farskip.attn_input=outdated", "farskip.skip_distance=2",
              "farskip.layers=[1, 2]"),
    # dense / MoE interleaved: one stack of period 2 (dense, MoE) x 2
    "moe_every2": ("farskip.preset=farskip", "model.first_k_dense=0", "model.moe_every=2"),
    "no_shared": ("farskip.preset=farskip", "moe.num_shared_experts=0"),
    "remat_minimal": ("farskip.preset=farskip", "runtime.remat=minimal"),
}


EXTENDED = {"attn_only", "mlp_only", "moe_every2", "no_shared"}  # run with pytest -m extended


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.extended) if c in EXTENDED else c
                                  for c in sorted(CASES)])
def test_scan_equals_loop(case):
    extra = CASES[case]
    loop_out, loop_g, _ = _loss_and_grads(extra, False)
    scan_out, scan_g, jaxpr = _loss_and_grads(extra, True)
    assert "scan[" in jaxpr or "scan(" in jaxpr, "the scanned model traced no lax.scan"
    np.testing.assert_allclose(np.asarray(scan_out.logits), np.asarray(loop_out.logits), **TOL)
    for k in ("aux_loss", "z_loss", "dropped"):
        np.testing.assert_allclose(np.asarray(getattr(scan_out, k)), np.asarray(getattr(loop_out, k)), **TOL)
    np.testing.assert_allclose(np.asarray(scan_out.load), np.asarray(loop_out.load), **TOL)
    assert set(scan_g) == set(loop_g) and len(loop_g) > 10
    for k in loop_g:
        np.testing.assert_allclose(scan_g[k], loop_g[k], err_msg=k, **TOL)
    if any(e.startswith("farskip.") for e in extra):  # the connectivity reached the scanned path
        std, _, _ = _loss_and_grads(tuple(e for e in extra if not e.startswith("farskip.")), False)
        assert np.abs(np.asarray(std.logits) - np.asarray(scan_out.logits)).max() > 1e-3


def test_hidden_and_views_under_scan():
    """return_hidden is stacked out of the scan; the per-layer views (what the FoE and the tp_ep
    layout's forward run unrolled) are the layers in order."""
    extra = ["farskip.preset=farskip", "farskip.layers=last:2"]
    tokens = _tokens()
    loop = Transformer(_cfg(*extra, scan=False), rngs=nnx.Rngs(0))
    scan = Transformer(_cfg(*extra, scan=True), rngs=nnx.Rngs(0))
    a = _forward(loop, tokens, return_hidden=True)
    b = _forward(scan, tokens, return_hidden=True)
    assert len(b.hidden) == 4
    for x, y in zip(a.hidden, b.hidden):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), **TOL)
    views = scan.blocks()
    assert [v.layer_idx for v in views] == list(range(4)) and [v.is_moe for v in views] == [False] + [True] * 3


def test_generate_under_scan():
    """KV-cache greedy decoding of a scanned model (serving/generate.py: the decode
    step is a scan over the stacked layers and cache) reproduces the scanned forward's logits of the generated sequence."""
    from farskip_jax.serving.generate import generate

    scan = Transformer(_cfg("farskip.preset=farskip", scan=True), rngs=nnx.Rngs(0))
    g = generate(scan, [[1, 2, 3, 4], [5, 6, 7, 8]], max_new_tokens=2)
    full = np.asarray(_forward(scan, jnp.asarray(g.tokens)).logits)
    np.testing.assert_allclose(g.logits, full[:, 3:5], rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(g.tokens[:, 4:], full[:, 3:5].argmax(-1))


def test_init_equal_and_state_conversion():
    """Same seed -> the stacked state is the per-layer state stacked (and back)."""
    lcfg, scfg = _cfg(scan=False), _cfg(scan=True)
    loop, scan = Transformer(lcfg, rngs=nnx.Rngs(3)), Transformer(scfg, rngs=nnx.Rngs(3))
    lf, sf = _flat(nnx.state(loop)), _flat(nnx.state(scan))
    assert any(k.startswith("stacks.1.blocks.0.") for k in sf) and not any(k.startswith("layers.") for k in sf)
    assert sf["stacks.1.blocks.0.moe.experts.w_gate"].shape == (3, 4, 32, 32)
    restacked = stacking.stack_flat(lf, plan_segments(scfg), stack=np.stack)
    assert set(restacked) == set(sf)
    for k in sf:
        np.testing.assert_array_equal(restacked[k], sf[k], err_msg=k)
    back = stacking.unstack_flat(sf, plan_segments(scfg))
    assert set(back) == set(lf)
    # stacked parameters carry the "layers" logical axis first; the rest as one layer's
    v = scan.stacks[1].blocks[0].moe.experts.w_gate
    assert v.get_metadata()["axes"] == ("layers", *loop.layers[1].moe.experts.w_gate.get_metadata()["axes"])


def test_plan_segments_of_the_real_shapes():
    def segs(path):
        return plan_segments(load_config(path))

    assert segs("configs/deepseek_v2_lite.yaml") == (Segment(0, 1, 1), Segment(1, 1, 26))
    assert segs("configs/qwen3_30b_a3b.yaml") == (Segment(0, 1, 48),)
    assert segs("configs/llama4_scout.yaml") == (Segment(0, 4, 12),)  # 3 chunked rope + 1 NoPE layer
    assert segs("configs/deepseek_v3_6l.yaml") == (Segment(0, 1, 1), Segment(1, 1, 5))
    for path in ("configs/deepseek_v2_lite.yaml", "configs/qwen3_30b_a3b.yaml", "configs/llama4_scout.yaml",
                 "configs/deepseek_v3_6l.yaml"):
        assert load_config(path).runtime.scan_layers, path
    assert not load_config("configs/tiny.yaml").runtime.scan_layers


def test_stacked_shardings_fsdp_ep():
    """On an fsdp x expert mesh a stacked weight shards every axis but the layer axis as one layer's
    (the shardings create_model and the HF loader place parameters with)."""
    from farskip_jax.parallel.build import model_mesh, state_shardings_on

    over = ["mesh.data=1", "mesh.fsdp=2", "mesh.expert=4", "runtime.dispatch=all_to_all", "moe.num_experts=8",
            "model.d_model=64"]

    def shardings(scan):
        cfg = _cfg(*over, scan=scan)
        state = nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
        return {stacking.tuple_path_key(p): tuple(s.spec)
                for p, s in nnx.to_flat_state(state_shardings_on(state, model_mesh(cfg)))}

    scan, loop = shardings(True), shardings(False)
    segs = plan_segments(_cfg(*over, scan=True))
    assert {lk for k in scan for lk, _ in stacking.layer_key(k, segs)} == set(loop)
    for k, spec in scan.items():
        for lk, r in stacking.layer_key(k, segs):
            assert spec == ((None, *loop[lk]) if r >= 0 else loop[lk]), k
    assert scan["stacks.1.blocks.0.moe.experts.w_gate"] == (None, "expert", "fsdp", None)
    assert scan["stacks.1.blocks.0.attn.q_proj.w"][:2] == (None, "fsdp")


def test_hf_roundtrip_scan_equals_loop(tmp_path):
    """Export from a scanned model == export from the looped one (same tensors); importing with
    scan on and off gives the same logits."""
    from safetensors.numpy import load_file

    from farskip_jax.convert import export_hf, import_hf

    extra = ["moe.num_shared_experts=0", "model.first_k_dense=1", "model.qk_norm=true", "runtime.gmm=einsum"]
    loop = Transformer(_cfg(*extra, scan=False), rngs=nnx.Rngs(0))
    scan_cfg = _cfg(*extra, scan=True)
    scan = Transformer(scan_cfg, rngs=nnx.Rngs(0))
    pa = export_hf(loop, _cfg(*extra, scan=False), str(tmp_path / "loop"), family="qwen3_moe")
    pb = export_hf(scan, scan_cfg, str(tmp_path / "scan"), family="qwen3_moe")
    ta, tb = load_file(f"{pa}/model.safetensors"), load_file(f"{pb}/model.safetensors")
    assert set(ta) == set(tb) and "model.layers.3.mlp.experts.3.down_proj.weight" in ta
    for k in ta:
        np.testing.assert_array_equal(ta[k], tb[k], err_msg=k)
    tokens = _tokens()
    ref = np.asarray(_forward(loop, tokens).logits)
    cfg_on, m_on = import_hf(pb, overrides=["runtime.scan_layers=true", "runtime.gmm=einsum"])
    cfg_off, m_off = import_hf(pb, overrides=["runtime.scan_layers=false", "runtime.gmm=einsum"])
    assert cfg_on.runtime.scan_layers and hasattr(m_on, "stacks") and hasattr(m_off, "layers")
    np.testing.assert_allclose(np.asarray(_forward(m_on, tokens).logits), ref, **TOL)
    np.testing.assert_allclose(np.asarray(_forward(m_off, tokens).logits), ref, **TOL)


def _train_cfg(scan: bool):
    return _cfg("moe.selection_bias=true", "runtime.bias_update_rate=0.01", "farskip.preset=farskip",
                "train.batch_size=2", "train.seq_len=12", "train.warmup_steps=1", "train.lr=1e-2", scan=scan)


def _batch(b=2, s=12):
    r = np.random.RandomState(0)
    toks = r.randint(0, 64, (b, s + 1)).astype(np.int32)
    return {"tokens": jnp.asarray(toks[:, :-1]), "targets": jnp.asarray(toks[:, 1:]),
            "positions": jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)),
            "segment_ids": jnp.ones((b, s), jnp.int32), "loss_mask": jnp.ones((b, s), jnp.float32)}


def _one_step(scan: bool):
    if ("step", scan) in _CACHE:
        return _CACHE[("step", scan)]
    from farskip_jax.loading.optimizer import make_optimizer
    from farskip_jax.loading.train_state import init_state
    from farskip_jax.train.step import make_train_step

    cfg = _train_cfg(scan)
    tx, sched = make_optimizer(cfg.train)
    g, st = init_state(Transformer(cfg, rngs=nnx.Rngs(0)), tx, 0)
    new, m = jax.jit(make_train_step(g, cfg, tx, sched), compiler_options=OPTS)(st, _batch())
    _CACHE[("step", scan)] = cfg, st, new, m
    return cfg, st, new, m


def test_train_step_scan_equals_loop():
    """One AdamW step with the aux-loss-free router-bias rule: params, bias and metrics agree."""
    lcfg, _, lnew, lm = _one_step(False)
    scfg, _, snew, sm = _one_step(True)
    for part in ("params", "bias"):
        a, b = _per_layer(lnew[part], lcfg), _per_layer(snew[part], scfg)
        assert set(a) == set(b) and a
        for k in a:
            np.testing.assert_allclose(b[k], a[k], err_msg=f"{part}.{k}", rtol=1e-4, atol=1e-6)
    lbias = _per_layer(lnew["bias"], lcfg)
    assert any(np.abs(v).max() > 0 for v in lbias.values())  # the bias rule did move the biases
    for k in ("loss", "grad_norm"):
        np.testing.assert_allclose(float(sm[k]), float(lm[k]), rtol=1e-5)


@pytest.mark.parametrize("first", [False, True])
def test_checkpoint_restores_across_the_switch(tmp_path, first):
    """A train state saved with scan_layers=first restores into a template of the other layout
    (params, optimizer moments, router bias), and the run folder accepts the change."""
    from farskip_jax.loading.checkpoint import Checkpointer
    from farskip_jax.train.rundir import check_run_dir, claim_run_dir

    cfg_a, _, st_a, _ = _one_step(first)
    cfg_b, st_b0, _, _ = _one_step(not first)
    ck = Checkpointer(str(tmp_path), async_save=False)
    ck.save(1, st_a, {"epoch": 0})
    ck.wait()
    restored, data = ck.restore(1, st_b0)
    ck.close()
    assert data == {"epoch": 0}
    for part in ("params", "bias"):
        a, b = _per_layer(st_a[part], cfg_a), _per_layer(restored[part], cfg_b)
        assert set(a) == set(b)
        for k in a:
            np.testing.assert_array_equal(b[k], a[k], err_msg=f"{part}.{k}")
    mu_a = [np.asarray(x) for x in jax.tree.leaves(st_a["opt"])]
    mu_b = [np.asarray(x) for x in jax.tree.leaves(restored["opt"])]
    assert sum(x.size for x in mu_a) == sum(x.size for x in mu_b)
    np.testing.assert_allclose(sum(float(np.abs(x).sum()) for x in mu_b), sum(float(np.abs(x).sum()) for x in mu_a),
                               rtol=1e-6)
    # the run folder written with one layout resumes with the other
    rcfg = replace(cfg_a, **{"train.run_dir": str(tmp_path / "run")})
    claim_run_dir(rcfg, check_run_dir(rcfg))
    folder = check_run_dir(replace(rcfg, **{"runtime.scan_layers": not first}))
    assert folder.resume and not folder.wipe

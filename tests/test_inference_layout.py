"""The paper's inference layout (inference.layout=tp_ep, serving/tp_ep.py) on 8 CPU devices.

1. Tensor-parallel attention (GQA with kv heads split or replicated, MLA) + replicated-activation MoE
   (experts over expert x tensor, psum of the routed sum) equals the one-device forward (fp32, 1e-5
   of the logits' scale), under standard and FarSkip connectivity, on meshes tensor=8, data=2 x
   tensor=4 and expert=2 x tensor=4; shared experts split over tensor (their partial sum in the
   attention all-reduce, the routed one, or their own) or replicated.
2. On the compiled HLO (XLA:CPU, and deviceless for 8 x H100 when the plugin is installed): one
   attention all-reduce (of a + s under FarSkip with tensor-parallel shared experts) and one routed
   all-reduce (of s + r under standard) per layer; under FarSkip no path from the
   attention all-reduce of layer k to the MoE of layer k, nor from the routed all-reduce of layer k
   to attention of layer k+1; under standard both paths exist (the check can fail).
"""

import jax
import numpy as np
import pytest
from flax import nnx

from farskip_jax.config import Config, FarSkipConfig, InferenceConfig, MeshConfig, ModelConfig, MoEConfig, RuntimeConfig, replace
from farskip_jax.errors import ConfigError
from farskip_jax.model.transformer import Transformer
from farskip_jax.serving.tp_ep import TpEpLayout, abstract_inference_model, check_tp_ep, inference_model, layout_for
from farskip_jax.parallel.mesh import make_mesh
from test_parallel_overlap import entry_graph, reachable_from


def tiny_cfg(mesh=None, **model_kw):
    m = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=8, num_kv_heads=8, mlp_hidden=64, first_k_dense=1,
             max_seq_len=128)
    m.update(model_kw)
    mesh = mesh or MeshConfig(data=1, tensor=8)
    # runtime.dispatch is the training layout's; its check wants all_to_all when mesh.expert > 1
    moe = MoEConfig(num_experts=8, top_k=2, expert_hidden=16, num_shared_experts=1)
    runtime = RuntimeConfig(dispatch="all_to_all" if mesh.expert > 1 else "local",
                            attention_impl="naive")  # the plain core on one device too (no CPU kernel)
    return Config(model=ModelConfig(**m), moe=moe, runtime=runtime, mesh=mesh, inference=InferenceConfig(layout="tp_ep"))


def reference(cfg, seed=3):
    """One-device model (the plain local MoE path) with random weights ~0.08 (norm scales ~1): logits
    with opinions. Filled from numpy (a jitted init of the model compiles for ~10 s on CPU)."""
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(seed)

    def fill(path, v):
        x = v.get_value()
        if not np.issubdtype(x.dtype, np.floating):
            return v.replace(np.zeros(x.shape, x.dtype))
        norm = str(getattr(path[-1], "key", "")) == "scale"
        r = rng.normal(size=x.shape)
        return v.replace(jax.device_put((1 + 0.1 * r if norm else 0.08 * r).astype(x.dtype), jax.devices()[0]))

    graphdef, state = nnx.split(model)
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(fill, state, is_leaf=is_var))


def assert_close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


CASES = {  # mesh, model keys, connectivity (FarSkipConfig keys), inference.shared_experts
    "gqa_kv_split_tp8": (MeshConfig(data=1, tensor=8), dict(num_kv_heads=8), dict(preset="standard"), "tensor"),
    "gqa_kv_split_tp8_shared_replicated": (MeshConfig(data=1, tensor=8), dict(num_kv_heads=8),
                                           dict(preset="farskip"), "replicated"),
    "gqa_kv_replicated_data2_tp4_bias_gate_qknorm": (
        MeshConfig(data=2, tensor=4), dict(num_kv_heads=2, attention_bias=True, gated_attention=True, qk_norm=True),
        dict(preset="farskip"), "tensor"),
    "mla_bias_gate_tp8": (MeshConfig(data=1, tensor=8),
                          dict(attention="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                               attention_bias=True, gated_attention=True), dict(preset="farskip"), "tensor"),
    "gqa_ep2_tp4": (MeshConfig(data=1, expert=2, tensor=4), dict(num_kv_heads=4), dict(preset="standard"), "tensor"),
    # shared experts with their own all-reduce: a converted subset (layer 1 standard, read by partial
    # attention of layer 2), and `outdated` attention inputs (which lack s); shared gate (Qwen2)
    "gqa_ep2_tp4_last1_shared_gate": (MeshConfig(data=1, expert=2, tensor=4), dict(num_kv_heads=4, num_layers=3),
                                      dict(preset="farskip", layers="last:1"), "tensor"),
    "gqa_tp8_attn_outdated": (MeshConfig(data=1, tensor=8), dict(num_kv_heads=8, num_layers=3),
                              dict(preset="farskip", attn_input="outdated"), "tensor"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tp_ep_forward_equals_one_device(case):
    mesh_cfg, model_kw, fs_kw, shared = CASES[case]
    cfg = tiny_cfg(mesh_cfg, **model_kw)
    cfg = replace(cfg, **{"inference.shared_experts": shared, "moe.shared_gate": case.endswith("shared_gate")})
    ref = reference(cfg)
    mesh = make_mesh(cfg.mesh)
    layout = layout_for(cfg, mesh)
    assert layout.shared == shared
    model = inference_model(cfg, mesh, state=nnx.state(ref))
    tokens = np.random.default_rng(0).integers(0, 64, (2, 10)).astype(np.int32)
    fs = FarSkipConfig(**fs_kw)
    want = np.asarray(nnx.jit(lambda m, t: m(t, farskip=fs).logits)(ref, tokens))
    graphdef, state = nnx.split(model)
    got = np.asarray(layout.forward_fn(graphdef, fs)(state, jax.device_put(tokens, layout.batch_sharding(2))))
    assert_close(got, want)
    # the experts really are split over the EP group, the heads over tensor, the shared experts as asked
    moe = model.layers[1].moe
    assert moe.experts.w_gate[...].sharding.spec[0] == ("expert", "tensor")
    assert model.layers[1].attn.o_proj.w[...].sharding.spec[0] == "tensor"
    want_spec = (None, "tensor") if shared == "tensor" else ()
    assert tuple(moe.shared.gate.w[...].sharding.spec) == want_spec


@pytest.mark.parametrize("change,match", [
    ({"model.num_heads": 4, "model.num_kv_heads": 4}, "model.num_heads=4"),
    ({"model.num_kv_heads": 4, "mesh.tensor": 8}, None),  # 4 kv heads replicated over 8 ranks: fine
    ({"model.num_heads": 24, "model.num_kv_heads": 3, "model.head_dim": 4}, "num_kv_heads=3"),
    ({"runtime.capacity_factor": 1.0}, "capacity_factor=null"),
    ({"moe.num_experts": 4}, "num_experts=4"),
    ({"model.qk_norm": True, "model.qk_norm_scope": "all_heads"}, "all_heads"),
    ({"moe.shared_hidden": 12}, "shared_experts=replicated"),  # 12 hidden units over 8 tensor ranks
    ({"moe.shared_hidden": 12, "inference.shared_experts": "replicated"}, None),
])
def test_tp_ep_config_errors_name_the_culprit(change, match):
    cfg = replace(tiny_cfg(), **change)
    mesh = make_mesh(cfg.mesh)
    if match is None:
        check_tp_ep(cfg, mesh)
        return
    with pytest.raises(ConfigError, match=match):
        check_tp_ep(cfg, mesh)


def test_fsdp_mesh_is_refused():
    cfg = tiny_cfg(MeshConfig(data=1, fsdp=2, tensor=4))
    with pytest.raises(ConfigError, match="mesh.fsdp=1"):
        inference_model(cfg, make_mesh(cfg.mesh), {})


# --------------------------------------------------------------------------------------------------
# compiled HLO: which all-reduce waits for what
# --------------------------------------------------------------------------------------------------

HLO_LAYERS = 3


def _hlo(devices=None, shared="tensor"):
    """{preset: entry graph} of the tp_ep forward compiled with the layout's options (CPU, or
    deviceless GPU when devices are given); shared: inference.shared_experts."""
    cfg = replace(tiny_cfg(num_layers=HLO_LAYERS, first_k_dense=0), **{"inference.shared_experts": shared})
    mesh = make_mesh(cfg.mesh, devices)
    layout = TpEpLayout(mesh, shared=shared)
    graphdef, state = abstract_inference_model(cfg, mesh)
    tokens = jax.ShapeDtypeStruct((2, 8), np.int32, sharding=layout.batch_sharding(2))
    out = {}
    for preset in ("standard", "farskip"):
        fs = FarSkipConfig(preset=preset)
        fn = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t, farskip=fs).logits)
        opts = dict(layout.compiler_options())
        if devices is not None:
            from farskip_jax.analysis.deviceless import LHS_FLAGS
            opts.update(LHS_FLAGS)
        out[preset] = entry_graph(fn.lower(state, tokens).compile(compiler_options=opts).as_text())
    return out


@pytest.fixture(scope="module", params=["cpu_shared_tensor", "cpu_shared_replicated", "cuda_deviceless_shared_tensor"])
def compiled(request):
    shared = request.param.rsplit("_", 1)[-1]
    if request.param.startswith("cpu"):
        return _hlo(shared=shared)
    return _hlo(request.getfixturevalue("h100x8"), shared=shared)


def _allreduces(op_name, opcode, scope):
    """The all-reduce ops (sync, or the async start) whose op_name lies in `scope`."""
    return {n for n, o in op_name.items() if scope in o and opcode[n] in ("all-reduce", "all-reduce-start")}


def _in_scope(op_name, scope):
    return {n for n, o in op_name.items() if scope in o}


def attention_ar(op_name, opcode, k):
    """Layer k's attention all-reduce: inside the attention's shard_map (replicated shared experts) or
    the layout's all-reduce after it (tensor-parallel shared experts: of a + s under FarSkip)."""
    return (_allreduces(op_name, opcode, f"layer_{k}/attention/shard_map/attention_allreduce")
            | _allreduces(op_name, opcode, f"layer_{k}/shard_map/attention_allreduce"))


def routed_ar(op_name, opcode, k):
    """Layer k's routed all-reduce (under standard with tensor-parallel shared experts: of s + r)."""
    return _allreduces(op_name, opcode, f"layer_{k}/moe/shard_map/routed_allreduce")


@pytest.mark.parametrize("preset", ["standard", "farskip"])
def test_one_attention_and_one_routed_allreduce_per_layer(compiled, preset):
    """Separate collectives (the layout's compile options keep XLA from combining them)."""
    _, op_name, opcode = compiled[preset]
    for k in range(HLO_LAYERS):
        assert len(attention_ar(op_name, opcode, k)) == 1, k
        assert len(routed_ar(op_name, opcode, k)) == 1, k
    every = {n for n in opcode if opcode[n] in ("all-reduce", "all-reduce-start")}
    # + the embedding lookup's all-reduce (vocab split over tensor); no all-to-all anywhere
    assert len(every) == 2 * HLO_LAYERS + 1, sorted(op_name[n] for n in every)
    assert not any("all-to-all" in c for c in opcode.values())


@pytest.mark.parametrize("preset,independent", [("farskip", True), ("standard", False)])
def test_moe_does_not_wait_for_attention_allreduce(compiled, preset, independent):
    users, op_name, opcode = compiled[preset]
    for k in range(HLO_LAYERS):
        moe_k = _in_scope(op_name, f"layer_{k}/moe/")
        assert moe_k and routed_ar(op_name, opcode, k) <= moe_k
        waiting = moe_k & reachable_from(users, attention_ar(op_name, opcode, k))
        assert (not waiting) == independent, (k, sorted(op_name[n] for n in waiting)[:5])


@pytest.mark.parametrize("preset,independent", [("farskip", True), ("standard", False)])
def test_next_attention_does_not_wait_for_routed_allreduce(compiled, preset, independent):
    users, op_name, opcode = compiled[preset]
    for k in range(HLO_LAYERS - 1):
        attn_next = _in_scope(op_name, f"layer_{k + 1}/attention/")  # its heads (and all-reduce if inside)
        assert attn_next
        waiting = attn_next & reachable_from(users, routed_ar(op_name, opcode, k))
        assert (not waiting) == independent, (k, sorted(op_name[n] for n in waiting)[:5])


def test_next_attention_waits_for_attention_allreduce(compiled):
    """What FarSkip keeps: attention k+1 reads N_k, which holds a_k (so the check sees real paths)."""
    users, op_name, opcode = compiled["farskip"]
    for k in range(HLO_LAYERS - 1):
        assert _in_scope(op_name, f"layer_{k + 1}/attention/") & reachable_from(users, attention_ar(op_name, opcode, k))
        assert _in_scope(op_name, f"layer_{k + 1}/moe/") & reachable_from(users, routed_ar(op_name, opcode, k))


def test_shared_experts_get_their_own_allreduce_where_nothing_can_carry_them():
    """FarSkip on the last layer only: layers 0 and 1 are standard (MoE reads R + a), but attention of
    layer 2 reads N_1 = R_1 - r_1, so s_1 cannot travel with r_1: layers 0 and 1 all-reduce a, s, r
    separately, layer 2 a + s and r (module doc of parallel/tp_ep.TpEpStep)."""
    cfg = tiny_cfg(num_layers=HLO_LAYERS, first_k_dense=0)
    mesh = make_mesh(cfg.mesh)
    layout = TpEpLayout(mesh, shared="tensor")
    graphdef, state = abstract_inference_model(cfg, mesh)
    tokens = jax.ShapeDtypeStruct((2, 8), np.int32, sharding=layout.batch_sharding(2))
    fs = FarSkipConfig(preset="farskip", layers="last:1")
    fn = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t, farskip=fs).logits)
    _, op_name, opcode = entry_graph(fn.lower(state, tokens).compile(compiler_options=layout.compiler_options()).as_text())
    own = [_allreduces(op_name, opcode, f"layer_{k}/moe/shard_map/shared_allreduce") for k in range(HLO_LAYERS)]
    assert [len(x) for x in own] == [1, 1, 0]
    assert [len(attention_ar(op_name, opcode, k)) for k in range(HLO_LAYERS)] == [1] * HLO_LAYERS
    every = {n for n in opcode if opcode[n] in ("all-reduce", "all-reduce-start")}
    assert len(every) == 3 + 3 + 2 + 1, sorted(op_name[n] for n in every)

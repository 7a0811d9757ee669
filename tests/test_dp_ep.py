"""The dp_ep serving layout (serving/dp_ep.py, parallel/dp_ep.py): SGLang's large-scale EP layout.

Values: KV-cache generation (ragged prompts; prefill and decode) on 4 and 8 CPU devices equals the
one-device model's generation (fp32 logits within 1e-5 of their scale, the same tokens), under
standard, FarSkip, two-batch overlap (runtime.micro_batches=2) and FarSkip + TBO; GQA and MLA; unrolled
and stacked layers.

Program: the compiled decode step (8 devices) has each MoE layer's dispatch and combine all-to-alls,
no collective in attention or the shared experts, and under FarSkip no path from the combine of
layer k to the attention of layer k+1; under standard that path exists (the positive control: the
check can fail).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from farskip_jax.config import Config, FarSkipConfig, InferenceConfig, MeshConfig, ModelConfig, MoEConfig, RuntimeConfig, replace
from farskip_jax.errors import ConfigError
from farskip_jax.parallel.mesh import make_mesh
from farskip_jax.serving.dp_ep import check_dp_ep, dp_ep_model, layout_of
from farskip_jax.serving.generate import generate, init_cache, make_decode_fn
from farskip_jax.serving.programs import serving_model
from test_inference_layout import assert_close, reference
from test_parallel_overlap import entry_graph, reachable_from

LAYERS = 3  # layer 0 dense, layers 1-2 MoE
PROMPTS = [[5, 9, 3, 7, 1, 2, 8], [4, 8], [10, 11, 12, 13, 14], [3, 3, 3]]
A2A = ("all-to-all", "all-to-all-start")


MLA = dict(attention="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)


def dp_ep_cfg(ep: int, micro_batches: int = 1, scan_layers: bool = False, **model_kw) -> Config:
    m = ModelConfig(**{**dict(vocab_size=64, d_model=32, num_layers=LAYERS, num_heads=4, num_kv_heads=2, mlp_hidden=64,
                              first_k_dense=1, max_seq_len=128), **model_kw})
    moe = MoEConfig(num_experts=8, top_k=2, expert_hidden=16, num_shared_experts=1)
    rt = RuntimeConfig(attention_impl="naive", micro_batches=micro_batches, scan_layers=scan_layers, dispatch="all_to_all")
    return Config(model=m, moe=moe, runtime=rt, mesh=MeshConfig(data=1, expert=ep),
                  inference=InferenceConfig(layout="dp_ep"))


# every variant once, each device count twice: (devices, preset, micro-batches, stacked layers: the
# decode step scans the stacked cache, each layer's row read and written around the per-device attention;
# model keys: GQA, or MLA with its decompressed cache)
CASES = {"ep4_standard": (4, "standard", 1, False, {}), "ep4_farskip_tbo_mla": (4, "farskip", 2, False, MLA),
         "ep8_farskip_scanned": (8, "farskip", 1, True, {}), "ep8_standard_tbo": (8, "standard", 2, False, {})}


@pytest.mark.parametrize("case", list(CASES))
def test_generation_equals_one_device(case):
    ep, preset, mb, scan, model_kw = CASES[case]
    cfg = dp_ep_cfg(ep, mb, scan, **model_kw)
    ref = reference(cfg)  # one device, the plain local MoE (the same config: its micro-batches too)
    mesh = make_mesh(cfg.mesh, jax.devices()[:ep])
    model, layout = serving_model(cfg, None, nnx.state(ref), mesh)  # what eval.py --mode generate runs
    prompts = PROMPTS * (ep * mb // len(PROMPTS))  # every device its rows (per micro-batch)
    fs = FarSkipConfig(preset=preset)
    got = generate(model, prompts, 4, farskip=fs, layout=layout)
    want = generate(ref, prompts, 4, farskip=fs)
    assert_close(got.logits, want.logits)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    assert model.scanned == scan
    leaves = {"/".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(nnx.state(model))}
    assert all("expert" in a.sharding.spec for k, a in leaves.items() if "w_gate" in k)  # experts over `expert`
    assert all(a.sharding.is_fully_replicated for k, a in leaves.items() if "o_proj" in k)  # attention whole


@pytest.fixture(scope="module")
def decode_graphs():
    """{preset: entry graph of the compiled decode step on 8 devices} (8 rows, one per device)."""
    cfg = dp_ep_cfg(8)
    mesh = make_mesh(cfg.mesh)
    layout = layout_of(cfg, mesh)
    model = dp_ep_model(cfg, mesh, nnx.state(reference(cfg)))
    graphdef, state = nnx.split(model)
    cache = init_cache(model, 8, 16, layout)
    args = (state, jax.device_put(jnp.zeros((8, 1), jnp.int32), layout.batch_sharding(2)), jnp.int32(3), cache,
            jax.device_put(jnp.zeros((8,), jnp.int32), layout.batch_sharding(1)))
    out = {}
    for preset in ("standard", "farskip"):
        fn = make_decode_fn(graphdef, FarSkipConfig(preset=preset), layout)
        out[preset] = entry_graph(fn.lower(*args).compile().as_text())
    return out


def _ops(op_name, opcode, scope, kinds=None):
    return {n for n, o in op_name.items() if scope in o and (kinds is None or opcode[n] in kinds)}


@pytest.mark.parametrize("preset", ["standard", "farskip"])
def test_decode_step_has_the_all_to_alls_and_no_other_collective(decode_graphs, preset):
    users, op_name, opcode = decode_graphs[preset]
    for k in (1, 2):
        assert _ops(op_name, opcode, f"layer_{k}/moe/shard_map/dispatch", A2A), k
        assert _ops(op_name, opcode, f"layer_{k}/moe/shard_map/combine", A2A), k
    colls = {n for n in opcode if opcode[n].startswith(("all-reduce", "all-gather", "reduce-scatter",
                                                        "collective-permute"))}
    # the only others: the dispatch's dropped-row count (a scalar psum inside the MoE) per MoE layer
    assert all("/moe/" in op_name[n] for n in colls), sorted(op_name[n] for n in colls)


def test_farskip_attention_never_waits_for_the_previous_combine(decode_graphs):
    users, op_name, opcode = decode_graphs["farskip"]
    combine = _ops(op_name, opcode, "layer_1/moe/shard_map/combine", A2A)
    attn_next = _ops(op_name, opcode, "layer_2/attention")
    assert combine and attn_next
    assert not attn_next & reachable_from(users, combine)


def test_positive_control_standard_attention_waits_for_the_combine(decode_graphs):
    users, op_name, opcode = decode_graphs["standard"]
    combine = _ops(op_name, opcode, "layer_1/moe/shard_map/combine", A2A)
    attn_next = _ops(op_name, opcode, "layer_2/attention")
    assert attn_next & reachable_from(users, combine)


def test_bad_layouts_are_refused_with_one_clear_error():
    with pytest.raises(ConfigError, match="mesh.tensor=1"):
        check_dp_ep(replace(dp_ep_cfg(4), **{"mesh.tensor": 2, "mesh.expert": 2}))
    with pytest.raises(ConfigError, match="inference.layout=foe"):
        check_dp_ep(replace(dp_ep_cfg(4), **{"runtime.num_groups": 2}))
    cfg = dp_ep_cfg(4)
    mesh = make_mesh(cfg.mesh, jax.devices()[:4])
    model = dp_ep_model(cfg, mesh, nnx.state(reference(cfg)))
    with pytest.raises(ConfigError, match="multiple of 4 prompts"):
        generate(model, PROMPTS[:3], 2, layout=layout_of(cfg, mesh))


def test_study_rows_extrapolate_and_divide_by_hand():
    """analysis/dp_ep_report.point_rows on made-up timings: linear in the layer count from two depths,
    every row over the no-overlap standard, the range over the constant sets, the dominant constant."""
    from farskip_jax.analysis.dp_ep_report import point_rows

    def t(time_us, serial_us):
        return dict(time_us=time_us, serial_us=serial_us, compute_us=0.0, a2a_us=serial_us / 2, a2a_hidden_us=0.0)

    # standard: 10 + 5 per layer serial; TBO: 8 + 4 per layer; "contention:high" slows TBO by 2 per layer
    pt = {"variants": {
        "standard": {"2": {"central": t(15, 20), "contention:high": t(15, 20)},
                     "3": {"central": t(20, 25), "contention:high": t(20, 25)}},
        "standard_tbo": {"2": {"central": t(16, 16), "contention:high": t(20, 20)},
                         "3": {"central": t(20, 20), "contention:high": t(26, 26)}}}}
    rows = point_rows(pt, [2, 3], 11)  # standard serial at 11 layers: 20 + 9 x 5 = 65; TBO 16 + 9 x 4 = 52
    assert rows["standard_tbo"]["central"] == pytest.approx(65 / 52)
    assert rows["standard_tbo"]["low"] == pytest.approx(65 / (20 + 9 * 6))
    assert rows["standard_tbo"]["dominant"] == "contention"
    assert rows["standard"]["central"] == pytest.approx(65 / 60)
    assert rows["_standard"]["a2a_share"] == pytest.approx(0.5)


@pytest.mark.extended
def test_eval_generate_on_dp_ep_from_an_hf_folder(tmp_path, capsys):
    """eval.py --hf DIR --mode generate with 8 prompts on data 4 x expert 2 CPU devices, stacked layers,
    the folder's FarSkip connectivity = one-device generation of the same folder (the CLI's plumbing;
    the default run checks the layout's generation itself)."""
    import json

    import eval as eval_entry
    from farskip_jax.convert import export_hf, import_hf
    from farskip_jax.data.tokenizer import ByteTokenizer
    from test_inference_layout import tiny_cfg

    cfg = replace(tiny_cfg(), **{"model.vocab_size": 320, "moe.num_shared_experts": 0, "model.qk_norm": True,
                                 "model.first_k_dense": 0, "inference.layout": "training", "farskip.preset": "farskip"})
    out = export_hf(reference(cfg), cfg, str(tmp_path / "hf"), family="qwen3_moe")
    prompts = ["def main(", "import os", "x = 1", "class A:", "for i in", "while True", "print(", "y"]
    argv = (["--hf", out, "--tokenizer", "byte", "--mode", "generate"] + sum((["--prompt", p] for p in prompts), [])
            + ["eval.max_new_tokens=3", "inference.layout=dp_ep", "mesh.data=4", "mesh.tensor=1", "mesh.expert=2",
               "runtime.dispatch=all_to_all", "runtime.scan_layers=true"])
    assert eval_entry.main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    tok = ByteTokenizer()
    icfg, imported = import_hf(out, overrides=["runtime.scan_layers=false"])
    g = generate(imported, [[tok.bos_id] + list(tok.encode(p)) for p in prompts], 3, farskip=icfg.farskip,
                 eos_id=tok.eos_id)
    assert res["layout"] == "dp_ep"
    assert res["completions"] == [tok.decode(g.completion(i)) for i in range(len(prompts))]

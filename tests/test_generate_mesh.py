"""Serving-shaped generation (serving/generate.py, serving/programs.py): requests of different lengths in one
batch, KV-cache prefill + decode, greedy and sampling, on one device and on the tp_ep mesh.

Oracle: the one-device full forward of each row's OWN tokens (no cache, no left padding; rows
right-padded to one length, which a causal model cannot see), under the same connectivity. The
cached logits must equal it (fp32, 1e-5 of the logits' scale) and greedy tokens must be its argmax.
"""

import json
import os

import numpy as np
import pytest
from flax import nnx

from farskip_jax.config import FarSkipConfig, MeshConfig, replace
from farskip_jax.errors import BackendError, ConfigError
from farskip_jax.serving.generate import generate, make_decode_fn, pad_prompts
from farskip_jax.serving.programs import decode_program, prefill_program
from farskip_jax.serving.tp_ep import TpEpLayout, inference_model
from farskip_jax.parallel.mesh import make_mesh
from test_inference_layout import assert_close, reference, tiny_cfg

PROMPTS = [[5, 9, 3, 7, 1, 2, 8], [4, 8], [10, 11, 12, 13, 14]]
NEW = 4


def row_oracle(model, out, fs):
    """Per row: logits of the full forward over its own prompt + generated tokens at the positions
    that produced each new token -> [b, NEW, V]."""
    seqs = [np.concatenate([p, out.completion(i)[:-1]]) for i, p in enumerate(PROMPTS)]
    n = max(len(s) for s in seqs)
    batch = np.zeros((len(seqs), n), np.int32)
    for i, s in enumerate(seqs):
        batch[i, :len(s)] = s  # right-padded: invisible to earlier positions
    full = np.asarray(nnx.jit(lambda m, t: m(t, farskip=fs).logits)(model, batch))
    return np.stack([full[i, len(p) - 1:len(p) - 1 + NEW] for i, p in enumerate(PROMPTS)])


def check_greedy(out, want):
    assert_close(out.logits, want)
    np.testing.assert_array_equal(np.stack([out.completion(i) for i in range(len(PROMPTS))]), want.argmax(-1))


def test_pad_prompts_left_pads_and_rejects_empty():
    toks, pad = pad_prompts(PROMPTS, pad_id=0)
    assert toks.shape == (3, 7) and pad.tolist() == [0, 5, 2]
    np.testing.assert_array_equal(toks[1], [0, 0, 0, 0, 0, 4, 8])
    with pytest.raises(ConfigError, match="empty prompt"):
        pad_prompts([[1, 2], []])


@pytest.mark.parametrize("preset", ["farskip"])  # standard: the mesh cases below and test_eval_generate.py
def test_ragged_batch_one_device_equals_each_rows_full_forward(preset):
    cfg = tiny_cfg()
    ref = reference(cfg)
    fs = FarSkipConfig(preset=preset)
    fn = make_decode_fn(nnx.split(ref)[0], fs)
    out = generate(ref, PROMPTS, NEW, farskip=fs, pad_id=63, decode_fn=fn)
    check_greedy(out, row_oracle(ref, out, fs))
    assert out.lengths.tolist() == [7, 2, 5]
    # the padding really is masked: another pad id gives the same logits
    other = generate(ref, PROMPTS, NEW, farskip=fs, pad_id=1, decode_fn=fn)
    assert_close(other.logits, out.logits)


CASES = {  # mesh, model keys, connectivity
    "gqa_tp8_standard": (MeshConfig(data=1, tensor=8), dict(num_kv_heads=8), "standard"),
    "gqa_kv_replicated_ep2_tp4_farskip": (MeshConfig(data=1, expert=2, tensor=4), dict(num_kv_heads=2), "farskip"),
    "mla_tp8_farskip": (MeshConfig(data=1, tensor=8),
                        dict(attention="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                             attention_bias=True), "farskip"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_mesh_kv_cache_decode_equals_one_device_full_forward(case):
    mesh_cfg, model_kw, preset = CASES[case]
    cfg = tiny_cfg(mesh_cfg, **model_kw)
    ref = reference(cfg)
    layout = TpEpLayout(make_mesh(cfg.mesh))
    model = inference_model(cfg, layout.mesh, nnx.state(ref))
    fs = FarSkipConfig(preset=preset)
    out = generate(model, PROMPTS, NEW, farskip=fs, layout=layout)
    check_greedy(out, row_oracle(ref, out, fs))
    assert model.layers[1].attn.o_proj.w[...].sharding.spec[0] == "tensor"
    if preset == "farskip":  # the connectivity matters for these weights (the oracle would notice a mix-up)
        std = row_oracle(ref, out, FarSkipConfig())
        assert np.abs(std - out.logits).max() > 1e-3


def test_mesh_sampling_is_reproducible_and_equals_one_device():
    cfg = tiny_cfg(MeshConfig(data=1, tensor=8))
    ref = reference(cfg)
    layout = TpEpLayout(make_mesh(cfg.mesh))
    model = inference_model(cfg, layout.mesh, nnx.state(ref))
    fs = FarSkipConfig(preset="farskip")
    mesh_fn = make_decode_fn(nnx.split(model)[0], fs, layout)
    one_fn = make_decode_fn(nnx.split(ref)[0], fs)
    kw = dict(farskip=fs, temperature=1.5, top_p=0.95)
    a = generate(model, PROMPTS, 6, seed=7, layout=layout, decode_fn=mesh_fn, **kw)
    b = generate(model, PROMPTS, 6, seed=7, layout=layout, decode_fn=mesh_fn, **kw)
    c = generate(ref, PROMPTS, 6, seed=7, decode_fn=one_fn, **kw)
    d = generate(model, PROMPTS, 6, seed=8, layout=layout, decode_fn=mesh_fn, **kw)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.tokens, c.tokens)  # same seed, one device: same draws
    assert_close(a.logits, c.logits)
    assert (a.tokens != d.tokens).any()  # the seed matters
    assert (a.tokens[:, -6:] != a.logits.argmax(-1)).any()  # it is not greedy


def test_serving_programs_lower_for_gpu_deviceless():
    """decode / prefill of the tp_ep layout compile for 8 x H100 with no GPU (what the overlap
    analysis needs): one attention and one routed all-reduce per layer, no all-to-all, and under
    FarSkip the independences of tests/test_inference_layout.py (whose standard control shows the
    check can fail) hold in the serving programs too."""
    deviceless = pytest.importorskip("farskip_jax.analysis.deviceless")
    try:
        devices = deviceless.gpu_devices("h100_sxm", 8)
    except BackendError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(e))
    from test_inference_layout import attention_ar, routed_ar
    from test_parallel_overlap import entry_graph, reachable_from

    layers = 3
    cfg = replace(tiny_cfg(num_layers=layers, first_k_dense=0), **{"farskip.preset": "farskip"})
    mesh = make_mesh(cfg.mesh, devices)
    for fn, args in (decode_program(cfg, mesh, batch=4, max_len=32),
                     prefill_program(cfg, mesh, batch=4, prompt_len=16, max_len=32)):
        text = fn.lower(*args).compile(compiler_options=dict(deviceless.LHS_FLAGS)).as_text()
        users, op_name, opcode = entry_graph(text)
        assert "all-to-all" not in text
        for k in range(layers):
            assert len(attention_ar(op_name, opcode, k)) == 1 and len(routed_ar(op_name, opcode, k)) == 1, k
            moe_k = {n for n, o in op_name.items() if f"layer_{k}/moe/" in o}
            assert not moe_k & reachable_from(users, attention_ar(op_name, opcode, k))
            if k + 1 < layers:
                attn_next = {n for n, o in op_name.items() if f"layer_{k + 1}/attention/" in o}
                assert attn_next and not attn_next & reachable_from(users, routed_ar(op_name, opcode, k))


def test_eval_generate_on_a_mesh_from_an_hf_folder(tmp_path, capsys):
    """eval.py --hf DIR --mode generate with two prompts on the tp_ep mesh, the layers imported stacked
    (runtime.scan_layers=true: the scanned decode of serving/generate.py) = one-device generation of the
    same folder imported per layer (the unrolled decode)."""
    import eval as eval_entry
    from farskip_jax.convert import export_hf, import_hf
    from farskip_jax.data.tokenizer import ByteTokenizer

    cfg = replace(tiny_cfg(), **{"model.vocab_size": 320, "moe.num_shared_experts": 0, "model.qk_norm": True,
                                 "model.first_k_dense": 0, "inference.layout": "training", "farskip.preset": "farskip"})
    ref = reference(cfg)
    out = export_hf(ref, cfg, str(tmp_path / "hf"), family="qwen3_moe")
    prompts = ["def main(", "import os"]
    argv = ["--hf", out, "--tokenizer", "byte", "--mode", "generate", "--prompt", prompts[0], "--prompt", prompts[1],
            "eval.max_new_tokens=3", "inference.layout=tp_ep", "mesh.data=1",
            "mesh.tensor=8", "runtime.scan_layers=true"]
    assert eval_entry.main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    tok = ByteTokenizer()
    ids = [[tok.bos_id] + list(tok.encode(p)) for p in prompts]
    icfg, imported = import_hf(out, overrides=["runtime.scan_layers=false"])  # the folder carries FarSkip connectivity
    assert hasattr(imported, "layers")
    assert icfg.farskip.converted_layers(2) == {0, 1} and res["farskip"]["preset"] == "farskip"
    g = generate(imported, ids, 3, farskip=icfg.farskip, eos_id=tok.eos_id)
    assert res["layout"] == "tp_ep" and res["prompts"] == prompts
    assert res["completions"] == [tok.decode(g.completion(i)) for i in range(2)]

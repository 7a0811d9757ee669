"""The FarSkip-native (Instella-MoE style) DeepSeek-V3 layout: `"farskip": true` + start/end layer
indices + gated MLA output in config.json; imported, and exported (`family="instella_moe"`: the
layout Instella-MoE ships, `architectures: [InstellaMoEForCausalLM]`, model_type deepseek_v3), with
a warning where the native keys cannot express a student's connectivity.

Oracle: the HF DeepSeek-V3 modules of transformers, driven layer by layer in the dataflow of the
public Instella-MoE decoder layer (a (residual, residual_no_routed) pair between layers; attention
reads the no-routed stream, the MoE reads the residual before attention), with the attention output
gated by sigmoid(gate_proj(x)) before o_proj. The oracle with FarSkip off is first checked against
HF's own forward, so it is anchored to transformers.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import torch  # the hf extra: CI installs it, these tests never skip
import transformers

import jax.numpy as jnp  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from farskip_jax.config import FarSkipConfig  # noqa: E402
from farskip_jax.convert import export_hf, import_hf  # noqa: E402

VOCAB, LAYERS, START, END = 128, 4, 1, 3


class GatedOut(torch.nn.Module):
    """o_proj(a * sigmoid(gate(x))) where x is the attention input set before each call."""

    def __init__(self, o_proj, gate):
        super().__init__()
        self.o, self.gate, self.x = o_proj, gate, None

    def forward(self, a):
        return self.o(a * torch.sigmoid(self.gate(self.x)))


def oracle(model, tokens, farskip: bool, flags: dict, gated: bool, start: int = START, end: int = END) -> np.ndarray:
    """Instella-MoE FarSkipDecoderLayer dataflow over HF DeepSeek-V3 modules (FarSkip on layers start..end)."""
    m = model.model
    ids = torch.tensor(tokens)
    pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    with torch.no_grad():
        h = m.embed_tokens(ids)
        pe = m.rotary_emb(h, pos)
        for i, layer in enumerate(m.layers):
            fs = farskip and start <= i <= end
            if fs:
                if isinstance(h, tuple):
                    residual, x_attn, x_mlp = h[0], h[1], h[0]
                else:
                    residual = x_attn = x_mlp = h
                if flags.get("attn_only"):
                    x_mlp = None
                if flags.get("mlp_only"):
                    x_attn = residual
            else:
                residual = h[0] if isinstance(h, tuple) else h
                x_attn, x_mlp = residual, None
            xa = layer.input_layernorm(x_attn)
            if gated:
                layer.self_attn.o_proj.x = xa
            a, _ = layer.self_attn(hidden_states=xa, position_embeddings=pe, attention_mask=None)
            residual = residual + a
            xm = layer.post_attention_layernorm(residual if x_mlp is None else x_mlp)
            if hasattr(layer.mlp, "shared_experts"):
                out = layer.mlp(xm)
                shared = layer.mlp.shared_experts(xm)
                h = (residual + out, residual + shared)
            else:
                h = residual + layer.mlp(xm)
        h = h[0] if isinstance(h, tuple) else h
        return model.lm_head(m.norm(h)).numpy()


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """(HF DeepSeek-V3 model with gates attached, FarSkip-native folder)."""
    T = transformers
    torch.manual_seed(0)
    cfg = T.DeepseekV3Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
                             num_key_value_heads=4, intermediate_size=48, initializer_range=0.2, n_routed_experts=8,
                             num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1,
                             kv_lora_rank=16, q_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
                             n_group=2, topk_group=1)
    model = T.AutoModelForCausalLM.from_config(cfg).eval()
    path = str(tmp_path_factory.mktemp("instella") / "hf")
    model.save_pretrained(path)
    tokens = np.random.RandomState(1).randint(0, VOCAB, size=(2, 16))
    plain = oracle(model, tokens, farskip=False, flags={}, gated=False)
    with torch.no_grad():
        hf = model(torch.tensor(tokens)).logits.numpy()
    assert np.abs(plain - hf).max() < 1e-5, "the oracle's standard dataflow must equal HF's forward"
    # add the gated-attention weights and the FarSkip keys
    tensors = load_file(os.path.join(path, "model.safetensors"))
    for i, layer in enumerate(model.model.layers):
        gate = torch.nn.Linear(32, 4 * 8, bias=False)
        torch.nn.init.normal_(gate.weight, std=0.3)
        layer.self_attn.o_proj = GatedOut(layer.self_attn.o_proj, gate)
        tensors[f"model.layers.{i}.self_attn.gate_proj.weight"] = gate.weight.detach().clone()
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    c.update(farskip=True, farskip_start_idx=START, farskip_end_idx=END, gated_attention=True,
             architectures=["InstellaMoEForCausalLM"])
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f)
    return model, path, tokens


def _logits(model, tokens, farskip=None):
    return np.asarray(model(jnp.asarray(tokens), farskip=farskip).logits)


def test_imports_with_farskip_on_and_matches_instella_dataflow(native):
    hf, path, tokens = native
    cfg, model = import_hf(path)
    assert cfg.farskip.preset == "farskip" and set(cfg.farskip.converted_layers(LAYERS)) == {1, 2, 3}
    assert cfg.model.gated_attention
    fs = _logits(model, tokens)  # default connectivity = the config's (farskip)
    ref_fs = oracle(hf, tokens, farskip=True, flags={}, gated=True)
    std = _logits(model, tokens, farskip=FarSkipConfig())
    ref_std = oracle(hf, tokens, farskip=False, flags={}, gated=True)
    d_fs, d_std = np.abs(fs - ref_fs).max(), np.abs(std - ref_std).max()
    print(f"\nfarskip-native: farskip max diff {d_fs:.2e}, standard max diff {d_std:.2e}, "
          f"standard vs farskip {np.abs(fs - std).max():.2f}")
    assert d_fs <= 1e-4 and d_std <= 1e-4
    assert np.abs(fs - std).max() > 1e-2  # the connectivity changes the function


@pytest.mark.parametrize("flag,preset", [("attn_only_farskip", "attn_only"), ("mlp_only_farskip", "mlp_only")])
def test_single_subblock_flags(native, tmp_path, flag, preset):
    hf, path, tokens = native
    import shutil

    alt = str(tmp_path / "alt")
    shutil.copytree(path, alt)
    with open(os.path.join(alt, "config.json")) as f:
        c = json.load(f)
    c[flag] = True
    with open(os.path.join(alt, "config.json"), "w") as f:
        json.dump(c, f)
    cfg, model = import_hf(alt)
    assert cfg.farskip.preset == preset
    ref = oracle(hf, tokens, farskip=True, flags={preset: True}, gated=True)
    assert np.abs(_logits(model, tokens) - ref).max() <= 1e-4


def test_export_keeps_farskip_settings(native, tmp_path):
    hf, path, tokens = native
    cfg, model = import_hf(path)
    out = export_hf(model, cfg, str(tmp_path / "out"))
    with open(os.path.join(out, "config.json")) as f:
        c = json.load(f)
    assert c["farskip"] is True and c["farskip_start_idx"] == START and c["farskip_end_idx"] == END
    assert c["gated_attention"] is True
    assert c["farskip_jax"]["preset"] == "farskip" and c["farskip_jax"]["layers"] == [1, 2, 3]
    cfg2, model2 = import_hf(out)
    assert cfg2.farskip.preset == "farskip"
    assert np.array_equal(_logits(model2, tokens), _logits(model, tokens))


def test_standard_family_exported_with_farskip_reimports_with_it(native, tmp_path):
    """A plain DeepSeek-V3 import run with FarSkip on exports its connectivity into config.json."""
    hf, path, tokens = native
    cfg, model = import_hf(path, overrides=["farskip.layers=range:2:4"])
    out = export_hf(model, cfg, str(tmp_path / "out"))
    cfg2, _ = import_hf(out)
    assert sorted(cfg2.farskip.converted_layers(LAYERS)) == [2, 3]


# ------------------------------------------------------------------------------------------------
# export in the native layout
# ------------------------------------------------------------------------------------------------

def _config(folder) -> dict:
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def test_native_export_reimports_to_the_same_logits_and_runs_as_instella(native, tmp_path):
    """Layers 2-3 converted (layer 1, an unconverted MoE layer, feeds the first converted one its
    no-routed stream): the exported keys alone give the connectivity back, and the Instella dataflow
    over the HF modules computes the same function."""
    hf, path, tokens = native
    cfg, model = import_hf(path, overrides=["farskip.layers=range:2:4"])
    notes: list = []
    out = export_hf(model, cfg, str(tmp_path / "native"), family="instella_moe", report=notes.append)
    c = _config(out)
    assert c["architectures"] == ["InstellaMoEForCausalLM"] and c["model_type"] == "deepseek_v3"
    assert (c["farskip"], c["farskip_start_idx"], c["farskip_end_idx"]) == (True, 2, 3)
    assert not c["attn_only_farskip"] and not c["mlp_only_farskip"] and c["gated_attention"] is True
    assert notes == []  # expressible: nothing to warn about
    want = _logits(model, tokens)
    cfg2, model2 = import_hf(out)
    assert cfg2.farskip.preset == "farskip" and sorted(cfg2.farskip.converted_layers(LAYERS)) == [2, 3]
    np.testing.assert_allclose(_logits(model2, tokens), want, rtol=1e-5, atol=1e-5)
    # without our "farskip_jax" section the native keys alone carry the connectivity
    c.pop("farskip_jax")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(c, f)
    cfg3, model3 = import_hf(out)
    assert cfg3.farskip.preset == "farskip" and sorted(cfg3.farskip.converted_layers(LAYERS)) == [2, 3]
    np.testing.assert_allclose(_logits(model3, tokens), want, rtol=1e-5, atol=1e-5)
    ref = oracle(hf, tokens, farskip=True, flags={}, gated=True, start=2, end=3)
    assert np.abs(want - ref).max() <= 1e-4


@pytest.mark.parametrize("overrides,flag", [(["farskip.preset=attn_only"], "attn_only_farskip"),
                                            (["farskip.preset=mlp_only"], "mlp_only_farskip")])
def test_native_export_of_single_subblock_presets(native, tmp_path, overrides, flag):
    _, path, tokens = native
    cfg, model = import_hf(path, overrides=overrides)
    notes: list = []
    c = _config(export_hf(model, cfg, str(tmp_path / "out"), family="instella_moe", report=notes.append))
    assert c["farskip"] is True and c[flag] is True and notes == []


@pytest.mark.parametrize("overrides,why", [
    (["farskip.layers=[1, 3]"], r"converted layers \[1, 3\] are not one contiguous range"),
    (["farskip.attn_input=outdated"], r"attn/moe inputs \[\('outdated', 'outdated'\)\]"),
    (["farskip.skip_distance=2"], r"farskip\.skip_distance=2"),
])
def test_native_export_warns_what_the_native_keys_cannot_express(native, tmp_path, overrides, why):
    import re

    _, path, tokens = native
    cfg, model = import_hf(path, overrides=overrides)
    notes: list = []
    out = export_hf(model, cfg, str(tmp_path / "out"), family="instella_moe", report=notes.append)
    assert len(notes) == 1 and re.search("cannot express .*" + why, notes[0]) and "farskip=false" in notes[0], notes
    assert _config(out)["farskip"] is False  # engines reading the native keys run the standard model, not a wrong one
    cfg2, model2 = import_hf(out)  # farskip_jax restores the exact connectivity from "farskip_jax"
    assert cfg2.farskip == cfg.farskip
    np.testing.assert_allclose(_logits(model2, tokens), _logits(model, tokens), rtol=1e-5, atol=1e-5)


def _v3_student(**farskip):
    """A plain DeepSeek-V3-shaped model (no gated attention) under the given farskip section."""
    from flax import nnx

    from farskip_jax.config import Config, from_dict
    from farskip_jax.loading.families import family_by_name
    from farskip_jax.model import Transformer

    v3 = dict(model_type="deepseek_v3", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
              intermediate_size=48, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
              n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4,
              qk_nope_head_dim=8, v_head_dim=8)
    cfg = from_dict(Config, dict(family_by_name("deepseek_v3").config_tree(v3), farskip=farskip))
    return cfg, nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))


def test_stock_export_of_a_farskip_student_says_it_runs_standard(tmp_path):
    from flax import nnx

    cfg, model = _v3_student(preset="farskip")
    for _, v in nnx.to_flat_state(nnx.state(model)):  # values for the abstract model: nothing compiled
        v.set_value(np.zeros(v.get_value().shape, v.get_value().dtype))
    notes: list = []
    c = _config(export_hf(model, cfg, str(tmp_path / "out"), family="deepseek_v3", report=notes.append))
    assert c["architectures"] == ["DeepseekV3ForCausalLM"] and c["farskip"] is True  # the native keys ride along
    assert len(notes) == 1 and "DeepseekV3ForCausalLM (HF transformers, serving engines) runs this folder with " \
                               "standard connectivity" in notes[0] and "--family instella_moe" in notes[0]


def test_a_gated_model_cannot_be_a_stock_deepseek_v3(native):
    from farskip_jax.convert.export import hf_config_for
    from farskip_jax.errors import CheckpointError

    _, path, _ = native
    cfg, _ = import_hf(path)
    with pytest.raises(CheckpointError, match=r"'deepseek_v3' cannot hold .*gated attention True -> False.*"
                                              r"families that can: instella_moe"):
        hf_config_for(cfg, family="deepseek_v3")


def test_native_layout_refuses_a_model_it_cannot_hold():
    from farskip_jax.config import Config, from_dict
    from farskip_jax.convert.export import hf_config_for
    from farskip_jax.loading.families import family_by_name
    from farskip_jax.errors import CheckpointError

    v2 = dict(model_type="deepseek_v2", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=48, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
              n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4,
              qk_nope_head_dim=8, v_head_dim=8)
    cfg = from_dict(Config, family_by_name("deepseek_v2").config_tree(v2))
    with pytest.raises(CheckpointError, match=r"'instella_moe' cannot hold .*scoring 'softmax' -> 'sigmoid'"
                                              r".*families that can: deepseek_v2"):
        hf_config_for(cfg, family="instella_moe")


def test_cli_exports_an_import_folder_in_the_native_layout(native, tmp_path):
    import subprocess
    import sys

    from farskip_jax.convert.native import write_native_from_hf

    _, path, _ = native
    imp = str(tmp_path / "imported")
    write_native_from_hf(path, imp)
    out = str(tmp_path / "native")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "farskip_jax.convert", "export", imp, out, "--family", "instella_moe"],
                       cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr[-3000:]
    c = _config(out)
    assert c["architectures"] == ["InstellaMoEForCausalLM"] and (c["farskip_start_idx"], c["farskip_end_idx"]) == (START, END)

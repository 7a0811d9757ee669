"""The FarSkip-native (Instella-MoE style) DeepSeek-V3 layout: `"farskip": true` + start/end layer
indices + gated MLA output in config.json.

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


def oracle(model, tokens, farskip: bool, flags: dict, gated: bool) -> np.ndarray:
    """Instella-MoE FarSkipDecoderLayer dataflow over HF DeepSeek-V3 modules."""
    m = model.model
    ids = torch.tensor(tokens)
    pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    with torch.no_grad():
        h = m.embed_tokens(ids)
        pe = m.rotary_emb(h, pos)
        for i, layer in enumerate(m.layers):
            fs = farskip and START <= i <= END
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

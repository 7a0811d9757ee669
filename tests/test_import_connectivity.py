"""Export -> import keeps FarSkip: the "farskip_jax" section export_hf writes into config.json is the
connectivity import_hf / `python -m farskip_jax.convert import` / eval's load_hf restore; explicit
overrides win; the import CLI prints which connectivity it uses and where it came from.

Oracle: the exporting model's own logits under the connectivity it was exported with (same weights,
so an fp32 import must reproduce them to 1e-5), and its standard-connectivity logits for overrides.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import torch  # the hf extra: CI installs it, these tests never skip
import transformers

import jax.numpy as jnp  # noqa: E402

from farskip_jax.config import FarSkipConfig  # noqa: E402
from farskip_jax.convert import export_hf, import_hf  # noqa: E402
from farskip_jax.convert.__main__ import main as cli  # noqa: E402
from farskip_jax.convert.export import farskip_settings  # noqa: E402
from farskip_jax.errors import CheckpointError  # noqa: E402

VOCAB, LAYERS, TOL = 128, 3, 1e-5
STANDARD = FarSkipConfig()
SECTIONS = {  # the connectivity of the exported student
    "farskip_layers_1_2": ["farskip.preset=farskip", "farskip.layers=[1, 2]"],
    "attn_only_outdated_all": ["farskip.preset=attn_only", "farskip.attn_input=outdated"],
    "farskip_skip2": ["farskip.preset=farskip", "farskip.skip_distance=2"],
}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny Qwen2-MoE (shared experts, so partial != outdated) saved by transformers."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, intermediate_size=48,
                                      initializer_range=0.2, num_hidden_layers=LAYERS, num_key_value_heads=2,
                                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                      shared_expert_intermediate_size=24)
    path = tmp_path_factory.mktemp("qwen2moe") / "hf"
    transformers.AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tokens():
    return jnp.asarray(np.random.RandomState(0).randint(0, VOCAB, size=(2, 16)))


def _logits(model, tokens, farskip=None):
    return np.asarray(model(tokens, farskip=farskip).logits)


@pytest.fixture(scope="module", params=list(SECTIONS))
def exported(request, hf_dir, tokens, tmp_path_factory):
    """(exported HF folder, its "farskip_jax" section, student logits under it, standard logits)."""
    cfg, model = import_hf(hf_dir, overrides=SECTIONS[request.param])
    out = export_hf(model, cfg, str(tmp_path_factory.mktemp(request.param) / "hf"))
    with open(os.path.join(out, "config.json")) as f:
        section = json.load(f)["farskip_jax"]
    student, standard = _logits(model, tokens), _logits(model, tokens, STANDARD)
    assert np.abs(student - standard).max() > 1e-2  # the connectivity matters for these logits
    return out, section, student, standard


def test_import_restores_exported_connectivity(exported, tokens):
    out, section, student, _ = exported
    cfg, model = import_hf(out)
    assert farskip_settings(cfg) == section
    assert np.abs(_logits(model, tokens) - student).max() <= TOL  # default call = the restored connectivity


def test_eval_load_hf_restores_it(exported, tokens):
    from farskip_jax.loading.load import load_hf
    from flax import nnx

    out, section, student, _ = exported
    cfg, gd, st = load_hf(out)
    assert farskip_settings(cfg) == section
    model = nnx.merge(gd, st["params"], st["bias"], st["rest"])
    assert np.abs(_logits(model, tokens, cfg.farskip) - student).max() <= TOL


def test_explicit_override_wins(exported, tokens):
    out, section, _, standard = exported
    cfg, model = import_hf(out, overrides=["farskip.preset=standard"])
    assert all(cfg.farskip.layer_inputs(i, LAYERS) == ("full", "full") for i in range(LAYERS))
    assert np.abs(_logits(model, tokens) - standard).max() <= TOL
    cfg, _ = import_hf(out, overrides={"farskip.layers": [2]})  # other keys keep the exported values
    assert cfg.farskip.layers == (2,) and cfg.farskip.preset == section["preset"]
    assert cfg.farskip.skip_distance == section["skip_distance"]


def test_preset_override_on_a_standard_export_converts_the_default_layers(hf_dir, tokens, tmp_path):
    cfg, model = import_hf(hf_dir)
    out = export_hf(model, cfg, str(tmp_path / "standard_export"))
    back, _ = import_hf(out, overrides=["farskip.preset=farskip"])
    assert [back.farskip.layer_inputs(i, LAYERS) for i in range(LAYERS)] == [("partial", "outdated")] * LAYERS
    want = _logits(model, tokens, FarSkipConfig(preset="farskip"))
    fresh, fmodel = import_hf(hf_dir, overrides=["farskip.preset=farskip"])
    assert np.abs(_logits(fmodel, tokens) - want).max() <= TOL
    _, bmodel = import_hf(out, overrides=["farskip.preset=farskip"])
    assert np.abs(_logits(bmodel, tokens) - want).max() <= TOL


def test_cli_import_prints_connectivity_and_source(exported, hf_dir, tokens, tmp_path, capsys):
    out, section, student, standard = exported
    assert cli(["import", out, str(tmp_path / "a")]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("connectivity:")]
    assert len(lines) == 1 and lines[0].endswith('; source: exported config.json ("farskip_jax")')
    assert f"{section['preset']} on " in lines[0] and f"skip distance {section['skip_distance']}" in lines[0]
    from farskip_jax.loading.native import load_native

    cfg, model, _ = load_native(str(tmp_path / "a"))
    assert farskip_settings(cfg) == section
    assert np.abs(_logits(model, tokens) - student).max() <= TOL

    assert cli(["import", out, str(tmp_path / "b"), "farskip.preset=standard"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("connectivity:")]
    assert lines == ['connectivity: standard (every layer reads the full stream); '
                     'source: override over the exported config.json ("farskip_jax")']
    cfg, model, _ = load_native(str(tmp_path / "b"))
    assert np.abs(_logits(model, tokens) - standard).max() <= TOL


def test_cli_names_family_default_and_plain_override(hf_dir, tmp_path, capsys):
    assert cli(["import", hf_dir, str(tmp_path / "a")]) == 0
    assert "connectivity: standard (every layer reads the full stream); source: family default" in capsys.readouterr().out
    assert cli(["import", hf_dir, str(tmp_path / "b"), "farskip.preset=farskip", "farskip.layers=last:1"]) == 0
    assert ("connectivity: farskip on layers [2] (attn partial / moe outdated, skip distance 1); source: override"
            in capsys.readouterr().out)


def test_export_line_lists_the_exact_section(exported):
    """The line spells out layers and inputs of the restored section (first case checked exactly)."""
    out, section, _, _ = exported
    from farskip_jax.loading.connectivity import describe, ORIGIN_EXPORTED

    cfg, _ = import_hf(out)
    line = describe(cfg, ORIGIN_EXPORTED)
    if section["layers"] == [1, 2]:
        assert line == ('connectivity: farskip on layers [1, 2] (attn partial / moe outdated, skip distance 1); '
                        'source: exported config.json ("farskip_jax")')
    elif section["attn_input"] == "outdated":
        assert f"attn_only on all {LAYERS} layers (attn outdated / moe full, skip distance 1)" in line


@pytest.mark.parametrize("bad, needle", [("farskip", "must be a mapping"),
                                         ({"preset": "farskip", "layer": [1]}, "unknown key(s) ['layer']")])
def test_malformed_exported_section_names_the_key(hf_dir, tmp_path, bad, needle):
    import shutil

    p = str(tmp_path / "hf")
    shutil.copytree(hf_dir, p)
    with open(os.path.join(p, "config.json")) as f:
        c = json.load(f)
    c["farskip_jax"] = bad
    with open(os.path.join(p, "config.json"), "w") as f:
        json.dump(c, f)
    with pytest.raises(CheckpointError, match="farskip_jax") as e:
        import_hf(p)
    assert needle in str(e.value)


def _deepseek_v3_dir(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, intermediate_size=48,
                                        initializer_range=0.2, num_hidden_layers=LAYERS, num_key_value_heads=4,
                                        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=12,
                                        qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, n_group=2, topk_group=1)
    path = tmp_path / "dsv3"
    transformers.AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_transformers_runs_the_export_standard_farskip_jax_restores_farskip(family, hf_dir, tokens, tmp_path):
    """docs/fcsd.md's table: stock transformers loads an exported FarSkip student (a stock family, or a
    DeepSeek-V3 layout carrying the Instella keys) with standard connectivity; our import restores FarSkip."""
    src = hf_dir if family == "qwen2_moe" else _deepseek_v3_dir(tmp_path)
    cfg, model = import_hf(src, overrides=["farskip.preset=farskip", "farskip.layers=range:1:3"])
    out = export_hf(model, cfg, str(tmp_path / "export"))
    with open(os.path.join(out, "config.json")) as f:
        c = json.load(f)
    assert c["farskip_jax"]["layers"] == [1, 2]
    if family == "deepseek_v3":
        assert c["farskip"] is True and (c["farskip_start_idx"], c["farskip_end_idx"]) == (1, 2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_logits = hf(torch.tensor(np.asarray(tokens))).logits.numpy()
    assert np.abs(hf_logits - _logits(model, tokens, STANDARD)).max() <= 1e-4  # transformers: standard
    student = _logits(model, tokens)
    assert np.abs(hf_logits - student).max() > 1e-2
    cfg2, model2 = import_hf(out)
    assert farskip_settings(cfg2) == c["farskip_jax"]
    assert np.abs(_logits(model2, tokens) - student).max() <= TOL  # farskip_jax import: the student

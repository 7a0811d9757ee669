"""Exports carry RoPE in both forms, and a transformers-4.x reader gets the model's rotary embedding.

Every family is exported (hf_config_for: the config.json export_hf writes) from a model whose rope
theta is not its family's default and whose scaling is what the family ships (DeepSeek yarn with
mscale / mscale_all_dim, Qwen yarn, Qwen2 linear, Llama-4 llama3). Two readers that never see
`rope_parameters` read it back:

- `read_4x`, written here from transformers 4.57's rope formulas (`rope_theta`, `rope_scaling`, the
  class's default theta when a key is missing, DeepSeek's softmax scale * mscale(factor,
  mscale_all_dim)^2), independent of farskip_jax's model/rope.py;
- transformers 5 itself with `rope_parameters` deleted from config.json (its legacy-key path), its
  model's rotary embedding and attention scale.

Both must give the inverse frequencies, the cos/sin factor and the attention softmax scale of the
farskip_jax model built from the same config (float64 oracle: 1e-12 relative; transformers' float32
buffers: 1e-6). One export is written to disk (DeepSeek-V3 yarn as instella_moe) and read from there.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import transformers

from farskip_jax.convert.export import export_hf, hf_config_for
from farskip_jax.loading.hf_folder import abstract_model, hf_to_config

# transformers 4.x config classes' default rope_theta: what a 4.x reader runs when the key is absent
DEFAULT_THETA_4X = {"deepseek_v2": 10000.0, "deepseek_v3": 10000.0, "qwen3_moe": 10000.0, "qwen2_moe": 10000.0,
                    "mixtral": 1e6, "olmoe": 10000.0, "llama4_text": 500000.0}
SMALL = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, intermediate_size=48, num_hidden_layers=2)


def _yarn(theta, factor, orig, **more):
    return {"rope_type": "yarn", "rope_theta": theta, "factor": factor, "original_max_position_embeddings": orig, **more}


def _sources() -> dict:
    """export family -> an HF config (transformers 5 classes) whose rope is not the family default."""
    T = transformers
    mla = dict(SMALL, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
               n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
               v_head_dim=8, max_position_embeddings=128)
    v3 = T.DeepseekV3Config(**mla, q_lora_rank=12, n_group=1, topk_group=1,
                            rope_parameters=_yarn(8e6, 4.0, 32, mscale=1.0, mscale_all_dim=1.0, beta_fast=32.0,
                                                  beta_slow=1.0))
    return {
        "deepseek_v3": v3,
        "instella_moe": v3,
        "deepseek_v2": T.DeepseekV2Config(**mla, q_lora_rank=None,
                                          rope_parameters=_yarn(20000.0, 4.0, 32, mscale=0.707, mscale_all_dim=0.707)),
        "qwen3_moe": T.Qwen3MoeConfig(**SMALL, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=16, max_position_embeddings=128,
                                      rope_parameters=_yarn(25000.0, 4.0, 32)),
        "qwen2_moe": T.Qwen2MoeConfig(**SMALL, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                      rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 30000.0}),
        "mixtral": T.MixtralConfig(**SMALL, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                   rope_parameters={"rope_type": "default", "rope_theta": 2e6}),
        "olmoe": T.OlmoeConfig(**SMALL, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                               rope_parameters={"rope_type": "default", "rope_theta": 20000.0}),
        "llama4_text": T.Llama4TextConfig(**SMALL, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                          num_experts_per_tok=1, intermediate_size_mlp=40, moe_layers=[1],
                                          no_rope_layers=[1, 1], max_position_embeddings=256,
                                          rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 600000.0,
                                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                           "original_max_position_embeddings": 32}),
    }


def read_4x(c: dict) -> tuple[np.ndarray, float, float]:
    """(inv_freq, cos/sin factor, softmax scale) as transformers 4.57 computes them from config.json
    `c`; `rope_parameters` is a key it does not know."""
    mt = c["model_type"]
    mla = "kv_lora_rank" in c
    base = float(c.get("rope_theta", DEFAULT_THETA_4X["deepseek_v3" if mla else mt]))
    rs = c.get("rope_scaling") or None
    dim = c["qk_rope_head_dim"] if mla else (c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
    inv = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    kind = (rs.get("rope_type", rs.get("type")) if rs else None) or "default"
    attn = 1.0
    if kind == "linear":
        inv = inv / rs["factor"]
    elif kind == "llama3":
        f, lo, hi, old = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"], rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / lo, inv / f, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        inv = np.where(medium, (1 - smooth) * scaled / f + smooth * scaled, scaled)
    elif kind == "yarn":
        f = rs["factor"]
        orig = rs.get("original_max_position_embeddings") or c["max_position_embeddings"]
        ms, msad = rs.get("mscale"), rs.get("mscale_all_dim")

        def get_mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attn = rs.get("attention_factor")
        if attn is None:
            attn = get_mscale(f, ms) / get_mscale(f, msad) if ms and msad else get_mscale(f)

        def corr(rot):
            return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        lo, hi = corr(rs.get("beta_fast") or 32), corr(rs.get("beta_slow") or 1)
        if rs.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        hi = hi + 0.001 if lo == hi else hi
        extra = 1 - np.clip((np.arange(dim // 2, dtype=np.float64) - lo) / (hi - lo), 0, 1)
        inv = inv / f * (1 - extra) + inv * extra
    else:
        assert kind == "default", kind
    if mla:
        scale = (c["qk_nope_head_dim"] + c["qk_rope_head_dim"]) ** -0.5
        if rs and rs.get("mscale_all_dim"):
            scale *= (0.1 * rs["mscale_all_dim"] * math.log(rs["factor"]) + 1.0) ** 2
    else:
        scale = dim ** -0.5
    return inv, float(attn), scale


def read_transformers5_legacy(c: dict) -> tuple[np.ndarray, float, float]:
    """The same three from transformers 5's own modules, config.json read without `rope_parameters`."""
    d = {k: v for k, v in c.items() if k not in ("rope_parameters", "architectures", "farskip_jax")}
    cfg = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    rot = model.model.rotary_emb
    return (rot.inv_freq.double().numpy(), float(rot.attention_scaling),
            float(model.model.layers[0].self_attn.scaling))


def ours(cfg) -> tuple[np.ndarray, float, float]:
    attn = abstract_model(cfg).layers[0].attn
    return np.asarray(attn.inv_freq, np.float64), float(attn.rope_factor), float(attn.scale)


def _check(exported: dict, cfg, family: str):
    mine = ours(cfg)
    assert cfg.model.rope_theta != DEFAULT_THETA_4X["deepseek_v3" if "kv_lora_rank" in exported else family]
    for reader, rtol in ((read_4x, 1e-12), (read_transformers5_legacy, 1e-6)):
        inv, factor, scale = reader(exported)
        np.testing.assert_allclose(inv, mine[0], rtol=rtol, err_msg=f"{family}: inverse frequencies ({reader.__name__})")
        assert factor == pytest.approx(mine[1], rel=rtol), (family, reader.__name__, "cos/sin factor")
        assert scale == pytest.approx(mine[2], rel=rtol), (family, reader.__name__, "softmax scale")
    rs = exported["rope_scaling"]
    if rs and "original_max_position_embeddings" in rs and rs["rope_type"] == "yarn":
        # 4.x releases that derive the YaRN factor as max_position_embeddings / original read the same
        assert exported["max_position_embeddings"] / rs["original_max_position_embeddings"] == rs["factor"]


@pytest.mark.parametrize("family", list(_sources()))
def test_every_family_exports_rope_that_a_4x_reader_reads_as_the_model(family):
    src = _sources()[family].to_dict()
    cfg = hf_to_config(src)
    exported, _ = hf_config_for(cfg, family=family)
    assert exported["rope_parameters"]["rope_theta"] == cfg.model.rope_theta  # the transformers-5 form stays
    _check(json.loads(json.dumps(exported)), cfg, family)


def test_a_deepseek_v3_yarn_export_on_disk_reads_right_without_rope_parameters(tmp_path):
    """The issue's case: a DeepSeek-V3 (yarn x4, theta 8e6) exported as instella_moe, read from config.json."""
    import jax
    from flax import nnx

    cfg = hf_to_config(_sources()["instella_moe"].to_dict(), ["farskip.preset=farskip"])
    graphdef, abstract = nnx.split(abstract_model(cfg))  # zero weights: only the config matters here
    model = nnx.merge(graphdef, jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), abstract))
    out = export_hf(model, cfg, str(tmp_path / "hf"), family="instella_moe", report=lambda line: None)
    with open(f"{out}/config.json") as f:
        exported = json.load(f)
    assert exported["architectures"] == ["InstellaMoEForCausalLM"] and exported["farskip"] is True
    assert exported["rope_scaling"]["type"] == exported["rope_scaling"]["rope_type"] == "yarn"
    assert exported["rope_scaling"]["mscale"] == exported["rope_scaling"]["mscale_all_dim"] == 1.0
    _check(exported, cfg, "instella_moe")

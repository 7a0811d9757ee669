"""FarSkip-native DeepSeek-V3-style layout (AMD Instella-MoE): config.json carries `"farskip": true`,
`farskip_start_idx` / `farskip_end_idx` (inclusive), optional `attn_only_farskip` / `mlp_only_farskip`,
and `gated_attention` (MLA output * sigmoid(self_attn.gate_proj(x)) before o_proj). Imports with
FarSkip connectivity on those layers as the default `farskip` section. Exported by
`export_hf(..., family="instella_moe")` as Instella-MoE ships it: model_type deepseek_v3,
architectures [InstellaMoEForCausalLM]."""

from __future__ import annotations

from farskip_jax.config import Config
from farskip_jax.loading.families import deepseek
from farskip_jax.loading.families.common import layer_specs

MODEL_TYPES = ("instella_moe",)
ARCHITECTURE = "InstellaMoEForCausalLM"


def is_farskip_native(hf: dict) -> bool:
    """`"farskip": true`, model_type instella_moe, or Instella-MoE's architecture (its shipped config.json
    says model_type deepseek_v3)."""
    return (bool(hf.get("farskip")) or hf.get("model_type") in MODEL_TYPES
            or ARCHITECTURE in (hf.get("architectures") or []))


def farskip_tree(hf: dict) -> dict:
    n = hf["num_hidden_layers"]
    if not hf.get("farskip"):
        return {"preset": "standard"}
    start = int(hf.get("farskip_start_idx", 0))
    end = min(int(hf.get("farskip_end_idx", n - 1)), n - 1)
    preset = "attn_only" if hf.get("attn_only_farskip") else "mlp_only" if hf.get("mlp_only_farskip") else "farskip"
    return {"preset": preset, "layers": list(range(start, end + 1))}


def config_tree(hf: dict) -> dict:
    v3 = dict(hf, model_type="deepseek_v3")
    model = deepseek.model_tree(v3)
    model["gated_attention"] = bool(hf.get("gated_attention", False))
    return {"model": model, "moe": deepseek.moe_tree(v3), "farskip": farskip_tree(hf)}


def specs(cfg: Config):
    return layer_specs(cfg, deepseek.NAMES)


def ignored(name: str, hf: dict) -> bool:
    return deepseek.ignored(name, hf)


def hf_config(cfg: Config, base: dict) -> dict:
    out = deepseek.hf_config(cfg, dict(base, model_type=base.get("model_type", "instella_moe")))
    out["gated_attention"] = cfg.model.gated_attention
    return out

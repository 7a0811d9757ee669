"""OLMoE: GQA with q/k RMSNorm over all heads (before the head split), softmax top-k MoE every layer."""

from __future__ import annotations

from farskip_jax.config import Config
from farskip_jax.loading.families.common import Names, base_model_tree, common_hf, layer_specs
from farskip_jax.errors import CheckpointError

MODEL_TYPES = ("olmoe",)
ARCHITECTURE = "OlmoeForCausalLM"
NAMES = Names()


def config_tree(hf: dict) -> dict:
    if hf.get("clip_qkv") is not None:
        raise CheckpointError(f"OLMoE clip_qkv={hf['clip_qkv']} is not supported (only clip_qkv: null)")
    model = base_model_tree(hf)
    model.update(qk_norm=True, qk_norm_scope="all_heads", attention_bias=bool(hf.get("attention_bias", False)),
                 moe_layers=list(range(hf["num_hidden_layers"])))
    moe = dict(num_experts=hf["num_experts"], top_k=hf["num_experts_per_tok"], expert_hidden=hf["intermediate_size"],
               num_shared_experts=0, scoring="softmax", norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
    return {"model": model, "moe": moe}


def specs(cfg: Config):
    return layer_specs(cfg, NAMES)


def hf_config(cfg: Config, base: dict) -> dict:
    out = common_hf(cfg, base)
    out.update(num_experts=cfg.moe.num_experts, num_experts_per_tok=cfg.moe.top_k, intermediate_size=cfg.moe.expert_hidden,
               norm_topk_prob=cfg.moe.norm_topk_prob, attention_bias=cfg.model.attention_bias)
    return out

"""Qwen3-MoE: GQA with per-head q/k RMSNorm, softmax top-k (optionally renormalised), no shared expert."""

from __future__ import annotations

from farskip_jax.config import Config
from farskip_jax.loading.families.common import Names, base_model_tree, common_hf, layer_specs, moe_layers_from_step
from farskip_jax.errors import CheckpointError

MODEL_TYPES = ("qwen3_moe",)
ARCHITECTURE = "Qwen3MoeForCausalLM"
NAMES = Names()


def config_tree(hf: dict) -> dict:
    if hf.get("use_sliding_window"):
        raise CheckpointError("Qwen3-MoE use_sliding_window=true is not supported")
    model = base_model_tree(hf)
    n = hf["num_hidden_layers"]
    e = hf.get("num_experts") or hf.get("num_local_experts")
    model.update(qk_norm=True, qk_norm_scope="head", attention_bias=bool(hf.get("attention_bias", False)),
                 moe_layers=moe_layers_from_step(n, hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers"), e))
    moe = dict(num_experts=e, top_k=hf["num_experts_per_tok"], expert_hidden=hf["moe_intermediate_size"],
               num_shared_experts=0, scoring="softmax", norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
    return {"model": model, "moe": moe}


def specs(cfg: Config):
    return layer_specs(cfg, NAMES)


def hf_config(cfg: Config, base: dict) -> dict:
    m, e = cfg.model, cfg.moe
    out = common_hf(cfg, base)
    out.pop("num_local_experts", None)
    out.update(num_experts=e.num_experts, num_experts_per_tok=e.top_k, moe_intermediate_size=e.expert_hidden,
               norm_topk_prob=e.norm_topk_prob, attention_bias=m.attention_bias, decoder_sparse_step=1,
               head_dim=m.resolved_head_dim, mlp_only_layers=[i for i in range(m.num_layers) if not m.is_moe_layer(i)])
    return out

"""Qwen2-MoE: GQA with q/k/v bias, softmax top-k, one shared expert scaled by sigmoid(x @ gate)."""

from __future__ import annotations

from farskip_jax.config import Config
from farskip_jax.loading.families.common import Names, base_model_tree, common_hf, layer_specs, moe_layers_from_step
from farskip_jax.errors import CheckpointError

MODEL_TYPES = ("qwen2_moe",)
ARCHITECTURE = "Qwen2MoeForCausalLM"
NAMES = Names(shared="shared_expert", shared_gate="shared_expert_gate")


def config_tree(hf: dict) -> dict:
    if hf.get("use_sliding_window"):
        raise CheckpointError("Qwen2-MoE use_sliding_window=true is not supported")
    model = base_model_tree(hf)
    n, e = hf["num_hidden_layers"], hf["num_experts"]
    model.update(attention_bias=bool(hf.get("qkv_bias", True)),
                 moe_layers=moe_layers_from_step(n, hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers"), e))
    shared = hf.get("shared_expert_intermediate_size") or 0
    moe = dict(num_experts=e, top_k=hf["num_experts_per_tok"], expert_hidden=hf["moe_intermediate_size"],
               num_shared_experts=1 if shared else 0, shared_hidden=shared or None, shared_gate=bool(shared),
               scoring="softmax", norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
    return {"model": model, "moe": moe}


def specs(cfg: Config):
    return layer_specs(cfg, NAMES)


def hf_config(cfg: Config, base: dict) -> dict:
    m, e = cfg.model, cfg.moe
    out = common_hf(cfg, base)
    out.update(num_experts=e.num_experts, num_experts_per_tok=e.top_k, moe_intermediate_size=e.expert_hidden,
               shared_expert_intermediate_size=e.resolved_shared_hidden, norm_topk_prob=e.norm_topk_prob,
               qkv_bias=m.attention_bias, decoder_sparse_step=1,
               mlp_only_layers=[i for i in range(m.num_layers) if not m.is_moe_layer(i)])
    return out

"""DeepSeek-V2 / V2-Lite / V3: MLA attention, first-k-dense layers, shared experts.

V2: softmax scores, greedy or group-limited (group score = max) top-k, weights * routed_scaling_factor
(transformers does not renormalise V2 weights). V3: sigmoid scores + `e_score_correction_bias` for
selection only, group score = sum of the top-2 biased scores, optional renormalisation, scaling.
Multi-token-prediction layers (model.layers.{num_hidden_layers + j}) are skipped.
"""

from __future__ import annotations

import re

from farskip_jax.config import Config
from farskip_jax.loading.families.common import Names, base_model_tree, common_hf, layer_specs
from farskip_jax.errors import CheckpointError

MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
ARCHITECTURE = "DeepseekV3ForCausalLM"
NAMES = Names()


def model_tree(hf: dict) -> dict:
    model = base_model_tree(hf)
    n, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    k = int(hf.get("first_k_dense_replace", 0))
    model.update(attention="mla", num_kv_heads=heads, head_dim=hf["v_head_dim"], q_lora_rank=hf.get("q_lora_rank"),
                 kv_lora_rank=hf["kv_lora_rank"], qk_nope_head_dim=hf["qk_nope_head_dim"],
                 qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
                 attention_bias=bool(hf.get("attention_bias", False)), first_k_dense=k,
                 rope_interleaved=bool(hf.get("rope_interleave", True)), moe_layers=list(range(k, n)))
    return model


def moe_tree(hf: dict) -> dict:
    e = hf.get("n_routed_experts") or hf.get("num_local_experts") or hf.get("num_experts")
    moe = dict(num_experts=e, top_k=hf["num_experts_per_tok"], expert_hidden=hf["moe_intermediate_size"],
               num_shared_experts=int(hf.get("n_shared_experts") or 0),
               routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)))
    if hf["model_type"] == "deepseek_v2":
        method = hf.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise CheckpointError(f"DeepSeek-V2 topk_method={method!r} is not supported (greedy, group_limited_greedy)")
        grouped = method == "group_limited_greedy"
        moe.update(scoring="softmax", norm_topk_prob=False, n_group=int(hf["n_group"]) if grouped else 1,
                   topk_group=int(hf["topk_group"]) if grouped else 1, group_score="max")
    else:
        moe.update(scoring="sigmoid", selection_bias=True, norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                   n_group=int(hf.get("n_group") or 1), topk_group=int(hf.get("topk_group") or 1), group_score="top2_sum")
    return moe


def config_tree(hf: dict) -> dict:
    return {"model": model_tree(hf), "moe": moe_tree(hf)}


def specs(cfg: Config):
    return layer_specs(cfg, NAMES)


def ignored(name: str, hf: dict) -> bool:
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return bool(m) and int(m.group(1)) >= hf["num_hidden_layers"]  # MTP layers


def hf_config(cfg: Config, base: dict) -> dict:
    m, e = cfg.model, cfg.moe
    out = common_hf(cfg, base)
    out.update(q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
               qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim, head_dim=m.qk_rope_head_dim,
               num_key_value_heads=m.num_heads, attention_bias=m.attention_bias, first_k_dense_replace=m.first_k_dense,
               n_routed_experts=e.num_experts, num_experts_per_tok=e.top_k, moe_intermediate_size=e.expert_hidden,
               n_shared_experts=e.num_shared_experts, routed_scaling_factor=e.routed_scaling_factor,
               n_group=e.n_group, topk_group=e.topk_group)
    out.setdefault("model_type", "deepseek_v3" if e.scoring == "sigmoid" else "deepseek_v2")
    if out["model_type"] == "deepseek_v2":
        out.update(topk_method="group_limited_greedy" if e.n_group > 1 else "greedy", architectures=["DeepseekV2ForCausalLM"])
    else:
        out.update(norm_topk_prob=e.norm_topk_prob, rope_interleave=m.rope_interleaved, num_nextn_predict_layers=0)
    return out

"""Llama-4 text: interleaved dense/MoE layers, top-1 sigmoid routing that scales the expert INPUT,
one shared expert, fused gate_up_proj expert tensors, NoPE layers with temperature tuning,
chunked local attention on rope layers, weightless q/k L2 norm after rope (rope layers)."""

from __future__ import annotations

from farskip_jax.config import Config
from farskip_jax.loading.families.common import Names, base_model_tree, common_hf, layer_specs

MODEL_TYPES = ("llama4_text", "llama4")
ARCHITECTURE = "Llama4ForCausalLM"
NAMES = Names(dense_mlp="feed_forward", moe="feed_forward", router="router", shared="shared_expert")


def text_part(hf: dict) -> tuple[dict, str]:
    """(text config, tensor-name prefix) of a multimodal Llama-4 checkpoint (Scout/Maverick:
    model_type llama4 with text_config, tensors under language_model.); (hf, "") for a text one."""
    if "text_config" not in hf:
        return hf, ""
    text = dict(hf["text_config"], model_type="llama4_text", architectures=[ARCHITECTURE])
    text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", False))
    return text, "language_model."


def config_tree(hf: dict) -> dict:
    hf = text_part(hf)[0]
    model = base_model_tree(hf, default_theta=500000.0)
    n = hf["num_hidden_layers"]
    step = hf.get("interleave_moe_layer_step", 1)
    moe_layers = hf.get("moe_layers")
    if moe_layers is None:
        moe_layers = list(range(step - 1, n, step))
    interval = hf.get("no_rope_layer_interval", 4)
    no_rope = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    types = hf.get("layer_types") or ["chunked_attention" if r else "full_attention" for r in no_rope]
    chunk = hf.get("attention_chunk_size")
    model.update(mlp_hidden=hf.get("intermediate_size_mlp", model["mlp_hidden"]), moe_layers=list(moe_layers),
                 rope_interleaved=True, nope_layers=[i for i, r in enumerate(no_rope) if not r],
                 qk_l2_norm=bool(hf.get("use_qk_norm", True)), attention_bias=bool(hf.get("attention_bias", False)),
                 attention_chunk_size=chunk,
                 chunked_layers=[i for i, ty in enumerate(types) if ty == "chunked_attention"] if chunk else None,
                 attn_temperature_tuning=bool(hf.get("attn_temperature_tuning", True)),
                 attn_temperature_floor=float(hf.get("floor_scale", 8192)), attn_temperature_scale=float(hf.get("attn_scale", 0.1)))
    moe = dict(num_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"], expert_hidden=hf["intermediate_size"],
               num_shared_experts=1, shared_hidden=hf["intermediate_size"], scoring="sigmoid", norm_topk_prob=False,
               route_on_input=True)
    return {"model": model, "moe": moe}


def specs(cfg: Config):
    return layer_specs(cfg, NAMES, fused_experts=True)


def hf_config(cfg: Config, base: dict) -> dict:
    m, e = cfg.model, cfg.moe
    out = common_hf(cfg, base)
    n = m.num_layers
    out.update(intermediate_size=e.expert_hidden, intermediate_size_mlp=m.mlp_hidden, num_local_experts=e.num_experts,
               num_experts_per_tok=e.top_k, moe_layers=[i for i in range(n) if m.is_moe_layer(i)],
               no_rope_layers=[int(i not in m.nope_layers) for i in range(n)], use_qk_norm=m.qk_l2_norm,
               attn_temperature_tuning=m.attn_temperature_tuning, floor_scale=int(m.attn_temperature_floor),
               attn_scale=m.attn_temperature_scale, head_dim=m.resolved_head_dim)
    if m.attention_chunk_size:
        ch = m.chunked_layers if m.chunked_layers is not None else range(n)
        out.update(attention_chunk_size=m.attention_chunk_size,
                   layer_types=["chunked_attention" if i in ch else "full_attention" for i in range(n)])
    return out

"""Mixtral: GQA attention, every layer MoE (softmax top-k, renormalised), per-expert w1/w3/w2."""

from __future__ import annotations

from farskip_jax.config import Config
from farskip_jax.loading.families.common import Names, base_model_tree, common_hf, layer_specs
from farskip_jax.errors import CheckpointError

MODEL_TYPES = ("mixtral",)
ARCHITECTURE = "MixtralForCausalLM"
NAMES = Names(moe="block_sparse_moe", expert_wts=("w1", "w3", "w2"))


def config_tree(hf: dict) -> dict:
    if hf.get("sliding_window") is not None:
        raise CheckpointError(f"Mixtral sliding_window={hf['sliding_window']} is not supported (sliding-window "
                              "attention is not implemented); only sliding_window: null checkpoints import")
    model = base_model_tree(hf, default_theta=1e6)
    n = hf["num_hidden_layers"]
    moe = dict(num_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"], expert_hidden=hf["intermediate_size"],
               num_shared_experts=0, scoring="softmax", norm_topk_prob=True)
    model["moe_layers"] = list(range(n))
    return {"model": model, "moe": moe}


def specs(cfg: Config):
    return layer_specs(cfg, NAMES)


def hf_config(cfg: Config, base: dict) -> dict:
    out = common_hf(cfg, base)
    out.update(num_local_experts=cfg.moe.num_experts, num_experts_per_tok=cfg.moe.top_k,
               intermediate_size=cfg.moe.expert_hidden)
    return out

"""Registry of supported HF families: `family_for(hf_config) -> module` (see common.py for the interface)."""

from __future__ import annotations

from types import ModuleType

from farskip_jax.loading.families import deepseek, farskip_native, llama4, mixtral, olmoe, qwen2_moe, qwen3_moe
from farskip_jax.errors import CheckpointError

FAMILIES: tuple[ModuleType, ...] = (deepseek, llama4, mixtral, olmoe, qwen2_moe, qwen3_moe, farskip_native)
SUPPORTED = sorted(t for f in FAMILIES for t in f.MODEL_TYPES)


def family_for(hf: dict) -> ModuleType:
    """The family module of an HF config.json (FarSkip-native when it carries `"farskip": true`)."""
    if farskip_native.is_farskip_native(hf):
        return farskip_native
    mt = hf.get("model_type")
    for fam in FAMILIES:
        if mt in fam.MODEL_TYPES:
            return fam
    arch = hf.get("architectures")
    raise CheckpointError(f"unsupported model_type {mt!r} (architectures {arch}); supported model types: {SUPPORTED} "
                          "(plus any DeepSeek-V3 layout with \"farskip\": true)")


def text_part(hf: dict) -> tuple[dict, str]:
    """(config of the language model, prefix of its tensor names): the family's `text_part` for
    multimodal checkpoints (Llama-4 Scout/Maverick), else (hf, "")."""
    fn = getattr(family_for(hf), "text_part", None)
    return fn(hf) if fn else (hf, "")


def family_by_name(model_type: str) -> ModuleType:
    return family_for({"model_type": model_type})

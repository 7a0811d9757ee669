"""HF checkpoint import/export (docs/design.md section 3: convert/; reading HF folders is loading/).

    cfg, model = import_hf("hf_folder", mesh=None, overrides=["farskip.preset=farskip"])
    export_hf(model, cfg, "out_folder")          # base config.json from cfg.init_from_hf
    python -m farskip_jax.convert import HF_DIR OUT_DIR | export CKPT_DIR HF_DIR

Families (loading/families/): DeepSeek-V2/V3, Qwen2-MoE, Qwen3-MoE, Llama-4 text, Mixtral, OLMoE and
the FarSkip-native (Instella-MoE) DeepSeek-V3 layout.
"""

from farskip_jax.convert.export import export_hf
from farskip_jax.loading.families import SUPPORTED
from farskip_jax.loading.hf_folder import hf_to_config, import_hf

__all__ = ["import_hf", "export_hf", "hf_to_config", "SUPPORTED"]

"""What an HF export target can hold: the model (its family) and the student's connectivity.

    problems = family_problems(cfg, fam, hf_cfg)   # [] when the family holds the model exactly
    fits = families_that_fit(cfg)                  # model_types with no problems
    lines = connectivity_notes(cfg, hf_cfg)        # what the folder's readers will run instead

A family holds a model when the config.json it writes reads back (the family's own `config_tree`)
to the same function: the same architecture fields (shared experts, q/k norm, scoring, rope, MoE
layers, ...) and the same set of HF tensors with the same shapes. Otherwise transformers would drop
tensors, initialise missing ones at random, or compute another function from the same weights.

Connectivity: stock transformers architectures run every exported folder with standard
connectivity (the student's settings survive only in config.json's "farskip_jax", which farskip_jax
reads back). The FarSkip-native layout (Instella-MoE: `architectures: [InstellaMoEForCausalLM]`,
`"farskip": true`, `farskip_start_idx` / `farskip_end_idx` inclusive, `attn_only_farskip` /
`mlp_only_farskip`) runs FarSkip itself, on one contiguous layer range, attention reading the
no-routed stream (`partial`) and/or the MoE reading the stream before attention (`outdated`),
skip distance 1. `native_keys` gives those keys for a connectivity, or the reason it cannot.
"""

from __future__ import annotations

from types import ModuleType, SimpleNamespace
from typing import Optional

from farskip_jax.config import Config, MoEConfig, ModelConfig, from_dict
from farskip_jax.loading.families.common import hf_rope
from farskip_jax.errors import CheckpointError, FarSkipError
from farskip_jax.loading.families import SUPPORTED

NATIVE_ARCHITECTURE = "InstellaMoEForCausalLM"


def _arch(m: ModelConfig, e: MoEConfig) -> dict:
    """{what: value} of everything that decides the function of a model with given weights."""
    n = m.num_layers
    moe = [i for i in range(n) if e.num_experts and m.is_moe_layer(i)]
    out = {"vocab_size": m.vocab_size, "d_model": m.d_model, "num_layers": n, "attention": m.attention,
           "attention_bias": m.attention_bias, "q/k norm": m.qk_norm, "q/k L2 norm": m.qk_l2_norm,
           "gated attention": m.gated_attention, "norm_eps": m.norm_eps, "rope": hf_rope_of(m),
           "rope_interleaved": m.rope_interleaved, "NoPE layers": sorted(m.nope_layers),
           "tie_embeddings": m.tie_embeddings, "MoE layers": moe}
    if m.qk_norm:
        out["q/k norm scope"] = m.qk_norm_scope
    if m.attention == "mla":
        out.update(q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
                   qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim, num_heads=m.num_heads)
    else:
        out.update(num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.resolved_head_dim)
    if len(moe) < n:
        out["dense mlp_hidden"] = m.mlp_hidden
    if m.attention_chunk_size:
        out["chunked attention"] = (m.attention_chunk_size, sorted(m.chunked_layers if m.chunked_layers is not None
                                                                   else range(n)))
    if m.attn_temperature_tuning:
        out["attention temperature"] = (m.attn_temperature_floor, m.attn_temperature_scale)
    if moe:
        out.update({"routed experts": e.num_experts, "top_k": e.top_k, "expert_hidden": e.expert_hidden,
                    "shared experts": e.num_shared_experts, "scoring": e.scoring, "norm_topk_prob": e.norm_topk_prob,
                    "routed_scaling_factor": e.routed_scaling_factor, "expert groups": (e.n_group, e.topk_group),
                    "selection bias": e.selection_bias, "routing on the expert input": e.route_on_input})
        if e.num_shared_experts:
            out.update({"shared expert hidden": e.resolved_shared_hidden, "shared-expert gate": e.shared_gate})
        if e.n_group > 1:
            out["group score"] = e.group_score
    return out


def hf_rope_of(m: ModelConfig) -> dict:
    return hf_rope(SimpleNamespace(model=m))


def family_problems(cfg: Config, fam: ModuleType, hf_cfg: dict) -> list[str]:
    """What of cfg's model the family `fam` loses when it writes `hf_cfg` ([] = nothing): "what
    model's value -> the value the family's folder reads back"."""
    try:
        tree = fam.config_tree(hf_cfg)
        back_model = from_dict(ModelConfig, tree.get("model", {}))
        back_moe = from_dict(MoEConfig, tree.get("moe", {}))
    except (FarSkipError, KeyError, TypeError, ValueError) as e:  # the family's reader refuses the config
        return [f"its config reader refuses the model ({str(e).splitlines()[0][:200]})"]
    have, back = _arch(cfg.model, cfg.moe), _arch(back_model, back_moe)
    # keys on one side only follow from a difference listed anyway (q/k norm, shared experts, attention)
    out = [f"{k} {have[k]!r} -> {back[k]!r}" for k in have.keys() & back.keys() if have[k] != back[k]]
    if not out:
        back_cfg = SimpleNamespace(model=back_model, moe=back_moe)  # what fam.specs reads
        mine = {n: s for sp in fam.specs(cfg) for n, s in sp.hf_shapes().items()}
        theirs = {n: s for sp in fam.specs(back_cfg) for n, s in sp.hf_shapes().items()}
        odd = sorted(n for n in mine.keys() | theirs.keys() if mine.get(n) != theirs.get(n))
        if odd:
            out.append(f"tensors {odd[:3]}{' ...' if len(odd) > 3 else ''} would not read back")
    return sorted(out)


def families_that_fit(cfg: Config, config_for) -> list[str]:
    """The model_types whose family holds cfg's model; config_for(model_type) -> (hf config, family)."""
    fits = []
    for mt in SUPPORTED:
        try:
            hf_cfg, fam = config_for(mt)
        except CheckpointError:
            continue
        if not family_problems(cfg, fam, hf_cfg):
            fits.append(mt)
    return fits


def native_keys(cfg: Config) -> tuple[Optional[dict], str]:
    """(the FarSkip-native config.json keys of cfg's connectivity, why not) — keys None when the
    native layout cannot express it; why: "" when it can."""
    fs, n = cfg.farskip, cfg.model.num_layers
    inputs = {i: fs.layer_inputs(i, n) for i in range(n)}
    conv = [i for i in range(n) if inputs[i] != ("full", "full")]
    off = dict(farskip=False, attn_only_farskip=False, mlp_only_farskip=False)
    if not conv:
        return off, ""
    kinds = {inputs[i] for i in conv}
    flags = {("partial", "outdated"): {}, ("partial", "full"): {"attn_only_farskip": True},
             ("full", "outdated"): {"mlp_only_farskip": True}}
    why = []
    if len(kinds) > 1 or next(iter(kinds)) not in flags:
        why.append(f"its layers read attn/moe inputs {sorted(kinds)} (the native layout has attention on the "
                   "no-routed stream ('partial') and/or the MoE before attention ('outdated'), one choice for all)")
    if conv != list(range(conv[0], conv[-1] + 1)):
        why.append(f"its converted layers {conv} are not one contiguous range (farskip_start_idx..farskip_end_idx)")
    if fs.skip_distance != 1 and any(a != "full" for a, _ in kinds):
        why.append(f"farskip.skip_distance={fs.skip_distance} (the native layout skips one layer's routed experts)")
    if why:
        return None, "; ".join(why)
    keys = dict(off, farskip=True, farskip_start_idx=conv[0], farskip_end_idx=conv[-1])
    keys.update(flags[next(iter(kinds))])
    return keys, ""


def connectivity_notes(cfg: Config, hf_cfg: dict) -> list[str]:
    """Warnings for an export whose readers will not run the student's connectivity."""
    fs, n = cfg.farskip, cfg.model.num_layers
    if all(fs.layer_inputs(i, n) == ("full", "full") for i in range(n)):
        return []
    native = NATIVE_ARCHITECTURE in (hf_cfg.get("architectures") or [])
    _, why = native_keys(cfg)
    keep = ('farskip_jax import restores the exact connectivity from config.json\'s "farskip_jax" '
            "(eval.py --hf, python -m farskip_jax.convert import)")
    if native and why:
        return [f"the FarSkip-native layout cannot express this student's connectivity: {why}; its native keys say "
                f"farskip=false, so engines reading them run the standard model; {keep}"]
    if native:
        return []
    arch = (hf_cfg.get("architectures") or ["?"])[0]
    tip = ("; for serving with FarSkip, export the FarSkip-native layout: --family instella_moe"
           if hf_cfg.get("model_type") in ("deepseek_v3",) and not why else "")
    return [f"{arch} (HF transformers, serving engines) runs this folder with standard connectivity, not the "
            f"student's {fs.preset}; {keep}{tip}"]

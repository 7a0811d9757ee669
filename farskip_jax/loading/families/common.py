"""Pieces shared by the family modules: HF config fields -> our config tree, and tensor-spec builders.

A family module defines `MODEL_TYPES`, `ARCHITECTURE`, `config_tree(hf: dict) -> dict` (sections
model/moe/farskip of our Config), `specs(cfg: Config) -> list[TensorSpec]`, `hf_config(cfg, base) -> dict`
(the config.json written on export) and optionally `ignored(name) -> bool` for HF tensors we skip.
HF Linear weights are [out, in]; ours are [in, out] (spec kind `t`). RoPE is read from either form and
written in both: transformers-5 `rope_parameters` and the 4.x `rope_theta` + `rope_scaling` (which 4.x
readers, DeepSeek's and Instella-MoE's own modeling code included, read; transformers 5 prefers
`rope_scaling` when both are present, so the two hold the same values).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from farskip_jax.config import Config
from farskip_jax.loading.spec import TensorSpec, experts_t, part, same, t
from farskip_jax.errors import CheckpointError

ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3", "yarn": "yarn"}


def rope_tree(hf: dict, default_theta: float = 10000.0) -> tuple[float, dict]:
    """(rope_theta, rope_scaling tree) from `rope_parameters` (transformers 5) or rope_theta/rope_scaling (4.x)."""
    rp = dict(hf.get("rope_parameters") or {})
    if not rp:
        rp = dict(hf.get("rope_scaling") or {})
        rp.setdefault("rope_theta", hf.get("rope_theta", default_theta))
    theta = float(rp.get("rope_theta", hf.get("rope_theta", default_theta)))
    kind = rp.get("rope_type") or rp.get("type") or "default"
    if kind not in ROPE_TYPES:
        raise CheckpointError(f"rope scaling type {kind!r} is not supported; supported: {sorted(ROPE_TYPES)}")
    if kind == "default":
        return theta, {"type": "none"}
    orig = rp.get("original_max_position_embeddings") or hf.get("max_position_embeddings", 4096)
    tree = {"type": ROPE_TYPES[kind], "factor": float(rp.get("factor") or 1.0), "original_max_position": int(orig)}
    if kind == "llama3":
        tree.update(low_freq_factor=float(rp.get("low_freq_factor", 1.0)), high_freq_factor=float(rp.get("high_freq_factor", 4.0)))
    if kind == "yarn":
        tree.update(beta_fast=float(rp.get("beta_fast") or 32), beta_slow=float(rp.get("beta_slow") or 1),
                    mscale=float(rp.get("mscale") or 0.0), mscale_all_dim=float(rp.get("mscale_all_dim") or 0.0),
                    attention_factor=rp.get("attention_factor"), truncate=bool(rp.get("truncate", True)))
    return theta, tree


def hf_rope(cfg: Config) -> dict:
    """Inverse of rope_tree: the transformers-5 `rope_parameters` dict."""
    m = cfg.model
    s = m.rope_scaling
    out = {"rope_theta": m.rope_theta, "rope_type": {"none": "default"}.get(s.type, s.type)}
    if s.type != "none":
        out["factor"] = s.factor
    if s.type in ("llama3", "yarn"):
        out["original_max_position_embeddings"] = s.original_max_position
    if s.type == "llama3":
        out.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor)
    if s.type == "yarn":
        out.update(beta_fast=s.beta_fast, beta_slow=s.beta_slow, truncate=s.truncate)
        if s.mscale:
            out["mscale"] = s.mscale
        if s.mscale_all_dim:
            out["mscale_all_dim"] = s.mscale_all_dim
        if s.attention_factor is not None:
            out["attention_factor"] = s.attention_factor
    return out


def hf_rope_legacy(cfg: Config) -> tuple[float, Optional[dict]]:
    """The transformers-4.x form of hf_rope: (rope_theta, rope_scaling or None). rope_scaling carries
    `rope_type` and, for linear and yarn, the older `type` key DeepSeek's own modeling code reads;
    YaRN keeps mscale / mscale_all_dim (DeepSeek's attention scale)."""
    rp = hf_rope(cfg)
    theta = rp.pop("rope_theta")
    if rp["rope_type"] == "default":
        return theta, None
    if rp["rope_type"] in ("linear", "yarn"):
        rp["type"] = rp["rope_type"]
    return theta, rp


def rope_notes(cfg: Config) -> list[str]:
    """Readers that may run another RoPE than this model: YaRN whose factor is not
    max_position_embeddings / original_max_position_embeddings (some transformers 4.x releases derive
    the factor from that ratio)."""
    m, s = cfg.model, cfg.model.rope_scaling
    if s.type == "yarn" and m.max_seq_len != s.factor * s.original_max_position:
        return [f"YaRN factor {s.factor:g} != max_position_embeddings / original_max_position_embeddings = "
                f"{m.max_seq_len} / {s.original_max_position}: transformers 4.x releases that derive the YaRN factor "
                "from that ratio will run other rotary frequencies than this model"]
    return []


def base_model_tree(hf: dict, *, default_theta: float = 10000.0, tie_default: bool = False) -> dict:
    """ModelConfig fields every family shares."""
    theta, scaling = rope_tree(hf, default_theta)
    heads = hf["num_attention_heads"]
    return dict(
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
        num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=hf.get("head_dim"),
        mlp_hidden=hf.get("intermediate_size", 4 * hf["hidden_size"]), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta, rope_scaling=scaling, max_seq_len=int(hf.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", tie_default)),
        init_std=float(hf.get("initializer_range", 0.02)),
    )


def moe_layers_from_step(n: int, step: int, mlp_only: list, num_experts: int) -> list[int]:
    """Qwen-style: MoE where (i + 1) % step == 0 and i not in mlp_only_layers."""
    return [i for i in range(n) if num_experts > 0 and i not in (mlp_only or []) and (i + 1) % step == 0]


@dataclass(frozen=True)
class Names:
    """HF module names of one family (relative to model.layers.{i}.)."""

    attn: str = "self_attn"
    dense_mlp: str = "mlp"
    moe: str = "mlp"
    router: str = "gate"
    experts: str = "experts"
    expert_wts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down
    shared: str = "shared_experts"
    shared_gate: str = "shared_expert_gate"
    router_bias: str = "e_score_correction_bias"


def global_specs(cfg: Config) -> list[TensorSpec]:
    m = cfg.model
    out = [same(("embed", "table"), "model.embed_tokens.weight", (m.vocab_size, m.d_model)),
           same(("final_norm", "scale"), "model.norm.weight", (m.d_model,))]
    if not m.tie_embeddings:
        out.append(t(("lm_head", "w"), "lm_head.weight", (m.d_model, m.vocab_size)))
    return out


def mlp_specs(path: tuple, hf: str, d: int, hidden: int) -> list[TensorSpec]:
    return [t(path + ("gate", "w"), f"{hf}.gate_proj.weight", (d, hidden)),
            t(path + ("up", "w"), f"{hf}.up_proj.weight", (d, hidden)),
            t(path + ("down", "w"), f"{hf}.down_proj.weight", (hidden, d))]


def gqa_specs(cfg: Config, i: int, names: Names) -> list[TensorSpec]:
    m = cfg.model
    p, hf = ("layers", i, "attn"), f"model.layers.{i}.{names.attn}"
    d, hd, h, kv = m.d_model, m.resolved_head_dim, m.num_heads, m.num_kv_heads
    out = [t(p + ("q_proj", "w"), f"{hf}.q_proj.weight", (d, h * hd)),
           t(p + ("k_proj", "w"), f"{hf}.k_proj.weight", (d, kv * hd)),
           t(p + ("v_proj", "w"), f"{hf}.v_proj.weight", (d, kv * hd)),
           t(p + ("o_proj", "w"), f"{hf}.o_proj.weight", (h * hd, d))]
    if m.attention_bias:
        out += [same(p + (n, "b"), f"{hf}.{n}.bias", (s,)) for n, s in (("q_proj", h * hd), ("k_proj", kv * hd), ("v_proj", kv * hd))]
    if m.qk_norm:
        qs, ks = (h * hd, kv * hd) if m.qk_norm_scope == "all_heads" else (hd, hd)
        out += [same(p + ("q_norm", "scale"), f"{hf}.q_norm.weight", (qs,)),
                same(p + ("k_norm", "scale"), f"{hf}.k_norm.weight", (ks,))]
    if m.gated_attention:
        out.append(t(p + ("gate_proj", "w"), f"{hf}.gate_proj.weight", (d, h * hd)))
    return out


def mla_specs(cfg: Config, i: int, names: Names) -> list[TensorSpec]:
    m = cfg.model
    p, hf = ("layers", i, "attn"), f"model.layers.{i}.{names.attn}"
    d, h = m.d_model, m.num_heads
    qk, vd, r = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
    out = []
    if m.q_lora_rank is None:
        out.append(t(p + ("q_proj", "w"), f"{hf}.q_proj.weight", (d, h * qk)))
    else:
        q = m.q_lora_rank
        out += [t(p + ("q_a_proj", "w"), f"{hf}.q_a_proj.weight", (d, q)),
                same(p + ("q_a_norm", "scale"), f"{hf}.q_a_layernorm.weight", (q,)),
                t(p + ("q_b_proj", "w"), f"{hf}.q_b_proj.weight", (q, h * qk))]
        if m.attention_bias:
            out.append(same(p + ("q_a_proj", "b"), f"{hf}.q_a_proj.bias", (q,)))
    out += [t(p + ("kv_a_proj", "w"), f"{hf}.kv_a_proj_with_mqa.weight", (d, r + m.qk_rope_head_dim)),
            same(p + ("kv_a_norm", "scale"), f"{hf}.kv_a_layernorm.weight", (r,)),
            t(p + ("kv_b_proj", "w"), f"{hf}.kv_b_proj.weight", (r, h * (m.qk_nope_head_dim + vd))),
            t(p + ("o_proj", "w"), f"{hf}.o_proj.weight", (h * vd, d))]
    if m.attention_bias:
        out += [same(p + ("kv_a_proj", "b"), f"{hf}.kv_a_proj_with_mqa.bias", (r + m.qk_rope_head_dim,)),
                same(p + ("o_proj", "b"), f"{hf}.o_proj.bias", (d,))]
    if m.gated_attention:
        out.append(t(p + ("gate_proj", "w"), f"{hf}.gate_proj.weight", (d, h * vd)))
    return out


def moe_specs(cfg: Config, i: int, names: Names, fused: bool = False) -> list[TensorSpec]:
    m, e = cfg.model, cfg.moe
    d, E, hid = m.d_model, e.num_experts, e.expert_hidden
    p, hf = ("layers", i, "moe"), f"model.layers.{i}.{names.moe}"
    out = [t(p + ("router", "w"), f"{hf}.{names.router}.weight", (d, E))]
    if e.selection_bias:
        out.append(same(p + ("router", "bias"), f"{hf}.{names.router}.{names.router_bias}", (E,)))
    ep = p + ("experts",)
    if fused:  # Llama-4: gate_up_proj [E, d, 2h] (gate first), down_proj [E, h, d]
        full = (E, d, 2 * hid)
        out += [part(ep + ("w_gate",), f"{hf}.{names.experts}.gate_up_proj", (E, d, hid), 2, 0, full),
                part(ep + ("w_up",), f"{hf}.{names.experts}.gate_up_proj", (E, d, hid), 2, hid, full),
                same(ep + ("w_down",), f"{hf}.{names.experts}.down_proj", (E, hid, d))]
    else:
        g, u, dn = names.expert_wts
        out += [experts_t(ep + ("w_gate",), [f"{hf}.{names.experts}.{j}.{g}.weight" for j in range(E)], (E, d, hid)),
                experts_t(ep + ("w_up",), [f"{hf}.{names.experts}.{j}.{u}.weight" for j in range(E)], (E, d, hid)),
                experts_t(ep + ("w_down",), [f"{hf}.{names.experts}.{j}.{dn}.weight" for j in range(E)], (E, hid, d))]
    if e.num_shared_experts > 0:
        out += mlp_specs(p + ("shared",), f"{hf}.{names.shared}", d, e.resolved_shared_hidden)
        if e.shared_gate:
            out.append(t(p + ("shared_gate", "w"), f"{hf}.{names.shared_gate}.weight", (d, 1)))
    return out


def layer_specs(cfg: Config, names: Names, *, fused_experts: bool = False) -> list[TensorSpec]:
    """Every tensor of a standard pre-norm decoder (GQA or MLA attention, dense or MoE FFN)."""
    m = cfg.model
    out = global_specs(cfg)
    for i in range(m.num_layers):
        pre = f"model.layers.{i}"
        out += [same(("layers", i, "attn_norm", "scale"), f"{pre}.input_layernorm.weight", (m.d_model,)),
                same(("layers", i, "ffn_norm", "scale"), f"{pre}.post_attention_layernorm.weight", (m.d_model,))]
        out += mla_specs(cfg, i, names) if m.attention == "mla" else gqa_specs(cfg, i, names)
        if cfg.moe.num_experts and m.is_moe_layer(i):
            out += moe_specs(cfg, i, names, fused=fused_experts)
        else:
            out += mlp_specs(("layers", i, "mlp"), f"{pre}.{names.dense_mlp}", m.d_model, m.mlp_hidden)
    return out


def moe_layer_list(cfg: Config) -> list[int]:
    return [i for i in range(cfg.model.num_layers) if cfg.moe.num_experts and cfg.model.is_moe_layer(i)]


def common_hf(cfg: Config, base: dict) -> dict:
    """config.json fields every family shares, over `base` (the imported config, if any)."""
    m = cfg.model
    out = dict(base)
    out.update(vocab_size=m.vocab_size, hidden_size=m.d_model, num_hidden_layers=m.num_layers,
               num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads, rms_norm_eps=m.norm_eps,
               max_position_embeddings=m.max_seq_len, tie_word_embeddings=m.tie_embeddings,
               rope_parameters=hf_rope(cfg), intermediate_size=m.mlp_hidden, initializer_range=m.init_std)
    out["rope_theta"], out["rope_scaling"] = hf_rope_legacy(cfg)
    if m.head_dim is not None:
        out["head_dim"] = m.head_dim
    return out

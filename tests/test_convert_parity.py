"""Logit parity of imported HF checkpoints against HF transformers itself (PyTorch CPU, fp32).

For every family a tiny random model is built from its transformers config class, saved with
save_pretrained, imported with `import_hf`, and its logits on random tokens are compared with HF's
forward (max abs diff <= 1e-4). The cases vary what breaks conversions: tied/untied embeddings, rope
scaling (linear, yarn, DeepSeek yarn with mscale, llama3), MLA with and without q-LoRA, kv heads <
heads, first-k-dense / mlp-only layers, sharded safetensors, group-limited routing, selection bias,
NoPE + chunked attention. Round trip: import -> export_hf -> transformers loads it -> same logits.
Weights use initializer_range 0.2 so logits are O(1-10) and every path matters.
"""

from __future__ import annotations

import numpy as np
import pytest

import torch  # the hf extra: CI installs it, these tests never skip
import transformers

import jax.numpy as jnp  # noqa: E402

from farskip_jax.convert import export_hf, import_hf  # noqa: E402

VOCAB, TOL = 128, 1e-4
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, intermediate_size=48, initializer_range=0.2)
MEASURED: dict[str, float] = {}


def _cases():
    T = transformers
    return {
        # untied, kv 2 < heads 4, every layer MoE; saved in 3+ shards
        "mixtral": (lambda: T.MixtralConfig(**COMMON, num_hidden_layers=2, num_key_value_heads=2, num_local_experts=4,
                                            num_experts_per_tok=2, tie_word_embeddings=False), "4KB"),
        # tied embeddings, q/k norm over all heads, renormalised top-k
        "olmoe": (lambda: T.OlmoeConfig(**COMMON, num_hidden_layers=2, num_key_value_heads=2, num_experts=4,
                                        num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=True,
                                        pad_token_id=0, eos_token_id=1), None),
        # qkv bias, shared expert gate, one dense (mlp_only) layer, linear rope scaling
        "qwen2_moe": (lambda: T.Qwen2MoeConfig(**COMMON, num_hidden_layers=3, num_key_value_heads=2, num_experts=4,
                                               num_experts_per_tok=2, moe_intermediate_size=16,
                                               shared_expert_intermediate_size=24, mlp_only_layers=[1],
                                               rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
                      None),
        # per-head q/k norm, explicit head_dim, yarn rope, kv 1 (MQA), tied
        "qwen3_moe": (lambda: T.Qwen3MoeConfig(**COMMON, num_hidden_layers=2, num_key_value_heads=1, head_dim=16,
                                               num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16,
                                               norm_topk_prob=True, tie_word_embeddings=True,
                                               max_position_embeddings=256,
                                               rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                                "original_max_position_embeddings": 64}), None),
        # MLA without q-LoRA, first-k-dense 1, group-limited greedy softmax routing, scaling factor
        "deepseek_v2": (lambda: T.DeepseekV2Config(**COMMON, num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=8,
                                                   num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                                                   first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
                                                   qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
                                                   topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                                   routed_scaling_factor=1.5), "6KB"),
        # MLA with q-LoRA, sigmoid + selection bias, group top-2-sum, DeepSeek yarn (mscale_all_dim)
        "deepseek_v3": (lambda: T.DeepseekV3Config(**COMMON, num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=8,
                                                   num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=2,
                                                   first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=12,
                                                   qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6, n_group=4,
                                                   topk_group=2, routed_scaling_factor=2.5, max_position_embeddings=256,
                                                   rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                                    "original_max_position_embeddings": 64, "mscale": 1.0,
                                                                    "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}),
                        None),
        # interleaved dense/MoE, top-1 sigmoid on the expert input, NoPE layer with temperature tuning,
        # chunked attention (chunk 4 < seq), llama3 rope scaling, L2 q/k norm, fused gate_up_proj
        "llama4_text": (lambda: T.Llama4TextConfig(**COMMON, num_hidden_layers=3, num_key_value_heads=2, head_dim=8,
                                                   num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=40,
                                                   moe_layers=[1, 2], no_rope_layers=[1, 0, 1], attention_chunk_size=4,
                                                   floor_scale=4, attn_scale=0.5, max_position_embeddings=256,
                                                   rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0,
                                                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                    "original_max_position_embeddings": 16}), None),
    }


CASES = list(_cases())


@pytest.fixture(scope="module")
def tokens():
    return np.random.RandomState(0).randint(0, VOCAB, size=(2, 16))


def hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


@pytest.fixture(scope="module", params=CASES)
def saved(request, tmp_path_factory):
    """(family, HF folder, HF model) for one case."""
    name = request.param
    make_cfg, shard = _cases()[name]
    torch.manual_seed(0)
    cfg = make_cfg()
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # non-zero selection bias so it matters
        for mod in model.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.normal_(0, 0.1)
    path = tmp_path_factory.mktemp(name) / "hf"
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    return name, str(path), model


def test_parity_and_round_trip(saved, tokens, tmp_path):
    """Import == HF forward; import -> export -> HF loads -> same logits; re-import is identical."""
    name, path, hf = saved
    cfg, model = import_hf(path)
    hc = hf.config
    assert cfg.model.num_layers == hc.num_hidden_layers and cfg.model.vocab_size == VOCAB
    assert cfg.init_from_hf == path
    assert cfg.farskip.preset == "standard"  # standard families import with standard connectivity
    assert cfg.model.tie_embeddings == bool(hc.tie_word_embeddings)

    ref = hf_logits(hf, tokens)
    out = np.asarray(model(jnp.asarray(tokens)).logits)
    diff = float(np.abs(out - ref).max())
    MEASURED[name] = diff
    print(f"\n{name}: max |logits - HF| = {diff:.2e} (logit scale {np.abs(ref).max():.2f})")
    assert np.abs(ref).max() > 0.5  # a meaningful comparison, not two near-zero outputs
    assert diff <= TOL, f"{name}: max abs logit diff {diff} > {TOL}"

    out_dir = export_hf(model, cfg, str(tmp_path / "export"), max_shard_bytes=8000 if name == "mixtral" else None)
    back = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    rt = float(np.abs(hf_logits(back, tokens) - ref).max())
    print(f"{name}: round trip (export -> transformers) max diff {rt:.2e}")
    assert rt <= 1e-6
    _, model2 = import_hf(out_dir)
    assert np.array_equal(np.asarray(model2(jnp.asarray(tokens)).logits), out)


def test_llama4_multimodal_checkpoint_imports_its_text_model(tmp_path, tokens):
    """Llama-4 Scout/Maverick ship as Llama4ForConditionalGeneration: model_type llama4 + text_config,
    tensors under language_model.; the vision tower is skipped and the text logits match."""
    T = transformers
    torch.manual_seed(0)
    text = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, intermediate_size=48, intermediate_size_mlp=40, num_local_experts=4, num_experts_per_tok=1,
                moe_layers=[1], initializer_range=0.2)
    vision = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=28,
                  patch_size=14, vision_output_dim=16, projector_input_dim=16, projector_output_dim=16)
    hf = T.Llama4ForConditionalGeneration(T.Llama4Config(text_config=text, vision_config=vision)).eval()
    hf.save_pretrained(tmp_path / "scout")
    cfg, model = import_hf(str(tmp_path / "scout"))
    ref = hf_logits(hf.language_model, tokens)  # (HF's multimodal forward needs images in 5.24)
    diff = float(np.abs(np.asarray(model(jnp.asarray(tokens)).logits) - ref).max())
    print(f"\nllama4 multimodal (text part): max diff {diff:.2e}")
    assert np.abs(ref).max() > 0.5 and diff <= TOL
    out = export_hf(model, cfg, str(tmp_path / "text"))  # exports the language model alone
    back = T.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(back).__name__ == "Llama4ForCausalLM"
    assert np.abs(hf_logits(back, tokens) - ref).max() <= 1e-6

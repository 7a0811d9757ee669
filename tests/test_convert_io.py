"""Import/export mechanics: error messages, nothing written on failure, CLI, bf16 storage/casting,
sharded placement on a mesh (one tiny Mixtral checkpoint built by transformers)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

import torch  # the hf extra: CI installs it, these tests never skip
import transformers

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from farskip_jax.config import MeshConfig  # noqa: E402
from farskip_jax.convert import SUPPORTED, export_hf, import_hf  # noqa: E402
from farskip_jax.convert.__main__ import main as cli  # noqa: E402
from farskip_jax.errors import CheckpointError  # noqa: E402

VOCAB = 128


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=48, num_local_experts=4,
                                     num_experts_per_tok=2, initializer_range=0.2)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    root = tmp_path_factory.mktemp("mixtral")
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="6KB")
    tokens = np.random.RandomState(0).randint(0, VOCAB, size=(8, 12))
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.numpy()
    return root, model, tokens, ref


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def _edit_config(path, **kv):
    p = os.path.join(path, "config.json")
    with open(p) as f:
        c = json.load(f)
    c.update(kv)
    with open(p, "w") as f:
        json.dump(c, f)


def _edit_tensors(path, fn):
    p = os.path.join(path, "model.safetensors")
    t = load_file(p)
    fn(t)
    save_file(t, p, metadata={"format": "pt"})


def test_unsupported_model_type_lists_supported(mixtral, tmp_path):
    root, *_ = mixtral
    p = _copy(root / "single", tmp_path / "x")
    _edit_config(p, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(CheckpointError, match="unsupported model_type 'gpt2'") as e:
        import_hf(p)
    for t in SUPPORTED:
        assert t in str(e.value)


def test_missing_tensor(mixtral, tmp_path):
    root, *_ = mixtral
    p = _copy(root / "single", tmp_path / "x")
    _edit_tensors(p, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor.*model\.layers\.1\.self_attn\.k_proj\.weight"):
        import_hf(p)


def test_unexpected_tensor(mixtral, tmp_path):
    root, *_ = mixtral
    p = _copy(root / "single", tmp_path / "x")
    _edit_tensors(p, lambda t: t.__setitem__("model.layers.0.self_attn.mystery.weight", torch.zeros(2, 2)))
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*mystery"):
        import_hf(p)


def test_shape_mismatch_names_tensor_expected_and_found(mixtral, tmp_path):
    root, *_ = mixtral
    p = _copy(root / "single", tmp_path / "x")
    _edit_config(p, intermediate_size=40)
    with pytest.raises(CheckpointError, match=r"shape mismatch for 'model\.layers\.0\.block_sparse_moe\.experts\.0\.w1\.weight'"
                                              r": expected \(40, 32\).*found \(48, 32\)"):
        import_hf(p)


def test_missing_shard_file(mixtral, tmp_path):
    root, *_ = mixtral
    p = _copy(root / "sharded", tmp_path / "x")
    shards = sorted(f for f in os.listdir(p) if f.endswith(".safetensors"))
    assert len(shards) > 2
    os.remove(os.path.join(p, shards[1]))
    with pytest.raises(CheckpointError, match=shards[1]):
        import_hf(p)


def test_sharded_equals_single(mixtral):
    root, _, tokens, ref = mixtral
    _, m = import_hf(str(root / "sharded"))
    assert np.abs(np.asarray(m(jnp.asarray(tokens)).logits) - ref).max() <= 1e-4


def test_cli_import_export_and_nothing_written_on_failure(mixtral, tmp_path, capsys):
    root, _, tokens, ref = mixtral
    broken = _copy(root / "single", tmp_path / "broken")
    _edit_tensors(broken, lambda t: t.pop("model.norm.weight"))
    out = tmp_path / "ours"
    assert cli(["import", broken, str(out)]) == 2
    assert "model.norm.weight" in capsys.readouterr().err
    assert not out.exists() and not [f for f in os.listdir(tmp_path) if f.startswith(".import-")]

    (root / "single" / "tokenizer.json").write_text('{"version": "1.0"}')
    assert cli(["import", str(root / "single"), str(out)]) == 0
    assert "[1/" in capsys.readouterr().out  # progress per tensor
    assert {"config.yaml", "params.safetensors", "hf_config.json", "tokenizer.json"} <= set(os.listdir(out))
    assert cli(["import", str(root / "single"), str(out)]) == 2  # exists, no --overwrite
    hf_out = tmp_path / "hf"
    assert cli(["export", str(out), str(hf_out), "--max-shard-size", "10KB"]) == 0
    assert os.path.isfile(hf_out / "model.safetensors.index.json") and os.path.isfile(hf_out / "tokenizer.json")
    back = transformers.AutoModelForCausalLM.from_pretrained(str(hf_out), dtype=torch.float32).eval()
    with torch.no_grad():
        assert np.abs(back(torch.tensor(tokens)).logits.numpy() - ref).max() == 0.0


def test_export_failure_leaves_nothing(mixtral, tmp_path, monkeypatch):
    root, *_ = mixtral
    cfg, model = import_hf(str(root / "single"))
    import farskip_jax.convert.export as ex

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ex, "write_file", boom)
    with pytest.raises(OSError):
        export_hf(model, cfg, str(tmp_path / "out"))
    assert os.listdir(tmp_path) == []
    with pytest.raises(CheckpointError, match="base_config"):
        export_hf(model, cfg.__class__(model=cfg.model, moe=cfg.moe), str(tmp_path / "out"))


def test_bf16_checkpoint_and_bf16_params(mixtral, tmp_path):
    root, model, tokens, _ = mixtral
    p = str(tmp_path / "bf16")
    model.to(torch.bfloat16).save_pretrained(p)
    model.to(torch.float32)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = ref_model(torch.tensor(tokens)).logits.numpy()
    cfg32, m32 = import_hf(p)
    w = ref_model.model.layers[0].self_attn.q_proj.weight.detach().numpy().T
    assert np.array_equal(np.asarray(m32.layers[0].attn.q_proj.w[...]), w)  # bf16 -> fp32 is exact
    cfg16, m16 = import_hf(p, dtype="bfloat16")
    assert cfg16.runtime.param_dtype == "bfloat16" and m16.layers[0].attn.q_proj.w[...].dtype == jnp.bfloat16
    for m in (m32, m16):  # fp32 compute on bf16-representable weights == HF fp32 forward
        assert np.abs(np.asarray(m(jnp.asarray(tokens)).logits) - ref).max() <= 1e-4
    out = export_hf(m16, cfg16, str(tmp_path / "exp16"), dtype="bfloat16")
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert np.array_equal(back(torch.tensor(tokens)).logits.numpy(), ref)


def test_import_onto_mesh_shards_experts(mixtral):
    from farskip_jax.parallel.mesh import make_mesh

    root, _, tokens, ref = mixtral
    mesh = make_mesh(MeshConfig(data=2, expert=4))
    cfg, m = import_hf(str(root / "single"), mesh=mesh, overrides={"runtime.dispatch": "all_to_all", "mesh.data": 2,
                                                                    "mesh.expert": 4})
    w = m.layers[0].moe.experts.w_gate[...]
    assert w.sharding.spec[0] == "expert" and len(w.addressable_shards) == 8
    assert w.addressable_shards[0].data.shape[0] == 1  # each device holds 1 of the 4 experts
    out = jax.jit(lambda t: m(t).logits)(jnp.asarray(tokens))
    assert np.abs(np.asarray(out) - ref).max() <= 1e-4


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_export_from_scratch_with_family(family, tmp_path):
    """A model with no source config.json (init_from_hf unset) exports by family model_type alone."""
    from flax import nnx

    from farskip_jax.config import Config, replace
    from farskip_jax.loading.families import family_by_name
    from farskip_jax.model import Transformer

    fam = family_by_name(family)
    hf = dict(model_type=family, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=48, num_experts=4, n_routed_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
              qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, head_dim=8, initializer_range=0.2)
    from farskip_jax.config import from_dict

    cfg = from_dict(Config, fam.config_tree(hf))
    cfg = replace(cfg, **{"model.init_std": 0.2})
    model = Transformer(cfg, rngs=nnx.Rngs(3))
    if family == "deepseek_v3":
        b = model.layers[1].moe.router.bias
        b.set_value(jax.random.normal(jax.random.key(1), b.get_value().shape) * 0.1)
    with pytest.raises(CheckpointError, match="family"):
        export_hf(model, cfg, str(tmp_path / "x"))
    out = export_hf(model, cfg, str(tmp_path / "out"), family=family)
    tokens = np.random.RandomState(0).randint(0, VOCAB, size=(2, 12))
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = back(torch.tensor(tokens)).logits.numpy()
    assert np.abs(np.asarray(model(jnp.asarray(tokens)).logits) - ref).max() <= 1e-4


def test_quantized_checkpoint_is_refused(mixtral, tmp_path):
    root, *_ = mixtral
    p = _copy(root / "single", tmp_path / "x")
    _edit_config(p, quantization_config={"quant_method": "fp8"})
    with pytest.raises(CheckpointError, match="quantized checkpoints \\(fp8\\)"):
        import_hf(p)

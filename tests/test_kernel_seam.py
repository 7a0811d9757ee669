"""The CPU-kernel seam: model/ never imports the CPU kernels (farskip_jax.kernels.cpu) and kernels/
never imports model/, a GPU program built with the kernels
enabled in config contains none of their custom calls, and a CPU program does (so the test can fail)."""

import ast
import re
from pathlib import Path

import jax
import pytest

from farskip_jax.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.d_model=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2", "model.vocab_size=64",
        "model.mlp_hidden=64", "model.max_seq_len=16", "moe.num_experts=8", "moe.top_k=2", "moe.expert_hidden=32",
        "moe.num_shared_experts=1", "train.seq_len=16", "train.batch_size=8", "kernels.enabled=true"]


def _targets(text: str) -> set[str]:
    """The project's FFI targets named by custom calls in a lowered (StableHLO) or compiled (HLO) text."""
    from farskip_jax.kernels import FFI_TARGETS

    named = set(re.findall(r"custom_call @([\w.]+)\(", text)) | set(re.findall(r'custom_call_target="([^"]+)"', text))
    return named & set(FFI_TARGETS)


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out += [f"{node.module}.{a.name}" for a in node.names]
    return out


def test_model_never_imports_the_cpu_kernels_and_kernels_never_import_the_model():
    for path in sorted((ROOT / "farskip_jax" / "model").glob("*.py")):
        mods = _imports(path)
        assert not any(m.startswith("farskip_jax.kernels.cpu") for m in mods), f"{path.name} imports {mods}"
    for path in sorted((ROOT / "farskip_jax" / "kernels").rglob("*.py")):
        mods = _imports(path)
        assert not any(m.startswith("farskip_jax.model") for m in mods), f"{path.name} imports {mods}"


def _train_text(cfg, devices) -> str:
    from farskip_jax.analysis.programs import analysis_mesh, train_program

    fn, args = train_program(cfg, analysis_mesh(cfg, devices), batch=8, seq=16)
    return fn.lower(*args).as_text()


def test_gpu_train_step_has_no_cpu_kernels_and_the_cpu_one_has(h100x8, monkeypatch, kernels_config):
    """Same config, kernels enabled: the train step lowered for 8 compile-only H100s (expert parallel)
    names none of the FFI targets; lowered for one CPU device it runs the experts, the attention core
    and the projections on them. The dense matmul is let in as if the process had one device, so
    only the platform keeps it out of the GPU program."""
    from farskip_jax.kernels.cpu import dispatch

    monkeypatch.setattr(dispatch, "process_devices", lambda: 1)
    gpu_cfg = load_config(None, TINY + ["mesh.expert=8", "runtime.dispatch=all_to_all"])
    assert gpu_cfg.kernels.enabled and gpu_cfg.runtime.gmm == "auto" and gpu_cfg.runtime.attention_impl == "auto"
    gpu = _train_text(gpu_cfg, h100x8)
    assert "all_to_all" in gpu and "ragged_dot" in gpu  # an expert-parallel GPU step, ragged_dot experts
    assert not _targets(gpu), _targets(gpu)
    cpu = _train_text(load_config(None, TINY), jax.devices("cpu")[:1])
    assert {"farskip_gmm", "farskip_tgmm", "farskip_attention_fwd", "farskip_attention_bwd"} <= _targets(cpu)


def test_kernels_disabled_in_config_give_plain_jax_on_cpu(kernels_config):
    """kernels.enabled: false (installed by config_on, as every model build does): the CPU program holds
    no custom call, `auto` means tiled / naive, and asking for a kernel by name is one clear error."""
    from farskip_jax.kernels.attention import resolve_attention_impl
    from farskip_jax.kernels.gmm import resolve_backend

    cfg = load_config(None, TINY[:-1] + ["kernels.enabled=false"])
    assert not _targets(_train_text(cfg, jax.devices("cpu")[:1]))
    assert resolve_backend("auto", "cpu") == "tiled" and resolve_attention_impl("auto", "cpu") == "naive"
    with pytest.raises(ValueError, match="runtime.gmm='blas' is not available.*kernels.enabled: true"):
        resolve_backend("blas", "cpu")

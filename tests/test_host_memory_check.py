"""A CPU run whose state cannot fit in host memory is refused before anything is loaded or written."""

import os

import pytest

from farskip_jax.config import load_config
from farskip_jax.errors import ConfigError
from farskip_jax.train import host_memory_check
from farskip_jax.train.flops import total_params
from farskip_jax.train.trainer import train


def test_state_bytes_is_sixteen_per_parameter_plus_the_teacher():
    pre = load_config("configs/tiny.yaml")
    fcsd = load_config("configs/tiny.yaml", ["train.mode=distill", "distill.teacher_dtype=bfloat16"])
    assert host_memory_check.state_bytes(pre) == 16 * total_params(pre)
    assert host_memory_check.state_bytes(fcsd) == 18 * total_params(fcsd)


def test_too_little_memory_names_the_need_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(host_memory_check, "available_bytes", lambda: 1 << 20)  # 1 MiB
    cfg = load_config("configs/tiny.yaml", [f"train.run_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=r"this run needs at least .* GiB of host memory .* this machine has 0.0 GiB "
                                          r"available: run it on accelerators"):
        train(cfg)
    assert not os.path.exists(tmp_path / "run")


def test_enough_memory_passes():
    cfg = load_config("configs/tiny.yaml")
    host_memory_check.check_host_memory(cfg, "this run", available=host_memory_check.state_bytes(cfg) + 1)

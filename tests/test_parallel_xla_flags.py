"""XLA flag presets: every flag is known to the installed jaxlib, user flags win, and applying a
preset after JAX started is refused."""

import os
import subprocess
import sys

import jax
import pytest

from farskip_jax.errors import BackendError, ConfigError
from farskip_jax.parallel.xla_flags import PRESETS, apply_xla_preset, merge_flags, preset_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_preset_parses_in_a_fresh_jax():
    # an unknown flag makes XLA abort at start-up; GPU flags are parsed (and ignored) by XLA:CPU too
    code = ("import os, sys; from farskip_jax.parallel.xla_flags import apply_xla_preset; "
            "[apply_xla_preset(p) for p in sys.argv[1:]]; "
            "import jax, jax.numpy as jnp; print(float(jnp.ones(3).sum()))")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    for name in PRESETS:
        r = subprocess.run([sys.executable, "-c", code, name], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.strip() == "3.0", (name, r.stderr[-2000:])


def test_every_flag_has_a_reason():
    for name, flags in PRESETS.items():
        for flag, value, why in flags:
            assert flag.startswith("xla_") and len(why) > 20, (name, flag)
    rocm = dict((f, v) for f, v, _ in PRESETS["rocm_mi300"])
    assert rocm["xla_gpu_enable_latency_hiding_scheduler"] == "true"  # off by default on ROCm


def test_user_flags_win_and_device_count():
    env = {"XLA_FLAGS": "--xla_gpu_experimental_parallel_collective_overlap_limit=4"}
    out = apply_xla_preset("cuda_hopper", host_devices=8, env=env)
    assert "--xla_gpu_experimental_parallel_collective_overlap_limit=4" in out
    assert "overlap_limit=2" not in out
    assert "--xla_force_host_platform_device_count=8" in out
    assert merge_flags("--a=1", ["--a=2", "--b=3"]) == "--a=1 --b=3"


def test_unknown_preset_and_late_application():
    with pytest.raises(ConfigError, match="cuda_hopper"):
        preset_flags("cuda")
    jax.devices()
    with pytest.raises(BackendError, match="before JAX starts"):
        apply_xla_preset("cpu")

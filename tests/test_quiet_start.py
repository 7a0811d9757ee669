"""No CUDA-plugin noise on a machine without a GPU (farskip_jax/quiet_start.py), and the deviceless GPU
compiles of analysis/ still work there."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from farskip_jax.quiet_start import drop_noise, noisy_machine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOISE = ("cudart_stub", "Jax plugin configuration error", "Unable to load CUDA", "Traceback", "absl::InitializeLog")


def _clean_env() -> dict:
    """The environment of a user's shell: none of the test suite's JAX settings."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "TF_CPP_MIN_LOG_LEVEL")}
    env["PYTHONPATH"] = ROOT
    return env


def test_drop_noise_keeps_every_other_line():
    text = ("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
            "I0000 00:00:1796159297.639150    4777 cudart_stub.cc:31] Could not find cuda drivers on your machine, "
            "GPU will not be used.\n"
            "a real warning\n"
            "E0000 something else from C++\n")
    assert drop_noise(text) == "a real warning\nE0000 something else from C++\n"


@pytest.mark.skipif(not noisy_machine(), reason="needs the CUDA plugin installed on a machine without a GPU")
def test_cpu_machine_prints_no_cuda_noise_and_still_compiles_for_gpus():
    code = ("import farskip_jax, jax, jax.numpy as jnp\n"
            "print(jax.devices())\n"
            "from farskip_jax.analysis.deviceless import gpu_devices\n"
            "d = gpu_devices('h100_sxm', 8)\n"
            "s = jax.sharding.SingleDeviceSharding(d[0])\n"
            "c = jax.jit(lambda x: x @ x).lower(jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=s)).compile()\n"
            "print('gpu program', 'custom-call' in c.as_text() or 'dot' in c.as_text())\n")
    p = subprocess.run([sys.executable, "-c", code], env=_clean_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "CpuDevice" in p.stdout and "gpu program True" in p.stdout
    assert not [n for n in NOISE if n in p.stderr], p.stderr


@pytest.mark.skipif(not noisy_machine(), reason="needs the CUDA plugin installed on a machine without a GPU")
def test_train_cli_error_is_one_line(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs/tiny.yaml"),
                        "data.source=text", "data.paths=[/nonexistent/*.txt]", f"train.run_dir={tmp_path / 'run'}"],
                       env=_clean_env(), capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [p.stderr.strip()] and p.stderr.startswith("error: data.paths="), p.stderr
    assert not (tmp_path / "run").exists()

"""Test setup: 8 host CPU devices and CPU-only JAX, fixed before JAX is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"  # keeps tests on the CPU when a GPU plugin is installed
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import farskip_jax  # noqa: E402,F401  (before jax: no CUDA-plugin noise on CPU machines, quiet_start.py)
import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

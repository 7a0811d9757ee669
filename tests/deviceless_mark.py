"""The mark of the tests that compile deviceless for GPUs (the compile-only CUDA plugin; CI installs it)."""

import importlib.util
import os

import pytest

HAS_CUDA_PLUGIN = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
gpu = pytest.mark.skipif(not HAS_CUDA_PLUGIN and not os.environ.get("CI"),
                         reason="needs the compile-only CUDA plugin (jax-cuda12-plugin) for deviceless compiles")

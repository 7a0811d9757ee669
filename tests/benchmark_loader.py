"""What the tests of benchmarks/ scripts share: loading a script as a module, and the mark of the
tests that compile deviceless for GPUs (the compile-only CUDA plugin; CI installs it)."""

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_CUDA_PLUGIN = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
gpu = pytest.mark.skipif(not HAS_CUDA_PLUGIN and not os.environ.get("CI"),
                         reason="needs the compile-only CUDA plugin (jax-cuda12-plugin) for deviceless compiles")


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module (benchmarks/ on sys.path for its own imports)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

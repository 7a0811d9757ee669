"""Test setup: 8 host CPU devices and CPU-only JAX, fixed before JAX is imported anywhere."""

import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"  # keeps tests on the CPU when a GPU plugin is installed
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# One persistent compilation cache for the whole test run (both xdist workers and every subprocess they
# start): the many tests that run the same tiny config compile its step once. A new run starts cold.
# xdist workers and subprocesses inherit the controller's variable; the controller removes the folder at the end.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="farskip_jax_test_cache_"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

import farskip_jax  # noqa: E402,F401  (before jax: no CUDA-plugin noise on CPU machines, quiet_start.py)
import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from farskip_jax import kernels  # noqa: E402
from farskip_jax.config import kernels_from_env  # noqa: E402

# the CPU kernels as a run gets them from its config (parallel/build.config_on installs cfg.kernels);
# tests that build a Transformer by hand see the same backends
kernels.install(kernels_from_env())


import pytest  # noqa: E402


def pytest_sessionfinish(session):
    if _OWN_CACHE and not hasattr(session.config, "workerinput"):  # the controller (or a run without xdist)
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(scope="module")
def tiny():
    """(cfg, model, graphdef, {params, bias, rest}) of a 2-layer byte-level MoE with scaled-up weights
    (opinionated predictions), for the scoring tests (test_eval.py, test_lm_eval_real.py)."""
    from flax import nnx

    from farskip_jax.config import Config, ModelConfig, MoEConfig, TrainConfig
    from farskip_jax.model.transformer import Transformer
    from farskip_jax.loading.train_state import split_model

    cfg = Config(model=ModelConfig(vocab_size=320, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1,
                                   mlp_hidden=64, max_seq_len=64),
                 moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=32), train=TrainConfig(seq_len=32))
    model = Transformer(cfg, rngs=nnx.Rngs(1))
    nnx.update(model, jax.tree.map(lambda x: x * 5.0, nnx.state(model, nnx.Param)))
    graphdef, params, bias, rest = split_model(model)
    return cfg, model, graphdef, dict(params=params, bias=bias, rest=rest)


@pytest.fixture
def nan_at_steps(monkeypatch):
    """inject(*steps): every train step a session builds from then on (train/loop.py's make_step, for
    pretraining and FCSD alike) has a NaN loss and gradient at those 1-based updates
    (run_helpers.nan_at); undone after the test."""
    from run_helpers import nan_at

    from farskip_jax.train import loop

    def inject(*steps):
        real = loop.make_step
        monkeypatch.setattr(loop, "make_step", lambda *a, **k: nan_at(real(*a, **k), steps))

    return inject


@pytest.fixture
def kernels_config():
    """set(**kernels keys): install the session's kernels section with those keys changed for this
    test; the session's section is installed again afterwards."""
    import dataclasses

    from farskip_jax.kernels.cpu import library

    before = library.settings()
    yield lambda **changes: kernels.install(dataclasses.replace(before, **changes))
    kernels.install(before)


@pytest.fixture(scope="session")
def h100x8():
    """8 compile-only H100s for deviceless GPU compiles; skipped where the CUDA plugin is missing,
    never in CI (which installs it)."""
    from farskip_jax.analysis.deviceless import gpu_devices
    from farskip_jax.errors import BackendError

    try:
        return gpu_devices("h100_sxm", 8)
    except BackendError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(e))

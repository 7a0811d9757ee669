"""2 processes x 4 CPU devices (gloo collectives) give the same step as 1 process x 8 devices."""

import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

import multihost_worker as mw
from farskip_jax.config import MeshConfig
from farskip_jax.parallel import create_model, make_mesh
from farskip_jax.parallel.distributed import maybe_initialize, wants_distributed

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multihost_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one(tmp_path):
    port = _free_port()
    out = tmp_path / "r.npz"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COORDINATOR_ADDRESS")}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(WORKER)), env.get("PYTHONPATH", "")])
    procs = [
        subprocess.Popen([sys.executable, WORKER, "--process-id", str(i), "--num-processes", "2", "--port", str(port),
                          "--local-devices", "4", "--ep", "4", "--out", str(out)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)
    ]
    try:
        logs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    multi = dict(np.load(out))
    assert int(multi.pop("process_count")) == 2

    # the same step in this process: 1 process x 8 devices, same mesh shape (data 2 x expert 4)
    cfg = mw.tiny_config(ep=4, num_layers=1)
    single = mw.step_summary(create_model(cfg, make_mesh(cfg.mesh), seed=0), mw.tokens())
    assert sorted(multi) == sorted(single)
    assert int(multi["dropped"]) == int(single["dropped"]) == 0
    np.testing.assert_allclose(multi["loss"], single["loss"], rtol=1e-6)
    for k in single:
        if k.startswith("grad"):
            scale = np.abs(single[k]).max()
            assert scale > 0, k
            np.testing.assert_allclose(multi[k], single[k], rtol=1e-5, atol=1e-5 * scale, err_msg=k)


def test_single_process_stays_single(monkeypatch):
    for k in ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert not wants_distributed(MeshConfig())
    assert not maybe_initialize(MeshConfig())
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert wants_distributed(MeshConfig())
    assert not wants_distributed(MeshConfig(distributed="off"))
    assert wants_distributed(MeshConfig(coordinator_address="10.0.0.1:1234"))


def test_initialize_after_backend_start_is_refused():
    from farskip_jax.errors import BackendError

    jax.devices()  # the test process's backend is running
    with pytest.raises(BackendError, match="before JAX touches a device"):
        maybe_initialize(MeshConfig(distributed="on", coordinator_address="127.0.0.1:1", num_processes=2, process_id=0))

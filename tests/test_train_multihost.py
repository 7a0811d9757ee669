"""Multi-host pretraining: `train.py` on 2 processes x 4 CPU devices (gloo) follows the same loss
curve as 1 process x 8 devices (each process feeds its rows of the same global batches)."""

import json
import os
import socket
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 6
COMMON = ["model.num_layers=1", "model.d_model=64", "moe.expert_hidden=64", "model.mlp_hidden=128",
          f"train.steps={STEPS}", "train.batch_size=8", "train.seq_len=32", "train.warmup_steps=2",
          "train.eval_every=0", "train.log_every=1", "train.tensorboard=false", "train.peak_flops=1e11",
          "train.checkpoint_every=3"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COORDINATOR_ADDRESS")}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    return np.array([r["loss"] for r in recs if r["kind"] == "train"])


def test_two_processes_follow_the_one_process_loss_curve(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs/tiny.yaml"), *COMMON]
    one = tmp_path / "one"
    p = subprocess.run(cmd + [f"train.run_dir={one}"], env=_env(8), capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "8 device(s), 1 process(es)" in p.stdout

    two, port = tmp_path / "two", _free_port()
    procs = [subprocess.Popen(cmd + [f"train.run_dir={two}", "mesh.distributed='on'", "mesh.num_processes=2",
                                     f"mesh.process_id={i}", f"mesh.coordinator_address=127.0.0.1:{port}"],
                              env=_env(4), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
             for i in range(2)]
    try:
        logs = [q.communicate(timeout=300)[0] for q in procs]
    finally:
        for q in procs:
            if q.poll() is None:
                q.kill()
    for q, log in zip(procs, logs):
        assert q.returncode == 0, log[-4000:]
    assert "8 device(s), 2 process(es)" in logs[0]
    a, b = _losses(one), _losses(two)
    assert len(a) == len(b) == STEPS and a[-1] < a[0]
    np.testing.assert_allclose(b, a, rtol=2e-5)
    assert os.path.isfile(two / "checkpoints" / str(STEPS) / "commit_success.txt")

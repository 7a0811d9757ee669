"""Multi-host pretraining: `train.py` on 2 processes x 4 CPU devices (gloo) follows the same loss
curve as 1 process x 8 devices (each process feeds its rows of the same global batches); the digest of
a checkpoint the two wrote covers both processes' files, and (extended) a damaged step is refused by
both processes when they resume."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

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


CMD = [sys.executable, os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs/tiny.yaml"), *COMMON]


def _two_processes(run_dir, *extra):
    """(return codes, logs) of train.py on 2 processes x 4 devices."""
    port = _free_port()
    procs = [subprocess.Popen(CMD + [f"train.run_dir={run_dir}", "mesh.distributed='on'", "mesh.num_processes=2",
                                     f"mesh.process_id={i}", f"mesh.coordinator_address=127.0.0.1:{port}", *extra],
                              env=_env(4), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
             for i in range(2)]
    try:
        logs = [q.communicate(timeout=300)[0] for q in procs]
    finally:
        for q in procs:
            if q.poll() is None:
                q.kill()
    return [q.returncode for q in procs], logs


def test_two_processes_follow_the_one_process_loss_curve(tmp_path):
    from farskip_jax.loading.checkpoint import Checkpointer

    one = tmp_path / "one"
    p = subprocess.run(CMD + [f"train.run_dir={one}"], env=_env(8), capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "8 device(s), 1 process(es)" in p.stdout

    two = tmp_path / "two"
    codes, logs = _two_processes(two)
    for code, log in zip(codes, logs):
        assert code == 0, log[-4000:]
    assert "8 device(s), 2 process(es)" in logs[0]
    a, b = _losses(one), _losses(two)
    assert len(a) == len(b) == STEPS and a[-1] < a[0]
    np.testing.assert_allclose(b, a, rtol=2e-5)
    assert os.path.isfile(two / "checkpoints" / str(STEPS) / "commit_success.txt")
    ck = Checkpointer(str(two))  # the digest written by process 0 covers both processes' files
    names = set(json.load(open(os.path.join(ck.data_dir, str(STEPS), "digest.json")))["files"])
    assert {"data_state/process_0.json", "data_state/process_1.json"} <= names
    assert any("ocdbt.process_1/" in n for n in names) and ck.check(STEPS) is None


@pytest.mark.extended
def test_both_processes_share_the_check_of_a_step_and_refuse_a_damaged_one_when_they_resume(tmp_path):
    """Each process hashes half of the step's blocks and they agree (a collective): a good step resumes,
    a damaged one is refused by both, naming the same step and the earlier good one."""
    run = tmp_path / "two"
    codes, logs = _two_processes(run, f"train.steps={STEPS - 1}")
    assert codes == [0, 0], logs[0][-3000:]
    codes, logs = _two_processes(run)
    assert codes == [0, 0] and f"resumed from checkpoint step {STEPS - 1}" in logs[0], logs[0][-3000:]  # process 0 logs
    step_dir = run / "checkpoints" / str(STEPS) / "state"
    big = max((os.path.join(d, f) for d, _, fs in os.walk(step_dir) for f in fs), key=os.path.getsize)
    with open(big, "r+b") as f:
        f.seek(os.path.getsize(big) // 2)
        f.write(b"\xff" * 4096)
    codes, logs = _two_processes(run, f"train.steps={STEPS + 3}")
    assert codes == [2, 2], [log[-2000:] for log in logs]
    for log in logs:
        assert f"checkpoint step {STEPS} in " in log and f"train.resume_step={STEPS - 1}" in log, log[-2000:]

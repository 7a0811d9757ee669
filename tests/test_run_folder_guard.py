"""A run folder cannot be corrupted: one run holds it at a time (a crashed run leaves no stale lock),
a folder that cannot be written is refused before anything starts, a checkpoint that fails to write
leaves nothing partial and names the step to resume from, a resumed run logs each step once, and the
run opens with a short summary (the resolved config is in the folder)."""

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

from cli_helpers import REPO, cli, train_args

from farskip_jax.config import load_config
from farskip_jax.errors import CheckpointError, ConfigError
from farskip_jax.train import rundir
from farskip_jax.loading.checkpoint import Checkpointer
from farskip_jax.train.logger import drop_records_after, read_metrics
from farskip_jax.train.trainer import train

TINY = ["model.num_layers=1", "model.d_model=32", "model.mlp_hidden=64", "moe.expert_hidden=32", "train.batch_size=8",
        "train.seq_len=16", "train.eval_batches=1", "train.tensorboard=false", "train.peak_flops=1e9",
        "train.log_every=1", "train.eval_every=0", "train.warmup_steps=1"]


def test_a_running_run_holds_its_folder_and_a_killed_one_leaves_no_stale_lock(tmp_path):
    run = str(tmp_path / "run")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    first = subprocess.Popen([sys.executable, *train_args(run, "train.steps=100000", "train.checkpoint_every=0")],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in first.stdout:  # the first run is stepping: it holds the folder
            if line.startswith("step "):
                break
        else:
            raise AssertionError("the first run ended before its first step")
        r = cli(*train_args(run, "train.steps=100000", "train.checkpoint_every=0"))
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr[-3000:])
        assert re.match(r"error: train.run_dir=.* is in use by another run \(process \d+ on .*\)", lines[0]), lines[0]
    finally:
        first.send_signal(signal.SIGKILL)  # a crash: no clean-up, no release
        first.wait()
    r = cli(*train_args(run))  # the kernel dropped the lock with the process: the folder is usable
    assert r.returncode == 0, r.stderr[-3000:]


def test_the_same_process_may_claim_again_and_another_may_not_while_held(tmp_path):
    cfg = load_config("configs/tiny.yaml", [f"train.run_dir={tmp_path / 'r'}", *TINY])
    folder = rundir.check_run_dir(cfg)
    rundir.claim_run_dir(cfg, folder)
    try:
        rundir.check_run_dir(cfg)  # this process holds it: no refusal
        probe = subprocess.run([sys.executable, "-c", (
            "import sys; sys.path.insert(0, sys.argv[1]); from farskip_jax.config import load_config; "
            "from farskip_jax.train.rundir import check_run_dir; from farskip_jax.errors import ConfigError\n"
            "try:\n    check_run_dir(load_config(None, ['train.run_dir=' + sys.argv[2]]))\n"
            "except ConfigError as e:\n    print(e)"), REPO, str(tmp_path / "r")],
            capture_output=True, text=True, timeout=120)
        assert "is in use by another run" in probe.stdout, probe.stdout + probe.stderr
    finally:
        rundir.release_run_dir(str(tmp_path / "r"))


def test_an_unwritable_run_folder_is_refused_before_anything_starts(tmp_path, monkeypatch):
    parent = tmp_path / "ro"
    parent.mkdir()
    real = os.access
    monkeypatch.setattr(rundir.os, "access", lambda p, mode: False if str(p).startswith(str(parent)) else real(p, mode))
    cfg = load_config("configs/tiny.yaml", [f"train.run_dir={parent / 'deep' / 'run'}", *TINY])
    with pytest.raises(ConfigError, match=r"cannot be written \(.*ro: (no write permission|a read-only file system)\)"):
        rundir.check_run_dir(cfg)
    assert os.listdir(parent) == []


def test_a_failed_checkpoint_write_leaves_nothing_partial_and_names_the_resume_step(tmp_path):
    import jax.numpy as jnp

    ck = Checkpointer(str(tmp_path), keep=3, async_save=False)
    state = {"w": jnp.arange(4.0)}
    ck.save(1, state, {"pos": 1})

    def full_disk(step, *a, **k):
        os.makedirs(os.path.join(ck.dir, f"{step}.orbax-checkpoint-tmp-1234"))
        raise OSError(28, "No space left on device")

    ck.mngr.save = full_disk
    with pytest.raises(CheckpointError, match=r"step 2 could not be written .*No space left on device.*resumes from step 1"):
        ck.save(2, state, {"pos": 2})
    assert sorted(os.listdir(ck.dir)) == ["1", "data_state"]
    assert sorted(d for d in os.listdir(ck.data_dir) if d.isdigit()) == ["1"]
    assert ck.latest_step() == 1


def test_a_resumed_run_logs_each_step_once_and_opens_with_a_short_summary(tmp_path):
    run = tmp_path / "run"
    cfg = load_config("configs/tiny.yaml", [f"train.run_dir={run}", "train.steps=4", "train.checkpoint_every=2", *TINY])
    out = io.StringIO()
    train(cfg, stream=out)
    text = out.getvalue()
    assert "the whole resolved config: " + os.path.join(str(run), "config.yaml") in text
    assert len(text.splitlines()) < 20 and "resolved config:\n" not in text
    shutil.rmtree(run / "checkpoints" / "4")  # a crash before step 4's checkpoint was written
    shutil.rmtree(run / "checkpoints" / "data_state" / "4")
    train(cfg, stream=io.StringIO())  # resumes from step 2, runs 3 and 4 again
    steps = [r["step"] for r in read_metrics(str(run), "train")]
    assert steps == [1, 2, 3, 4]


def test_drop_records_after_keeps_earlier_records_and_unparsable_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    recs = [{"kind": "train", "step": s} for s in (1, 2, 3)] + [{"kind": "eval", "step": 3}]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + "not json\n")
    assert drop_records_after(str(tmp_path), 2) == 2
    assert path.read_text().splitlines() == [json.dumps(recs[0]), json.dumps(recs[1]), "not json"]

"""Checkpoints: exact resume after SIGKILL and SIGTERM, and half-written checkpoints never picked.

One run goes straight to N steps (in a subprocess). A second run of the same config is SIGKILLed
somewhere after its first checkpoint, resumed (from the last complete checkpoint, re-doing the lost
steps), SIGTERMed (it saves at the next step boundary and exits 0) and resumed again to N. Its
per-step losses and final parameters must equal the straight run bit for bit (CPU).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 16
OVERRIDES = ["model.num_layers=1", "model.d_model=64", "moe.expert_hidden=64", "model.mlp_hidden=128",
             f"train.steps={STEPS}", "train.batch_size=8", "train.seq_len=64", "train.warmup_steps=4",
             "train.eval_every=0", "train.log_every=1", "train.checkpoint_every=3", "train.keep_checkpoints=2",
             "train.tensorboard=false", "moe.selection_bias=true", "train.peak_flops=1e11"]


def _cmd(run_dir):
    return [sys.executable, os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs/tiny.yaml"),
            *OVERRIDES, f"train.run_dir={run_dir}"]


def _env(cache):
    env = dict(os.environ)
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache)  # resumed processes reuse the compiled step
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return env


def _train_records(run_dir):
    """Last record of each step (a resumed run re-does the steps after its checkpoint)."""
    by_step = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r["kind"] == "train":
                by_step[r["step"]] = r
    return by_step


def _run(run_dir, env, *extra):
    p = subprocess.run(_cmd(run_dir) + list(extra), capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


def _has_complete_checkpoint(run_dir):
    d = os.path.join(run_dir, "checkpoints")
    # only a finalized step folder ("3"), not orbax's temporary one ("3.orbax-checkpoint-tmp-..."), which
    # can hold commit_success.txt before its rename: a SIGKILL then leaves no step to resume from
    return os.path.isdir(d) and any(s.isdigit() and os.path.isfile(os.path.join(d, s, "commit_success.txt"))
                                    for s in os.listdir(d))


def _run_until(run_dir, env, min_step, sig):
    """Start a run, send `sig` once metrics.jsonl shows step >= min_step and some checkpoint is complete;
    return (rc, stdout, step seen)."""
    p = subprocess.Popen(_cmd(run_dir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    seen, deadline = 0, time.time() + 240
    path = os.path.join(run_dir, "metrics.jsonl")
    while time.time() < deadline and p.poll() is None:
        if os.path.isfile(path):
            recs = _train_records(run_dir)
            seen = max(recs) if recs else 0
            if seen >= min_step and _has_complete_checkpoint(run_dir):
                p.send_signal(sig)
                break
        time.sleep(0.01)
    out, _ = p.communicate(timeout=240)
    return p.returncode, out, seen


def _final_params(run_dir):
    from farskip_jax.loading.checkpoint import Checkpointer

    ck = Checkpointer(run_dir, keep=10)
    step = ck.latest_step()
    import orbax.checkpoint as ocp

    restored = ck.mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    ck.close()
    return step, {k: np.asarray(v) for k, v in restored["state"].items()}


@pytest.mark.slow
def test_resume_after_sigkill_and_sigterm_is_bitwise_exact(tmp_path):
    env = _env(tmp_path / "jax_cache")
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    _run(straight, env)

    rc, out, seen = _run_until(broken, env, 5, signal.SIGKILL)  # first checkpoint at step 3
    assert rc == -signal.SIGKILL, out[-2000:]
    assert seen < STEPS - 3, "the run finished before it could be killed; make steps slower"
    rc, out, seen = _run_until(broken, env, 10, signal.SIGTERM)
    assert rc == 0, out[-3000:]
    assert "resumed from checkpoint step" in out
    assert "saving checkpoint at step" in out, out[-2000:]
    assert seen < STEPS, "SIGTERM arrived too late to test preemption"
    out = _run(broken, env)
    assert "resumed from checkpoint step" in out

    a, b = _train_records(straight), _train_records(broken)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for s in a:
        for k in ("loss", "grad_norm", "load_max"):
            assert a[s][k] == b[s][k], (s, k, a[s][k], b[s][k])
    sa, pa = _final_params(straight)
    sb, pb = _final_params(broken)
    assert sa == sb == STEPS and pa.keys() == pb.keys()
    assert any(".bias." in k or k.startswith("bias.") for k in pa)  # router biases are checkpointed
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)

    # resuming with another train.steps re-stretches the cosine schedule: one warning line says so
    # (a few steps more; compiles cached)
    out = _run(broken, env, f"train.steps={STEPS + 2}")
    warn = [line for line in out.splitlines() if line.startswith("WARNING: train.steps changed")]
    assert len(warn) == 1, out[-2000:]
    assert f"from {STEPS} (saved run) to {STEPS + 2}" in warn[0] and f"resume step {STEPS}" in warn[0], warn


def test_schedule_change_warning_names_both_totals_and_the_lr_jump():
    from farskip_jax.config import TrainConfig
    from farskip_jax.loading.optimizer import schedule_change_warning

    t = TrainConfig(steps=200, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1)
    msg = schedule_change_warning(100, t, 100)
    assert "\n" not in msg and "from 100 (saved run) to 200" in msg and "resume step 100" in msg
    assert "lr there 0.0001 -> 0.000587" in msg, msg  # the end of the old curve -> the middle of the new one


def test_half_written_checkpoints_are_never_picked(tmp_path):
    """A temporary folder of an interrupted save, and a step folder lacking orbax's commit marker or
    the data state, are ignored: the newest COMPLETE checkpoint is the one chosen."""
    import jax.numpy as jnp

    from farskip_jax.loading.checkpoint import Checkpointer

    state = {"w": jnp.arange(6.0).reshape(2, 3), "step": jnp.zeros((), jnp.int32)}
    ck = Checkpointer(str(tmp_path), keep=5)
    ck.save(2, state, {"next": 2})
    ck.save(4, {"w": state["w"] + 1, "step": jnp.ones((), jnp.int32)}, {"next": 4})
    ck.wait()
    d = ck.dir
    shutil.copytree(os.path.join(d, "4"), os.path.join(d, "6.orbax-checkpoint-tmp-1234"))  # interrupted save
    shutil.copytree(os.path.join(d, "4"), os.path.join(d, "8"))  # copied by hand, commit marker missing
    os.remove(os.path.join(d, "8", "commit_success.txt"))
    shutil.copytree(os.path.join(d, "4"), os.path.join(d, "10"))  # state complete, data state missing
    assert ck.latest_step() == 4
    restored, data = ck.restore(4, state)
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(state["w"] + 1))
    assert data == {"next": 4} and int(restored["step"]) == 1
    ck.close()


"""A run's records say what happened, once: a finished run re-run with fewer steps changes nothing
(config.yaml, evaluations, summary) and reports how it ended; a preempted run's summary names the
step its validation loss was measured at; a run that diverges before any checkpoint says so."""

from __future__ import annotations

import io
import os

from run_helpers import SigtermAt

from farskip_jax.config import load_config
from farskip_jax.train.logger import read_metrics
from farskip_jax.train.trainer import train

TINY = ["model.num_layers=1", "train.warmup_steps=0", "model.d_model=32", "model.mlp_hidden=64", "moe.expert_hidden=32", "train.batch_size=8",
        "train.seq_len=16", "train.eval_batches=1", "train.tensorboard=false", "train.peak_flops=1e9",
        "train.log_every=1", "data.max_docs=40"]


def _cfg(run, *extra):
    return load_config("configs/tiny.yaml", [f"train.run_dir={run}", *TINY, *extra])


def test_a_finished_run_rerun_with_fewer_steps_rewrites_nothing(tmp_path):
    run = str(tmp_path / "run")
    done = train(_cfg(run, "train.steps=4", "train.eval_every=2", "train.checkpoint_every=2"), stream=io.StringIO())
    with open(os.path.join(run, "config.yaml")) as f:
        config_before = f.read()
    records_before = read_metrics(run, None)
    out = io.StringIO()
    again = train(_cfg(run, "train.steps=2", "train.eval_every=2", "train.checkpoint_every=2"), stream=out)
    with open(os.path.join(run, "config.yaml")) as f:
        assert f.read() == config_before  # still says train.steps: 4
    assert read_metrics(run, None) == records_before  # no second evaluation, no summary with final_loss "nan"
    assert (again.status, again.step) == ("done", 4)
    assert again.final_loss == done.final_loss and again.val_loss == done.val_loss and again.val_step == 4
    assert "no steps left to run (train.steps=2" in out.getvalue()
    summary = [r for r in records_before if r["kind"] == "event" and "status" in r]
    assert len(summary) == 1 and summary[0]["final_loss"] == done.final_loss and summary[0]["val_loss_step"] == 4


def test_a_preempted_run_names_the_step_of_its_validation_loss(tmp_path):
    run = str(tmp_path / "run")
    out = SigtermAt(3)
    res = train(_cfg(run, "train.steps=10", "train.eval_every=2", "train.checkpoint_every=0"), stream=out)
    summary = [r for r in read_metrics(run, None) if r["kind"] == "event" and "status" in r][-1]
    assert summary["step"] == 3 and summary.get("val_loss_step") == 2
    assert (res.status, res.step, res.val_step) == ("preempted", 3, 2)
    evals = [r for r in read_metrics(run, "eval")]
    assert summary["val_loss"] == evals[-1]["val_loss"] and evals[-1]["step"] == 2
    assert f"val loss {res.val_loss:.4f} (at step 2)" in "".join(out.text)


def test_a_run_that_diverges_before_any_checkpoint_says_there_is_none(tmp_path, nan_at_steps):
    from test_train_step import _cfg as step_cfg  # the program of its divergence test: compiled once

    from farskip_jax.config import DataConfig, replace

    nan_at_steps(3, 6, 7, 8)  # as there: stops at step 8
    cfg = replace(step_cfg(batch_size=8, max_nonfinite=3, checkpoint_every=0, log_every=5, eval_every=0,
                           tensorboard=False, run_dir=str(tmp_path / "run")),
                  data=DataConfig(tokenizer="byte", max_docs=50))
    out = io.StringIO()
    res = train(replace(cfg, **{"model.vocab_size": 259}), stream=out)
    assert res.status == "diverged"
    assert "last good checkpoint (None)" not in out.getvalue()
    assert "no checkpoint was saved before" in out.getvalue() and "train.overwrite=true" in out.getvalue()

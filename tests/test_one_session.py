"""Pretraining and FCSD run in one session with one step: FCSD logs every metric a training step logs
(the capacity drops included, counted over its micro-batches), and a NaN injected into its step stops
it as it stops training (same message, the last good checkpoint intact and loadable)."""

from __future__ import annotations

import io

import jax
import numpy as np
from flax import nnx
from run_helpers import write_scaled_teacher

from farskip_jax.config import load_config
from farskip_jax.train.logger import read_metrics

TINY = ["model.num_layers=1", "model.d_model=32", "model.mlp_hidden=64", "moe.expert_hidden=32", "train.batch_size=8",
        "train.seq_len=16", "train.eval_batches=1", "train.tensorboard=false", "train.peak_flops=1e9",
        "train.log_every=1", "data.max_docs=40"]


def _distill_cfg(teacher, run, *extra):
    return load_config("configs/distill_tiny.yaml", [*TINY, f"distill.init_from_run={teacher}", "train.lr=3e-3",
                                                     "train.warmup_steps=1", "train.checkpoint_every=0",
                                                     f"train.run_dir={run}", *extra])


def test_fcsd_logs_what_a_train_step_logs_drops_included(tmp_path):
    """Every metric of the pretraining step is in FCSD's train records; `dropped` (assignments past
    the capacity) at step 1 equals the count of the student's forwards over the two micro-batches of
    the first batch (grad_accum=2), and is not zero."""
    from farskip_jax.data.pipeline import make_dataset
    from farskip_jax.data.tokenizer import load_tokenizer
    from farskip_jax.loading.load import load_run
    from farskip_jax.fcsd.distill import distill
    from farskip_jax.loading.optimizer import make_optimizer
    from farskip_jax.train.step import init_state, make_train_step

    teacher = write_scaled_teacher(str(tmp_path / "teacher"), TINY, 2.0)
    run = str(tmp_path / "fcsd")
    cfg = _distill_cfg(teacher, run, "train.steps=2", "distill.eval_every=2", "train.grad_accum=2",
                       "runtime.capacity_factor=0.5")
    res = distill(cfg, stream=io.StringIO())
    assert res.status == "done" and res.step == 2
    recs = read_metrics(run, "train")

    # the keys of a pretraining step's metrics, from its abstract evaluation (nothing compiles)
    run_cfg, graphdef, st = load_run(teacher, "latest", config_overrides={"runtime.capacity_factor": 0.5})
    tx, schedule = make_optimizer(run_cfg.train)
    model = nnx.merge(graphdef, st["params"], st["bias"], st["rest"])
    _, state = init_state(model, tx, 0)
    t = cfg.train  # the first training batch, as the run read it
    batch = next(iter(make_dataset(cfg.data, "train", batch_size=t.batch_size, seq_len=t.seq_len, seed=t.seed,
                                   tokenizer=load_tokenizer(cfg.data.tokenizer), vocab_size=cfg.model.vocab_size)))
    _, train_metrics = jax.eval_shape(make_train_step(graphdef, run_cfg, tx, schedule), state, batch)
    missing = set(train_metrics) - set(recs[0])
    assert not missing, f"FCSD's records lack {sorted(missing)}"

    # the oracle: the student (= the teacher's weights before the first update) under FarSkip, per micro-batch
    half = cfg.train.batch_size // 2
    want = 0
    for rows in (slice(0, half), slice(half, None)):
        out = model(*(np.asarray(batch[k])[rows] for k in ("tokens", "positions", "segment_ids")), farskip=cfg.farskip)
        want += int(out.dropped)
    assert want > 0
    assert recs[0]["dropped"] == want, (recs[0]["dropped"], want)


def test_a_nan_stops_fcsd_as_it_stops_training(tmp_path, nan_at_steps):
    """NaN at updates 3 and 4 with train.max_nonfinite=2: training and then FCSD (from the diverged
    run's last good checkpoint) skip both updates, stop at step 4 with status `diverged` and the same
    message, and keep their step-2 checkpoint as the newest."""
    from farskip_jax.fcsd.distill import distill
    from farskip_jax.loading.checkpoint import Checkpointer
    from farskip_jax.train.trainer import train

    nan_at_steps(3, 4)
    common = ["train.steps=6", "train.max_nonfinite=2", "train.checkpoint_every=2", "train.warmup_steps=1"]
    pre, fcsd = str(tmp_path / "pre"), str(tmp_path / "fcsd")
    out_pre, out_fcsd = io.StringIO(), io.StringIO()
    a = train(load_config("configs/tiny.yaml", [*TINY, *common, "train.eval_every=0", f"train.run_dir={pre}"]),
              stream=out_pre)
    b = distill(_distill_cfg(pre, fcsd, *common, "distill.eval_every=3"), stream=out_fcsd)
    stop = ("stopping: 2 non-finite steps in a row; the last good checkpoint (step 2) is left intact: "
            "re-running resumes from it")
    for res, run, out in ((a, pre, out_pre), (b, fcsd, out_fcsd)):
        assert (res.status, res.step) == ("diverged", 4), (run, res.status, res.step)
        assert stop in out.getvalue(), out.getvalue()
        recs = read_metrics(run, "train")
        assert [r["finite"] for r in recs] == [True, True, False, False]
        assert [r["nonfinite_streak"] for r in recs] == [0, 0, 1, 2]
        ck = Checkpointer(run, keep=3)
        assert ck.complete_steps() == [2]
        ck.close()
        events = [r for r in read_metrics(run, "event") if "status" in r]
        assert events[-1]["status"] == "diverged" and events[-1]["step"] == 4
    assert a.nonfinite_total == 2


def test_fault_injection_is_not_library_code():
    import pathlib

    import farskip_jax

    root = pathlib.Path(farskip_jax.__file__).parent
    assert not [str(p.relative_to(root)) for p in root.rglob("*.py") if "NAN_AT_STEPS" in p.read_text()]

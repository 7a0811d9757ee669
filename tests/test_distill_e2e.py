"""A tiny FCSD run end to end: pretrain a teacher (trainer), distill to FarSkip via train.py, check
the KL goes down, the best checkpoint is kept and loads, and (when the exporter exists) export."""

import json
import os

import numpy as np
import pytest

TINY = ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1", "model.mlp_hidden=64",
        "moe.num_experts=4", "moe.expert_hidden=32", "moe.shared_gate=true", "train.batch_size=8", "train.seq_len=32", "train.log_every=50",
        "train.tensorboard=false", "train.eval_batches=2", "mesh.data=-1"]


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory):
    import train as train_entry

    d = str(tmp_path_factory.mktemp("teacher"))
    rc = train_entry.main(["--config", "configs/tiny.yaml", *TINY, "train.steps=30", "train.eval_every=0", "train.lr=1e-2", "train.warmup_steps=3",
                           "train.checkpoint_every=0", f"train.run_dir={d}"])
    assert rc == 0
    return d


def test_distill_end_to_end(teacher_run, tmp_path):
    import train as train_entry
    from farskip_jax.eval.loading import load_run
    from farskip_jax.train.logger import read_metrics

    run = str(tmp_path / "fcsd")
    export = str(tmp_path / "hf")
    rc = train_entry.main(["--config", "configs/distill_tiny.yaml", *TINY, f"distill.init_from_run={teacher_run}",
                           "train.steps=16", "distill.eval_every=8", "train.lr=3e-3", "train.warmup_steps=2",
                           f"train.run_dir={run}", f"distill.export_hf={export}", "distill.export_family=qwen2_moe"])
    assert rc == 0
    evals = read_metrics(run, "eval")
    assert [e["step"] for e in evals] == [0, 8, 16]
    assert evals[-1]["kl"] < 0.7 * evals[0]["kl"], evals  # distillation closes the gap
    assert evals[0]["kl"] > 1e-4  # converting changed the model
    np.testing.assert_allclose([e["teacher_loss"] for e in evals], evals[0]["teacher_loss"], rtol=1e-6)  # frozen
    assert evals[1]["kl"] < evals[0]["kl"] and evals[-1]["val_loss"] < evals[0]["val_loss"]  # on fixed val batches
    assert len(read_metrics(run, "train")) == 16
    with open(os.path.join(run, "early_stopping.json")) as f:
        es = json.load(f)
    best_step = es["best_step"]
    assert es["best"] == min(e["kl"] for e in evals)
    cfg, graphdef, st = load_run(run, "best")
    assert cfg.farskip.preset == "farskip" and cfg.model.d_model == 32
    # the restored best student reproduces the KL logged at its step
    from farskip_jax.eval.metrics import evaluate_pair, make_compare_fn, val_batches

    _, _, teacher = load_run(teacher_run, "latest")
    r = evaluate_pair(make_compare_fn(graphdef, cfg.farskip), st, teacher, val_batches(cfg, 2))
    logged = next(e for e in evals if e["step"] == best_step)
    np.testing.assert_allclose(r.kl, logged["kl"], rtol=1e-4)
    # the same through the eval.py command line
    import eval as eval_entry

    rc = eval_entry.main(["--run", run, "--which", "best", "--mode", "compare", "--teacher-run", teacher_run,
                          "--batches", "2", "--out", str(tmp_path / "ev")])
    assert rc == 0
    with open(tmp_path / "ev" / "results.json") as f:
        np.testing.assert_allclose(json.load(f)["kl"], logged["kl"], rtol=1e-4)
    with open(os.path.join(export, "config.json")) as f:
        hf = json.load(f)
    assert hf["model_type"] == "qwen2_moe" and hf["farskip_jax"]["preset"] == "farskip"
    from farskip_jax.eval.loading import load_hf

    _, gd2, st2 = load_hf(export)  # the exported student re-imports to the same predictions
    from farskip_jax.eval.metrics import forward

    b = val_batches(cfg, 1)[0]
    np.testing.assert_allclose(forward(gd2, st2, b, cfg.farskip).logits, forward(graphdef, st, b, cfg.farskip).logits,
                               rtol=1e-5, atol=1e-5)

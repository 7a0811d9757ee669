"""The main job end to end: `python train.py --config configs/tiny.yaml` on the embedded corpus."""

import json
import os
import subprocess
import sys

import numpy as np
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_train_py_tiny_loss_decreases(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs/tiny.yaml"),
           "train.steps=60", "train.warmup_steps=10", "train.eval_every=30", "train.log_every=10",
           "model.num_layers=2", f"train.run_dir={run}"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "val loss" in p.stdout and "tok/s" in p.stdout and "eta" in p.stdout
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["train"]["steps"] == 60 and saved["model"]["num_layers"] == 2
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["kind"] == "train"]
    evals = [r for r in recs if r["kind"] == "eval"]
    assert [r["step"] for r in train] == list(range(1, 61))
    losses = np.array([r["loss"] for r in train])
    assert losses[:5].mean() - losses[-10:].mean() > 1.5, losses  # ln(259)~5.6 at init; bytes of code fall fast
    assert len(evals) == 2 and evals[-1]["val_loss"] < evals[0]["val_loss"] + 0.05 and evals[-1]["val_loss"] < 4.0
    for k in ("grad_norm", "lr", "tokens_per_s", "mfu", "load_min", "load_max", "load_entropy", "dropped"):
        assert k in train[-1], k
    assert os.path.isdir(run / "checkpoints" / "60")
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(run / "tensorboard"))
    # the same command again: nothing left to train; it says so (no "mean 0 tokens/s") and keeps the run
    p2 = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert p2.returncode == 0, p2.stdout[-3000:] + p2.stderr[-3000:]
    assert "no steps left to run (train.steps=60" in p2.stdout and "mean 0 tokens/s" not in p2.stdout, p2.stdout[-2000:]
    assert os.path.isdir(run / "checkpoints" / "60")

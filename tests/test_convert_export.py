"""Exports that say what they hold: `python -m farskip_jax.convert export --which` (best by default for
an FCSD run), farskip_export.json, a family that cannot hold the model refused before anything is
read or written, and `distill.export_hf` kept inside its run folder (configs/distill_hf_small.yaml,
the small CPU example of the HF recipe, run end to end on a 2-layer Qwen3-MoE made by transformers)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from cli_helpers import cli, qwen3_hf, refused


@pytest.fixture(scope="module")
def fcsd_run(tmp_path_factory):
    """(HF folder, FCSD run of configs/distill_hf_small.yaml on it). lr 1 wrecks the student after step 0,
    so the best checkpoint (step 0, the converted model before training) is not the latest (step 4)."""
    root = tmp_path_factory.mktemp("fcsd")
    hf = qwen3_hf(root / "hf")
    run = str(root / "run")
    r = cli("train.py", "--config", "configs/distill_hf_small.yaml", f"init_from_hf={hf}", f"train.run_dir={run}",
            "train.steps=4", "distill.eval_every=2", "train.lr=1.0", "train.warmup_steps=0", "train.seq_len=32")
    assert r.returncode == 0, r.stderr[-3000:]
    return hf, run


def test_the_example_config_runs_and_exports_inside_its_run_folder(fcsd_run):
    _, run = fcsd_run
    with open(os.path.join(run, "early_stopping.json")) as f:
        assert json.load(f)["best_step"] == 0
    export = os.path.join(run, "hf_export")  # distill.export_hf: hf_export, relative: inside the run folder
    info = json.loads(open(os.path.join(export, "farskip_export.json")).read())
    assert info == dict(info, run=run, checkpoint="best", step=0, family="qwen3_moe")
    assert info["farskip"]["preset"] == "farskip" and info["farskip"]["layers"] == [0, 1]


def test_export_takes_the_best_checkpoint_of_an_fcsd_run_by_default(fcsd_run, tmp_path):
    import jax

    from farskip_jax.loading.load import load_hf, load_run

    _, run = fcsd_run
    weights = {}
    for which, ckpt, step in ((None, "best", 0), ("4", "latest", 4)):
        out = str(tmp_path / f"hf_{ckpt}")
        r = cli("-m", "farskip_jax.convert", "export", run, out, *(["--which", which] if which else []))
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"exporting checkpoint {which or 'best'} (step {step})" in r.stdout
        info = json.loads(open(os.path.join(out, "farskip_export.json")).read())
        assert (info["checkpoint"], info["step"]) == (which or "best", step)
        # the exported weights are those of the checkpoint named (fp32 export of fp32 parameters: exact)
        _, _, st = load_run(run, ckpt)
        _, _, st2 = load_hf(out)
        mine, back = (jax.tree.leaves(jax.tree.map(np.asarray, t["params"])) for t in (st, st2))
        assert len(mine) == len(back) and all(np.array_equal(a, b) for a, b in zip(mine, back))
        weights[ckpt] = mine
    assert not all(np.array_equal(a, b) for a, b in zip(weights["best"], weights["latest"]))  # two checkpoints
    refused(["-m", "farskip_jax.convert", "export", run, str(tmp_path / "x"), "--which", "3"],
            r"checkpoint step 3 not in .*have \[4\]", str(tmp_path / "x"))


def test_a_family_that_cannot_hold_the_model_is_refused_naming_what_and_who_can(fcsd_run, tmp_path):
    hf, run = fcsd_run
    out = str(tmp_path / "out")
    # a Qwen3-MoE (q/k norm, no shared expert) as Mixtral: q/k norm would be dropped
    refused(["-m", "farskip_jax.convert", "export", run, out, "--family", "mixtral"],
            r"HF family 'mixtral' cannot hold this model .*q/k norm True -> False.*families that can: qwen3_moe", out)


def test_qwen3_moe_refuses_shared_experts_without_qk_norm():
    """The issue's case: a model with a shared expert and no q/k norm exported as qwen3_moe (transformers
    would drop the shared expert and draw q_norm/k_norm at random)."""
    from farskip_jax.config import load_config
    from farskip_jax.convert.export import hf_config_for
    from farskip_jax.errors import CheckpointError

    cfg = load_config("configs/tiny.yaml", ["moe.shared_gate=true"])
    with pytest.raises(CheckpointError, match=r"'qwen3_moe' cannot hold .*q/k norm False -> True; shared experts 1 -> 0"
                                              r".*families that can: qwen2_moe"):
        hf_config_for(cfg, family="qwen3_moe")
    assert hf_config_for(cfg, family="qwen2_moe")[0]["model_type"] == "qwen2_moe"


def test_distill_export_stays_in_the_run_folder_and_never_replaces_another_runs(tmp_path, fcsd_run):
    from farskip_jax.config import load_config
    from farskip_jax.convert.export import run_export_dir
    from farskip_jax.errors import ConfigError

    hf, run = fcsd_run
    exp = load_config("configs/distill_hf.yaml").distill.export_hf
    a, b = (run_export_dir(exp, str(tmp_path / r)) for r in ("runs/a", "runs/b"))
    assert a == str(tmp_path / "runs/a" / exp) and b != a  # two runs of one config: two exports
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:  # a relative path that already leads into the run folder is taken as it is
        assert run_export_dir("runs/a/hf", "runs/a") == str(tmp_path / "runs/a/hf")
    finally:
        os.chdir(cwd)
    assert run_export_dir(os.path.join(run, "hf_export"), run) == os.path.join(run, "hf_export")
    theirs = os.path.join(run, "hf_export")  # the fixture run's export, outside a new run's folder
    with pytest.raises(ConfigError, match="already exists and is the export of " + run):
        run_export_dir(theirs, str(tmp_path / "other"))
    new = str(tmp_path / "new")
    refused(["train.py", "--config", "configs/distill_hf_small.yaml", f"init_from_hf={hf}", f"train.run_dir={new}",
             f"distill.export_hf={theirs}"],
            r"distill\.export_hf=.*already exists and is the export of .*set distill\.export_hf to a path inside the "
            r"run folder", new, theirs)

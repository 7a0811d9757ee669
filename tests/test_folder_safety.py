"""Nothing the user owns is emptied or overwritten: train.overwrite, `convert --overwrite` and the FCSD
export replace only folders farskip_jax made, of their own kind; a run folder of a version without the
marker is recognised, kept and marked; an export never goes into the run folder's own files."""

from __future__ import annotations

import json
import os

import pytest

from cli_helpers import qwen3_hf, snapshot

from farskip_jax.config import dump_config, load_config
from farskip_jax.errors import ConfigError
from farskip_jax.train import rundir


def folder_kind(path):
    from farskip_jax.folders import folder_kind

    return folder_kind(path)

TINY = ["model.num_layers=1", "train.warmup_steps=0", "train.steps=2", "train.tensorboard=false"]


def _cfg(run_dir, *extra):
    return load_config("configs/tiny.yaml", [f"train.run_dir={run_dir}", *TINY, *extra])


def _user_folder(root):
    """The issue's folder: a config.yaml that is not a farskip_jax run, code, results."""
    os.makedirs(root / "src")
    (root / "config.yaml").write_text("lr: 0.1\n")
    (root / "src" / "main.py").write_text("x\n")
    (root / "results.csv").write_text("r\n")
    return str(root)


def _a_run(run_dir, steps=(2,)):
    """A run folder as a run leaves it (claimed: marker, config.yaml, .owner), with logged steps and
    checkpoint folders standing for its results."""
    cfg = _cfg(run_dir)
    rundir.claim_run_dir(cfg, rundir.check_run_dir(cfg))
    rundir.release_run_dir(run_dir)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps({"kind": "train", "step": s, "loss": 5.0}) + "\n" for s in steps)
    for s in steps:
        os.makedirs(os.path.join(run_dir, "checkpoints", str(s)))
        with open(os.path.join(run_dir, "checkpoints", str(s), "weights"), "w") as f:
            f.write("trained")
    return run_dir


def test_a_folder_holding_a_stray_config_yaml_is_never_reclaimed(tmp_path):
    user = _user_folder(tmp_path / "p")
    before = snapshot(user)
    for extra in ([], ["train.overwrite=true"]):
        with pytest.raises(ConfigError, match=r"is not a farskip_jax run folder \(it holds config.yaml, results.csv, "
                                              r"src\).*never empties a folder it did not make"):
            rundir.check_run_dir(_cfg(user, *extra))
    assert snapshot(user) == before
    # a run folder farskip_jax made is still replaced on request, and marked
    run = _a_run(str(tmp_path / "run"))
    folder = rundir.check_run_dir(_cfg(run, "model.num_layers=2", "train.overwrite=true"))
    assert folder.wipe and not folder.resume


def test_a_run_folder_of_a_version_without_the_marker_is_kept_and_marked(tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    cfg = _cfg(old)
    (old / "config.yaml").write_text(dump_config(cfg))  # what 02f767d leaves: config.yaml + .owner, no marker
    (old / ".owner").write_text("123 on host")
    folder = rundir.check_run_dir(cfg)
    assert folder.resume and "marked" in folder.note
    assert folder_kind(str(old)).kind == "run" and not folder_kind(str(old)).marked
    rundir.claim_run_dir(cfg, folder)
    rundir.release_run_dir(str(old))
    assert folder_kind(str(old)).marked
    # one whose config.yaml this version cannot load: never emptied without train.overwrite
    newer = tmp_path / "newer"
    newer.mkdir()
    (newer / "config.yaml").write_text("model:\n  a_key_of_another_version: 1\n")
    (newer / ".owner").write_text("123 on host")
    (newer / "notes.txt").write_text("mine")
    before = snapshot(str(newer))
    with pytest.raises(ConfigError, match=r"config.yaml does not load under this version .*kept as it is.*"
                                          r"train.overwrite=true"):
        rundir.check_run_dir(_cfg(newer))
    assert snapshot(str(newer)) == before
    assert rundir.check_run_dir(_cfg(newer, "train.overwrite=true")).wipe


def test_convert_overwrite_replaces_only_its_own_kind_never_a_run(tmp_path, capsys):
    from farskip_jax.convert.__main__ import main as convert

    hf = qwen3_hf(tmp_path / "hf")
    run = _a_run(str(tmp_path / "run"))
    user = _user_folder(tmp_path / "mine")
    keep = snapshot(run, user)

    def refused(args, match):
        capsys.readouterr()
        assert convert(args) == 2
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and err[0].startswith("error: "), err
        assert __import__("re").search(match, err[0]), err[0]
        assert snapshot(run, user) == keep, "a refused command changed a folder"

    refused(["import", hf, run, "--overwrite"], r"is a training run folder: an import never replaces a run")
    refused(["import", hf, user, "--overwrite"], r"not a folder farskip_jax wrote .*--overwrite replaces only an import")
    imp = str(tmp_path / "imp")
    assert convert(["import", hf, imp]) == 0 and folder_kind(imp).kind == "import"
    assert convert(["import", hf, imp, "--overwrite"]) == 0  # its own import: replaced
    refused(["import", hf, imp], r"already exists \(an import folder\); pass --overwrite")
    refused(["export", imp, run, "--overwrite"], r"is a training run folder: an export never replaces a run")
    refused(["export", imp, user, "--overwrite"], r"not a folder farskip_jax wrote .*--overwrite replaces only an export")
    refused(["export", imp, imp, "--overwrite"], r"is an import folder; --overwrite replaces only an export")
    refused(["export", imp, os.path.join(run, "checkpoints", "hf"), "--overwrite"], r"which the run in .* writes itself")
    out = str(tmp_path / "exp")
    assert convert(["export", imp, out]) == 0 and folder_kind(out).kind == "export"
    assert convert(["export", imp, out, "--overwrite"]) == 0  # its own export: replaced
    assert convert(["export", imp, os.path.join(run, "hf")]) == 0  # a new folder inside the run leaves the run alone
    assert snapshot(run, user) == dict(keep, **{p: h for p, h in snapshot(run).items() if "/hf/" in p})


@pytest.mark.parametrize("export_hf, match", [
    (".", r"is the run folder .* or holds it"), ("..", r"is the run folder .* or holds it"),
    ("best", r"lies in .*best, which the run writes itself"), ("checkpoints", r"lies in .*checkpoints, which the run"),
    ("checkpoints/5", r"lies in .*checkpoints, which the run"), ("metrics.jsonl", r"lies in .*metrics.jsonl")])
def test_distill_export_inside_the_run_is_refused_before_anything_is_written(tmp_path, export_hf, match):
    from farskip_jax.fcsd.distill import distill

    run = str(tmp_path / "student")
    cfg = load_config("configs/distill_tiny.yaml", [f"train.run_dir={run}", f"distill.export_hf={export_hf}",
                                                    "distill.export_family=qwen3_moe"])
    with pytest.raises(ConfigError, match=r"distill.export_hf=" + repr(export_hf).replace(".", r"\.") + ".*" + match):
        distill(cfg)
    assert not os.path.exists(run)
    _a_run(run)  # the same for a run folder that exists and holds results
    keep = snapshot(run)
    from farskip_jax.convert.export import run_export_dir

    with pytest.raises(ConfigError, match=match):
        run_export_dir(export_hf, run)
    assert snapshot(run) == keep
    assert run_export_dir("hf", run) == os.path.join(run, "hf")


def test_the_marker_is_written_only_by_the_project_and_names_the_kind(tmp_path):
    from farskip_jax.folders import MARKER

    run = _a_run(str(tmp_path / "run"))
    with open(os.path.join(run, MARKER)) as f:
        assert json.load(f)["kind"] == "run"
    assert folder_kind(str(tmp_path)).kind is None


def test_a_run_folder_under_a_file_says_so(tmp_path):
    (tmp_path / "notes").write_text("a file")
    with pytest.raises(ConfigError, match=r"cannot be created: .*notes is a file, not a folder"):
        rundir.check_run_dir(_cfg(tmp_path / "notes" / "run"))


def test_convert_help_prints_the_usage_whole(capsys):
    from farskip_jax.convert.__main__ import main as convert

    with pytest.raises(SystemExit):
        convert(["--help"])
    out = capsys.readouterr().out
    assert "    python -m farskip_jax.convert import HF_DIR OUT_DIR [--dtype bfloat16] [--overwrite] [key=value ...]\n" in out
    assert "--overwrite replaces an existing output folder only when farskip_jax wrote it" in out

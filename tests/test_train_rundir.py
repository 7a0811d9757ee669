"""Run folders are never taken over by a different run unless train.overwrite=true."""

import os

import pytest

from farskip_jax.config import Config, replace
from farskip_jax.errors import ConfigError
from farskip_jax.train.rundir import check_run_dir, claim_run_dir


def prepare_run_dir(cfg):
    """check_run_dir + claim_run_dir, as the entry points call them: (path, whether it held this run)."""
    folder = check_run_dir(cfg)
    claim_run_dir(cfg, folder)
    return folder.path, folder.resume


def test_run_folder_ownership(tmp_path):
    cfg = replace(Config(), **{"train.run_dir": str(tmp_path / "run")})
    run_dir, existed = prepare_run_dir(cfg)
    assert not existed and os.path.isfile(os.path.join(run_dir, "config.yaml"))
    # the same run (longer, other logging cadence, other mesh) resumes in place
    # and other implementations of the same math (a run from before runtime.attention_impl=auto)
    again = replace(cfg, **{"train.steps": 900, "train.log_every": 3, "mesh.data": 2,
                            "runtime.attention_impl": "naive", "runtime.gmm": "tiled", "runtime.remat": "full"})
    assert prepare_run_dir(again) == (run_dir, True)
    # a different experiment is refused with the differing keys named, once the folder holds a step
    other = replace(cfg, **{"model.num_layers": 2, "farskip.preset": "farskip"})
    folder = check_run_dir(other)  # before: the folder never ran a step, so it would be reclaimed
    assert folder.wipe and not folder.resume and "never finished a step" in folder.note
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.write('{"kind": "train", "step": 1, "loss": 5.0}\n')
    with pytest.raises(ConfigError, match=r"belongs to another run.*farskip.preset.*model.num_layers"):
        prepare_run_dir(other)
    open(os.path.join(run_dir, "marker"), "w").close()
    # ... unless told to overwrite, which deletes the old folder first
    run_dir2, existed = prepare_run_dir(replace(other, **{"train.overwrite": True}))
    assert run_dir2 == run_dir and not existed and not os.path.exists(os.path.join(run_dir, "marker"))
    # a non-empty folder that is not a run folder is never touched
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not a farskip_jax run folder"):
        prepare_run_dir(replace(cfg, **{"train.run_dir": str(stranger)}))

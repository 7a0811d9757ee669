"""Load a model for evaluation / distillation from an orbax run folder, an HF checkpoint folder or
an import folder.

    cfg, graphdef, st = load_run("runs/tiny", which="latest")   # or "best" (distill runs) or a step
    cfg, graphdef, st = load_hf("path/to/hf", mesh=mesh)
    cfg, graphdef, st = load_import("runs/dsv2_import")          # python -m farskip_jax.convert import
    st: {params, bias, rest} (see eval/metrics.py)

A run folder is read with the pieces of the trainer: its config.yaml rebuilds the model
(parallel.build.create_model) and the optimizer (train.optimizer), whose fresh train state is the
template that train.checkpoint.Checkpointer restores into, after checking the step against the digest
written when it was saved (a damaged step: one CheckpointError naming the newest earlier good step and
`hint(it)`, by default how eval.py and export read it). Distillation runs keep their best
checkpoint in `<run>/best/checkpoints` (same format); `default_which` is "best" for such a run and
"latest" otherwise. An HF folder is imported by convert.import_hf, which places the model on a given
mesh as create_model does (the FoE mesh for FoE with expert parallelism). An import folder (config.yaml
+ params.safetensors, no checkpoints/) is not a run folder: read_run_config names it and says what
reads it.
"""

from __future__ import annotations

import os
import warnings
from typing import Callable, Optional, Union

import yaml

from farskip_jax.config import Config, config_from_dict, replace
from farskip_jax.errors import CheckpointError, ConfigError
from farskip_jax.loading.train_state import model_state, init_state, split_model
from farskip_jax.loading.checkpoint import Checkpointer
from farskip_jax.loading.hf_folder import import_hf
from farskip_jax.loading.import_folder import describe_import_folder, is_native
from farskip_jax.loading.native import load_native
from farskip_jax.loading.optimizer import make_optimizer
from farskip_jax.parallel.build import create_model


def read_run_config(run_dir: str) -> Config:
    if is_native(run_dir):
        raise ConfigError(f"{describe_import_folder(run_dir)}, not a run folder (it has no checkpoints/): evaluate it "
                          f"with `eval.py --hf {run_dir}`, export it with `python -m farskip_jax.convert export "
                          f"{run_dir} HF_DIR`, and train from its weights with init_from_hf=<the HF folder it was "
                          "imported from>")
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        raise ConfigError(f"{run_dir!r} is not a farskip_jax run folder (no config.yaml); pass the train.run_dir of a run")
    with open(path) as f:
        return config_from_dict(yaml.safe_load(f))


def build_model(cfg: Config, mesh=None, seed: int = 0):
    """Transformer of cfg with params on `mesh` (parallel.build.create_model)."""
    return create_model(cfg, mesh, seed=seed)


def committed_steps(ckpt_root: str) -> list[int]:
    """Steps under `<ckpt_root>/checkpoints` that orbax committed (read from the folder, nothing created)."""
    d = os.path.join(ckpt_root, "checkpoints")
    if not os.path.isdir(d):
        return []
    return sorted(int(x) for x in os.listdir(d) if x.isdigit() and os.path.isfile(os.path.join(d, x, "commit_success.txt")))


def default_which(run_dir: str) -> str:
    """"best" for a run that keeps a best checkpoint (FCSD: `<run>/best`), else "latest"."""
    return "best" if committed_steps(os.path.join(run_dir, "best")) else "latest"


def checkpoint_step(run_dir: str, which: Union[str, int]) -> Optional[int]:
    """The step `which` names in a run folder ("latest" / "best": the newest committed one), or None."""
    steps = committed_steps(os.path.join(run_dir, "best") if which == "best" else run_dir)
    if which in ("latest", "best"):
        return steps[-1] if steps else None
    return int(which) if int(which) in steps else None


def read_hint(step: int) -> str:
    """How eval.py and `convert export` read checkpoint `step` of a run instead."""
    return f"read that one instead (eval.py and python -m farskip_jax.convert export: --which {step})"


def restore_train_state(cfg: Config, ckpt_root: str, which: Union[str, int] = "latest", mesh=None,
                        hint: Callable[[int], str] = read_hint):
    """(graphdef, full train state) restored from `<ckpt_root>/checkpoints` (a run folder or its best/),
    verified against its digest (Checkpointer.restore; `hint` says how to use an earlier good step)."""
    if not os.path.isdir(os.path.join(ckpt_root, "checkpoints")):
        raise CheckpointError(f"no checkpoints under {ckpt_root!r}")
    model = build_model(cfg, mesh, seed=cfg.train.seed)
    tx, _ = make_optimizer(cfg.train)
    graphdef, template = init_state(model, tx, cfg.train.seed)
    ck = Checkpointer(ckpt_root, keep=max(cfg.train.keep_checkpoints, 1))
    try:
        steps = ck.complete_steps()
        if not steps:
            raise CheckpointError(f"no complete checkpoint under {ckpt_root!r}")
        step = steps[-1] if which in ("latest", "best") else int(which)
        if step not in steps:
            raise CheckpointError(f"checkpoint step {step} not in {ckpt_root!r} (have {steps})")
        state, _ = ck.restore(step, template, hint=hint)
        if ck.verified is False:
            warnings.warn(f"checkpoint step {step} of {ckpt_root} was written by a farskip_jax that wrote no digests: "
                          "read without verification", stacklevel=2)
    finally:
        ck.close()
    return graphdef, state


def load_run(run_dir: str, which: Union[str, int] = "latest", mesh=None,
             config_overrides: Optional[dict] = None, hint: Callable[[int], str] = read_hint) -> tuple[Config, object, dict]:
    """(cfg, graphdef, {params, bias, rest}) of a pretraining or distillation run folder.

    which: "latest" | "best" (a distillation run's best checkpoint) | a step number.
    config_overrides: dotted keys applied to the run's config before building (e.g. {"runtime.dispatch": ...}).
    hint: how to use an earlier good step when the one read is damaged (restore_train_state)."""
    run_dir = os.path.abspath(run_dir)
    cfg = read_run_config(run_dir)
    if config_overrides:
        cfg = replace(cfg, **config_overrides)
    root = os.path.join(run_dir, "best") if which == "best" else run_dir
    if which == "best" and not os.path.isdir(os.path.join(root, "checkpoints")):
        have = committed_steps(run_dir)
        raise CheckpointError(f"{run_dir} has no best checkpoint: only FCSD runs (train.mode: distill) keep one, in "
                              f"best/, from their first evaluation; choose latest or a step number"
                              + (f" (it has steps {have})" if have else ""))
    graphdef, state = restore_train_state(cfg, root, which, mesh, hint)
    return cfg, graphdef, model_state(state)


def load_import(path: str, mesh=None, overrides=None) -> tuple[Config, object, dict]:
    """(cfg, graphdef, {params, bias, rest}) of an import folder (loading.native.load_native; overrides
    as import_hf applies them)."""
    cfg, model, _ = load_native(path, mesh=mesh, overrides=overrides)
    graphdef, params, bias, rest = split_model(model)
    return cfg, graphdef, dict(params=params, bias=bias, rest=rest)


def load_hf(hf_dir: str, mesh=None, overrides=None) -> tuple[Config, object, dict]:
    """(cfg, graphdef, {params, bias, rest}) of an HF checkpoint folder (convert.loader.import_hf).

    With a mesh the model is placed as the trainer places it (parallel.build: routed_compute_on, and
    the FoE group x expert mesh over the same devices when runtime.num_groups > 1 with expert
    parallelism); without one, on the first device."""
    cfg, model = import_hf(hf_dir, mesh=mesh, overrides=overrides)
    graphdef, params, bias, rest = split_model(model)
    return cfg, graphdef, dict(params=params, bias=bias, rest=rest)

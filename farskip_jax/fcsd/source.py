"""Where FCSD's weights come from, and where the student goes.

    cfg, graphdef, st = load_source(cfg, mesh)   # st = {params, bias, rest}: teacher = student at step 0
    export_student(cfg, graphdef, st, out_dir)   # the student as an HF folder (convert/export.py)

The source is `init_from_hf` (an HF folder) or `distill.init_from_run` (a run folder's newest
checkpoint); cfg comes back with the checkpoint's architecture (model and moe sections) and every other
section the user's (Config.with_architecture).
"""

from __future__ import annotations

import hashlib
import os
from typing import Optional

from flax import nnx

from farskip_jax.config import Config, to_dict
from farskip_jax.errors import ConfigError
from farskip_jax.loading.load import load_hf, load_run, read_run_config
from farskip_jax.convert.export import export_hf
from farskip_jax.train.trainer import shape_from_hf


def _tokenizer_id(spec: str) -> Optional[str]:
    """'byte' / 'raw_bytes' as they are; a tokenizer.json (or its folder) by its content's SHA-1, so a
    moved copy is the same tokenizer; None when the file is gone (nothing to compare)."""
    if spec in ("byte", "raw_bytes"):
        return spec
    path = os.path.join(spec, "tokenizer.json") if os.path.isdir(spec) else spec
    try:
        with open(path, "rb") as f:
            return hashlib.sha1(f.read()).hexdigest()
    except OSError:
        return None


def source_shape(cfg: Config) -> Config:
    """cfg with the model shape of the distillation source, read from its config only (no weights)."""
    if cfg.init_from_hf and not cfg.distill.init_from_run:
        return shape_from_hf(cfg)
    if cfg.distill.init_from_run and not cfg.init_from_hf:
        return cfg.with_architecture(read_run_config(cfg.distill.init_from_run))
    return cfg  # both or neither: load_source names the mistake


def check_source(cfg: Config) -> None:
    """ConfigError unless exactly one weight source is set (init_from_hf or distill.init_from_run)."""
    if cfg.init_from_hf and cfg.distill.init_from_run:
        raise ConfigError("set either init_from_hf or distill.init_from_run, not both")
    if not cfg.init_from_hf and not cfg.distill.init_from_run:
        raise ConfigError("train.mode=distill needs the weights to convert: set init_from_hf: <HF folder> or "
                          "distill.init_from_run: <run folder of a pretraining run>")


def load_source(cfg: Config, mesh) -> tuple[Config, object, dict]:
    """(cfg with the checkpoint's model shape, graphdef, {params, bias, rest}) of the distillation source."""
    check_source(cfg)
    if cfg.init_from_hf:
        user = {k: to_dict(getattr(cfg, k)) for k in ("runtime", "mesh", "train", "inference")}
        src_cfg, graphdef, st = load_hf(cfg.init_from_hf, mesh=mesh, overrides=user)
    else:
        src = read_run_config(cfg.distill.init_from_run)
        src_tok = _tokenizer_id(src.data.tokenizer)
        if src_tok is not None and src_tok != _tokenizer_id(cfg.data.tokenizer):
            raise ConfigError(f"distill.init_from_run={cfg.distill.init_from_run!r} was trained with data.tokenizer="
                              f"{src.data.tokenizer!r} but this run reads data.tokenizer={cfg.data.tokenizer!r}: the "
                              f"teacher would see ids of another tokenizer; set data.tokenizer={src.data.tokenizer} "
                              "(and data.source / data.paths for the text to distil on)")
        ov = {"runtime": cfg.runtime, "mesh": cfg.mesh}  # the source's architecture, run as this run asks
        hint = (lambda p: f"distill.init_from_run reads the newest step: resume that run from step {p} "  # noqa: E731
                f"(train.resume_step={p} in its own command) to replace the damaged one")
        src_cfg, graphdef, st = load_run(cfg.distill.init_from_run, "latest", mesh, config_overrides=ov, hint=hint)
    out = cfg.with_architecture(src_cfg)
    if cfg.train.seq_len > out.model.max_seq_len:
        raise ConfigError(f"train.seq_len={cfg.train.seq_len} exceeds model.max_seq_len={out.model.max_seq_len}")
    return out, graphdef, st


def export_student(cfg: Config, graphdef, st: dict, out_dir: str, step: Optional[int] = None) -> str:
    """Write the student as an HF folder with its FarSkip settings (convert/export.py `export_hf`).

    The HF family comes from the config.json of `init_from_hf`, else from `distill.export_family`."""
    model = nnx.merge(graphdef, st["params"], st["bias"], st["rest"])
    family = None if cfg.init_from_hf else cfg.distill.export_family
    if not cfg.init_from_hf and family is None:
        raise ConfigError("distill.export_hf needs distill.export_family (an HF model_type such as qwen2_moe) "
                          "when the weights did not come from init_from_hf; the distilled checkpoint is kept in "
                          "<run_dir>/best")
    return export_hf(model, cfg, out_dir, family=family, overwrite=True,
                     source=dict(run=os.path.abspath(cfg.train.run_dir), checkpoint="best", step=step))

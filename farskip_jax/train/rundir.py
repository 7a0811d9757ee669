"""Run folders: `<run_dir>/config.yaml` marks which run owns the folder.

A folder is reused (resumed) only by the same experiment: its saved config must equal the new one
except for the keys in RESUMABLE_KEYS (run length, logging cadence, and implementation choices that
compute the same function: attention core, expert matmul backend, remat) and the mesh section.
Anything else raises ConfigError unless `train.overwrite=true`, which deletes the folder first.
"""

from __future__ import annotations

import os
import shutil

from farskip_jax.config import Config, config_from_dict, dump_config, to_dict
from farskip_jax.errors import ConfigError

RESUMABLE_KEYS = {"train.steps", "train.time_limit_s", "train.log_every", "train.eval_every", "train.tensorboard",
                  "train.checkpoint_every", "train.keep_checkpoints", "train.max_nonfinite", "train.overwrite",
                  "train.inject_nan_at", "train.peak_flops",
                  # how the same math is computed (kernels, blocking, rematerialisation): a run started
                  # with one may resume with another, e.g. a run from before model.attention_impl=auto
                  "model.attention_impl", "model.attention_block", "model.remat", "moe.gmm", "moe.gmm_tile"}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def config_diff(a: Config, b: Config) -> list[str]:
    fa, fb = _flat(to_dict(a)), _flat(to_dict(b))
    return sorted(k for k in set(fa) | set(fb) if fa.get(k) != fb.get(k))


def prepare_run_dir(cfg: Config, *, is_primary: bool = True) -> tuple[str, bool]:
    """Create or validate the run folder. Returns (absolute path, whether it already held this run)."""
    import yaml

    run_dir = os.path.abspath(cfg.train.run_dir)
    if not is_primary:
        return run_dir, True
    cfg_path = os.path.join(run_dir, "config.yaml")
    existed = os.path.isdir(run_dir) and bool(os.listdir(run_dir))
    if existed and cfg.train.overwrite:
        if is_primary:
            shutil.rmtree(run_dir)
        existed = False
    elif existed:
        if not os.path.isfile(cfg_path):
            raise ConfigError(f"train.run_dir={run_dir} exists and is not a farskip_jax run folder (no config.yaml); "
                              "choose another train.run_dir or set train.overwrite=true to delete it")
        with open(cfg_path) as f:
            old = config_from_dict(yaml.safe_load(f))
        # the mesh may change between runs (orbax restores onto any sharding; the data order does not
        # depend on the process count in the default shard_by=rows)
        diff = [k for k in config_diff(old, cfg) if k not in RESUMABLE_KEYS and not k.startswith("mesh.")]
        if diff:
            raise ConfigError(f"train.run_dir={run_dir} belongs to another run (config differs at {diff}); "
                              "choose another train.run_dir, or set train.overwrite=true to delete it")
    if is_primary:
        os.makedirs(run_dir, exist_ok=True)
        with open(cfg_path, "w") as f:
            f.write(dump_config(cfg))
    return run_dir, existed

"""Run folders: `<run_dir>/config.yaml` says which run owns the folder, the marker file of
folders.py says that farskip_jax made it.

A folder is reused (resumed) only by the same experiment: its saved config must equal the new one
except for the keys in RESUMABLE_KEYS (run length, logging cadence, and implementation choices that
compute the same function: attention core, expert matmul backend, remat) and the mesh section.
Anything else raises ConfigError unless `train.overwrite=true`, which empties the folder first, or
the folder was left by a run that never finished a step (reclaimed). Only a run folder farskip_jax
made is ever emptied: one carrying the marker, or one of a version that wrote none (config.yaml +
.owner, marked when claimed, whether or not its config.yaml loads under this version; such a folder
is emptied only with train.overwrite=true). A folder holding anything else (a stray config.yaml
included), an import folder or an export is refused, train.overwrite or not. `check_run_dir` only
reads, so the entry points validate everything else before `claim_run_dir` writes: a run that fails
on bad input leaves no trace.

A running run holds its folder: `claim_run_dir` takes an exclusive flock on the folder itself (the
kernel drops it when the process ends, so a crashed run leaves nothing stale) and `check_run_dir`
refuses a folder another process holds. A folder that cannot be written (read-only file system, no
permission, a path component that is a file) is refused before anything starts.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import os
import shutil
from typing import Optional

import jax
import yaml

from farskip_jax.config import Config, KernelsConfig, config_from_dict, dump_config, to_dict
from farskip_jax.loading.import_folder import describe_import_folder, is_native
from farskip_jax.errors import ConfigError, FarSkipError
from farskip_jax.folders import folder_kind, write_marker

RESUMABLE_KEYS = {"train.steps", "train.time_limit_s", "train.log_every", "train.eval_every", "train.tensorboard",
                  "train.checkpoint_every", "train.keep_checkpoints", "train.max_nonfinite", "train.overwrite",
                  "train.peak_flops", "train.resume_step",
                  # how the same math is computed (kernels, blocking, rematerialisation): a run started
                  # with one may resume with another, e.g. a run from before runtime.attention_impl=auto
                  "runtime.attention_impl", "runtime.attention_block", "runtime.remat", "runtime.gmm", "runtime.gmm_tile",
                  "data.prefetch",
                  # stacked vs per-layer parameters: loading/checkpoint.py converts at restore
                  "runtime.scan_layers"}

# the CPU kernels (config.KernelsConfig) change how the same math is computed, never what
RESUMABLE_KEYS |= {f"kernels.{f.name}" for f in dataclasses.fields(KernelsConfig)}


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


# folder -> fd of the flock this process holds on it (released by release_run_dir or at exit)
_HELD: dict = {}


def _try_lock(path: str) -> Optional[int]:
    """An fd holding an exclusive flock on folder `path`, or None when another process holds one."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise
    return fd


def _holder(path: str) -> str:
    try:
        with open(os.path.join(path, ".owner")) as f:
            return f" (process {f.read().strip()})"
    except OSError:
        return ""


def _busy(path: str) -> ConfigError:
    return ConfigError(f"train.run_dir={path} is in use by another run{_holder(path)}; wait for it to finish, stop "
                       "it, or choose another train.run_dir")


def _check_held(path: str) -> None:
    """ConfigError when another process holds `path` (an existing folder); takes nothing."""
    if path in _HELD:
        return
    fd = _try_lock(path)
    if fd is None:
        raise _busy(path)
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def _check_writable(path: str) -> None:
    """ConfigError when `path`, or the nearest existing folder above it, cannot be written."""
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise ConfigError(f"train.run_dir={path} cannot be created: {probe} is a file, not a folder; choose a "
                          "train.run_dir whose parent folders are folders")
    if not os.access(probe, os.W_OK | os.X_OK):
        why = "a read-only file system" if _read_only_fs(probe) else "no write permission"
        raise ConfigError(f"train.run_dir={path} cannot be written ({probe}: {why}); choose a train.run_dir on a "
                          "writable disk")


def _read_only_fs(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _finished_a_step(run_dir: str) -> bool:
    """Whether the folder holds any result of a run: a checkpoint step folder or a logged train step."""
    ck = os.path.join(run_dir, "checkpoints")
    if os.path.isdir(ck) and any(d.isdigit() for d in os.listdir(ck)):
        return True
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return False
    with open(path, errors="replace") as f:
        return any('"kind": "train"' in line for line in f)


@dataclasses.dataclass(frozen=True)
class RunFolder:
    """What `check_run_dir` found at train.run_dir (nothing is written until `claim_run_dir`)."""
    path: str        # absolute
    resume: bool     # holds this run: resume from its newest complete checkpoint
    wipe: bool       # empty it when claimed (train.overwrite=true, or left by a run that never ran a step)
    note: str = ""   # one line for the log when the folder is reclaimed or marked
    saved_steps: Optional[int] = None  # train.steps of the run being resumed (its schedule's total)


def _listing(run_dir: str, n: int = 4) -> str:
    names = sorted(os.listdir(run_dir))
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def check_run_dir(cfg: Config) -> RunFolder:
    """Validate train.run_dir for `cfg` without touching it.

    - missing or empty: a fresh run;
    - anything but a run folder farskip_jax made (module docstring): ConfigError, whatever train.overwrite;
    - holds this run (config equal up to RESUMABLE_KEYS and mesh.*): resume;
    - train.overwrite=true: emptied when claimed;
    - holds another run that never finished a step (no checkpoint, no logged train step: e.g. one
      that failed while compiling) in a marked folder whose config.yaml loads: reclaimed, with a note;
    - holds another run's results, or a config.yaml this version cannot read: ConfigError naming the fix."""
    run_dir = os.path.abspath(cfg.train.run_dir)
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise ConfigError(f"train.run_dir={run_dir} is a file, not a folder; choose another train.run_dir")
    _check_writable(run_dir)
    if os.path.isdir(run_dir) and jax.process_index() == 0:  # the process that claims it
        _check_held(run_dir)
    if not (os.path.isdir(run_dir) and os.listdir(run_dir)):
        return RunFolder(run_dir, resume=False, wipe=False)
    found = folder_kind(run_dir)
    if found.kind == "import" or is_native(run_dir):  # an import folder also holds a config.yaml: never reclaim it
        raise ConfigError(f"train.run_dir: {describe_import_folder(run_dir)}, not a run folder; choose another "
                          f"train.run_dir (to train from it: init_from_hf=<the HF folder it came from>)")
    if found.kind == "export":
        raise ConfigError(f"train.run_dir={run_dir} is an HF export written by farskip_jax, not a run folder; choose "
                          "another train.run_dir (to train from it: init_from_hf=" + run_dir + ")")
    if found.kind != "run":
        raise ConfigError(f"train.run_dir={run_dir} exists and is not a farskip_jax run folder (it holds "
                          f"{_listing(run_dir)}); choose a new or empty train.run_dir. farskip_jax never empties a "
                          "folder it did not make: train.overwrite=true replaces only its own run folders")
    legacy = "" if found.marked else (f"marked {run_dir} as a farskip_jax run folder (made by a version that wrote "
                                      "no marker)")
    if cfg.train.overwrite:
        return RunFolder(run_dir, resume=False, wipe=True, note=legacy)
    try:
        with open(os.path.join(run_dir, "config.yaml")) as f:
            old = config_from_dict(yaml.safe_load(f))
    except (FarSkipError, OSError, yaml.YAMLError) as e:  # written by another version of the project
        raise ConfigError(f"train.run_dir={run_dir} belongs to a run whose config.yaml does not load under this "
                          f"version ({str(e).splitlines()[0][:300] if str(e) else type(e).__name__}); it is kept as it "
                          "is: choose another train.run_dir, or set train.overwrite=true to empty it and start "
                          "this run there") from None
    # the mesh may change between runs (orbax restores onto any sharding; the data order does not
    # depend on the process count in the default shard_by=rows)
    diff = [k for k in config_diff(old, cfg) if k not in RESUMABLE_KEYS and not k.startswith("mesh.")]
    if not diff:
        return RunFolder(run_dir, resume=True, wipe=False, note=legacy, saved_steps=old.train.steps)
    why = f"config differs at {diff}"
    if found.marked and not _finished_a_step(run_dir):
        return RunFolder(run_dir, resume=False, wipe=True,
                         note=f"reclaimed {run_dir}: it was left by a run that never finished a step ({why})")
    raise ConfigError(f"train.run_dir={run_dir} belongs to another run ({why}); "
                      "choose another train.run_dir, or set train.overwrite=true to delete it")


def claim_run_dir(cfg: Config, folder: RunFolder, *, write_config: bool = True) -> None:
    """Make `folder` this run's: create it, hold its lock (ConfigError when another process took it
    since check_run_dir), empty it if check_run_dir said so, mark it, write config.yaml (unless
    `write_config` is False: a finished run re-run with nothing left to do keeps its own)."""
    os.makedirs(folder.path, exist_ok=True)
    if folder.path not in _HELD:
        fd = _try_lock(folder.path)
        if fd is None:
            raise _busy(folder.path)
        _HELD[folder.path] = fd
    if folder.wipe:  # the contents only: the lock is on the folder itself
        for name in os.listdir(folder.path):
            p = os.path.join(folder.path, name)
            shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.remove(p)
    write_marker(folder.path, "run")
    path = os.path.join(folder.path, "config.yaml")
    if write_config or not os.path.isfile(path):
        with open(path + ".tmp", "w") as f:
            f.write(dump_config(cfg))
        os.replace(path + ".tmp", path)
    with open(os.path.join(folder.path, ".owner"), "w") as f:
        f.write(f"{os.getpid()} on {os.uname().nodename}")


def release_run_dir(path: str) -> None:
    """Give up this process's lock on run folder `path` (no-op when it holds none)."""
    fd = _HELD.pop(os.path.abspath(path), None)
    if fd is not None:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

"""Which folders farskip_jax made, so that nothing else is ever emptied or overwritten.

Run folders (train.run_dir), import folders (`python -m farskip_jax.convert import`) and exports
(`convert export`, distill.export_hf) carry MARKER, a small JSON file naming their kind, written only
by `write_marker`. `folder_kind` also recognises folders made before the marker existed by what only
the project writes there: a run holds config.yaml and .owner; an import holds config.yaml and
params.safetensors and nothing an import does not write; an export holds farskip_export.json and
nothing an export does not write.

    write_marker(path, "export")
    folder_kind(path)                       # FolderKind("run", marked=True) / FolderKind(None, False)
    check_output(out, "export", overwrite=True, what="the export folder")   # raises, or returns abspath

`train.overwrite`, `--overwrite` and the FCSD export replace a folder only when it is of their own
kind; a project import or export never replaces a run folder, nor writes into the files a run writes
(its checkpoints, best/, metrics, config.yaml, ...).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Optional

from farskip_jax.errors import ConfigError

MARKER = ".farskip_jax"
KINDS = ("run", "import", "export")
KIND_NAMES = {"run": "a training run folder", "import": "an import folder", "export": "an export folder"}

# what a run writes at the top of its folder: an import or export never goes there
RUN_ENTRIES = frozenset({MARKER, ".owner", "config.yaml", "metrics.jsonl", "checkpoints", "best", "tensorboard",
                         "early_stopping.json", "farskip_auto.json", "farskip_auto.md"})
_TOKENIZER = frozenset({"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"})
_IMPORT_FILES = frozenset({"config.yaml", "params.safetensors", "hf_config.json"}) | _TOKENIZER
_EXPORT_FILES = frozenset({"config.json", "farskip_export.json", "model.safetensors",
                           "model.safetensors.index.json"}) | _TOKENIZER
_EXPORT_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


@dataclasses.dataclass(frozen=True)
class FolderKind:
    kind: Optional[str]  # run | import | export | None (not made by farskip_jax, or missing / empty)
    marked: bool         # carries MARKER (False: recognised from a version that wrote none)


def write_marker(path: str, kind: str) -> None:
    """Mark folder `path` (which exists) as a farskip_jax folder of `kind`."""
    if kind not in KINDS:
        raise ValueError(f"folder kind {kind!r} is not one of {KINDS}")
    tmp = os.path.join(path, MARKER + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"kind": kind, "written_by": "farskip_jax"}, f)
    os.replace(tmp, os.path.join(path, MARKER))


def read_marker(path: str) -> Optional[str]:
    """The kind MARKER in folder `path` names, or None (no marker, or one that does not read)."""
    try:
        with open(os.path.join(path, MARKER)) as f:
            kind = json.load(f).get("kind")
    except (OSError, ValueError, AttributeError):
        return None
    return kind if kind in KINDS else None


def _only(names: set, allowed: frozenset, pattern=None) -> bool:
    return all(n in allowed or (pattern is not None and pattern.fullmatch(n)) for n in names)


def folder_kind(path: str) -> FolderKind:
    """What farskip_jax folder `path` is (module docstring); FolderKind(None, False) for anything else."""
    if not os.path.isdir(path):
        return FolderKind(None, False)
    kind = read_marker(path)
    if kind is not None:
        return FolderKind(kind, True)
    names = set(os.listdir(path))
    if {"config.yaml", "params.safetensors"} <= names:
        return FolderKind("import" if _only(names, _IMPORT_FILES) else None, False)
    if {"config.yaml", ".owner"} <= names:
        return FolderKind("run", False)
    if "farskip_export.json" in names and "config.json" in names and _only(names, _EXPORT_FILES, _EXPORT_SHARD):
        return FolderKind("export", False)
    return FolderKind(None, False)


def run_folder_at_or_above(path: str) -> Optional[str]:
    """The nearest folder at or above `path` (absolute) that is a training run folder, or None."""
    p = os.path.abspath(path)
    while True:
        if folder_kind(p).kind == "run":
            return p
        parent = os.path.dirname(p)
        if parent == p:
            return None
        p = parent


def _sample(path: str, n: int = 3) -> str:
    names = sorted(os.listdir(path))
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def check_output(path: str, kind: str, *, overwrite: bool, what: str, flag: str = "--overwrite") -> str:
    """The absolute path an import or export (`kind`) may write as `path`; ConfigError when it would
    touch anything else: a file there, a training run folder or the files a run writes in it, or an
    existing non-empty folder that is not a farskip_jax folder of `kind` (`overwrite` replaces only
    those; without it any non-empty folder is refused). `what` names the path in the message, `flag`
    the switch that allows replacing."""
    out = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"{what} {out} is a file, not a folder; choose a new folder")
    run = run_folder_at_or_above(out)
    if run == out:
        raise ConfigError(f"{what} {out} is a training run folder: an {kind} never replaces a run (not even with "
                          f"{flag}); choose a new folder (inside the run, e.g. {os.path.join(out, 'hf')}, is fine)")
    if run is not None:
        top = os.path.relpath(out, run).split(os.sep)[0]
        if top in RUN_ENTRIES:
            raise ConfigError(f"{what} {out} lies in {os.path.join(run, top)}, which the run in {run} writes itself; "
                              f"choose a new folder (e.g. {os.path.join(run, 'hf')})")
    if not (os.path.isdir(out) and os.listdir(out)):
        return out
    found = folder_kind(out)
    if found.kind != kind:
        is_what = KIND_NAMES[found.kind] if found.kind else f"not a folder farskip_jax wrote (it holds {_sample(out)})"
        raise ConfigError(f"{what} {out} already exists and is {is_what}; {flag} replaces only {KIND_NAMES[kind]} "
                          "that farskip_jax wrote: choose a new folder, or move that one away yourself")
    if not overwrite:
        raise ConfigError(f"{what} {out} already exists ({KIND_NAMES[kind]}); pass {flag} to replace it, or choose a "
                          "new folder")
    return out

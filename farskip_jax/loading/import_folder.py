"""Is a folder one of our import folders (config.yaml + params.safetensors), and what is it.

convert/native.py writes such folders and loading/native.py reads them; readers of HF folders and run
folders use `is_native` and `describe_import_folder` to name one when it is passed to them by mistake.
"""

from __future__ import annotations

import os

from farskip_jax.config import load_yaml_tree

PARAMS = "params.safetensors"


def is_native(path: str) -> bool:
    return os.path.isfile(os.path.join(path, PARAMS)) and os.path.isfile(os.path.join(path, "config.yaml"))


def describe_import_folder(path: str) -> str:
    """"PATH is an import folder written by ... (imported from SOURCE)" for error messages."""
    src = None
    try:
        src = (load_yaml_tree(os.path.join(path, "config.yaml")) or {}).get("init_from_hf")
    except Exception:  # noqa: BLE001 -- a description only: an unreadable config.yaml names no source
        pass
    return (f"{path} is an import folder written by `python -m farskip_jax.convert import` (config.yaml + {PARAMS}"
            + (f", imported from {src}" if src else "") + ")")


def flat_key(path) -> str:
    """The tensor name of an NNX state path in params.safetensors ("layers.0.attn.q_proj.w")."""
    return ".".join(str(p) for p in path)

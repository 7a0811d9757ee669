"""Reading an import folder (what `python -m farskip_jax.convert import` writes) back onto devices.

    cfg, model, hf = load_native(path, mesh=None, overrides=["farskip.preset=farskip"])

`load_native` streams params.safetensors onto devices/a mesh like import_hf does, its overrides applied
with import_hf's connectivity rules (loading/connectivity.py: the folder's farskip section stands for an
exported one); hf is the source's config.json when the folder kept it. It is read by
`python -m farskip_jax.convert export` and `eval.py --hf`.
"""

from __future__ import annotations

import os
from typing import Optional

import jax
import numpy as np
from flax import nnx

from farskip_jax.config import Config, apply_overrides, from_dict, kernels_env_overrides, load_yaml_tree
from farskip_jax.errors import CheckpointError
from farskip_jax.loading.connectivity import EXPORT_KEY, import_connectivity
from farskip_jax.loading.hf_folder import abstract_model, override_tree, target_shardings
from farskip_jax.loading.import_folder import PARAMS, flat_key, is_native
from farskip_jax.loading.reader import read_json
from farskip_jax.loading.safetensors_io import MappedTensor, read_header
from farskip_jax.model.transformer import Transformer


def native_config(path: str, overrides=None) -> Config:
    """The Config of an import folder with `overrides` (["a.b=v"] or {"a.b": v}) applied as import_hf
    applies them: a farskip.preset override drops the folder's attn_input / moe_input refinements."""
    tree = apply_overrides(load_yaml_tree(os.path.join(path, "config.yaml")), kernels_env_overrides())
    section, _ = import_connectivity({EXPORT_KEY: tree.get("farskip") or {}}, None, overrides)
    tree["farskip"] = section
    return from_dict(Config, override_tree(tree, overrides))


def load_native(path: str, mesh=None, overrides=None, routed_compute=None) -> tuple[Config, Transformer, Optional[dict]]:
    """(Config, Transformer, source HF config or None) of a folder written by write_native_from_hf."""
    if not is_native(path):
        raise CheckpointError(f"{path} is not a farskip_jax import folder (needs config.yaml and {PARAMS})")
    cfg = native_config(path, overrides)
    infos = read_header(os.path.join(path, PARAMS))
    model = abstract_model(cfg, routed_compute)
    graphdef, state = nnx.split(model)
    params = dict(nnx.to_flat_state(state))
    missing = [flat_key(p) for p in params if flat_key(p) not in infos]
    if missing:
        raise CheckpointError(f"{path}/{PARAMS} lacks parameters {missing[:5]}")
    sharding_of = target_shardings(state, mesh)
    for p, var in params.items():
        info = infos[flat_key(p)]
        want = tuple(var.get_value().shape)
        if info.shape != want:
            raise CheckpointError(f"shape mismatch for {flat_key(p)}: expected {want}, found {info.shape}")
        t, d = MappedTensor(info), np.dtype(var.get_value().dtype)
        var.set_value(jax.make_array_from_callback(want, sharding_of(p), lambda idx, t=t, d=d: t[idx].astype(d)))
    hf = None
    if os.path.isfile(os.path.join(path, "hf_config.json")):
        hf = read_json(os.path.join(path, "hf_config.json"), "hf_config.json (the source's config.json)")
    return cfg, nnx.merge(graphdef, state), hf

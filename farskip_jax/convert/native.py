"""The folder `python -m farskip_jax.convert import` writes: our config + parameters, streamable.

    OUT_DIR/config.yaml          the resolved Config (native_config reads it; init_from_hf = the source)
    OUT_DIR/params.safetensors   one tensor per parameter, named by its NNX path ("layers.0.attn.q_proj.w")
    OUT_DIR/hf_config.json       the source config.json (export uses it as the base)
    OUT_DIR/tokenizer.json ...   copied from the HF folder when present
    OUT_DIR/.farskip_jax         the marker of an import folder (folders.py)

`write_native_from_hf` converts tensor by tensor straight from the HF memory map (no JAX arrays)
into a temporary folder renamed into place at the end; an existing OUT_DIR is replaced (overwrite)
only when it is an import folder farskip_jax wrote, never a run folder (folders.check_output);
`load_native` streams it back onto devices/a mesh like import_hf does, its overrides applied with
import_hf's connectivity rules (convert/connectivity.py: the folder's farskip section stands for an
exported one). It is read by `python -m farskip_jax.convert export` and `eval.py --hf`; a run folder
reader or init_from_hf given one names it (describe_import_folder) and what to do instead.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Callable, Optional

import jax
import numpy as np
from flax import nnx

from farskip_jax.config import Config, apply_overrides, dump_config, from_dict, kernels_env_overrides, load_yaml_tree
from farskip_jax.convert.import_folder import PARAMS, is_native
from farskip_jax.convert.connectivity import EXPORT_KEY, describe, import_connectivity
from farskip_jax.convert.families import family_for
from farskip_jax.convert.loader import (abstract_model, import_config, open_checkpoint, override_tree, target_shardings,
                                        validate)
from farskip_jax.convert.reader import read_json
from farskip_jax.convert.safetensors_io import read_header, MappedTensor, write_file
from farskip_jax.errors import CheckpointError
from farskip_jax.folders import check_output, write_marker
from farskip_jax.model.transformer import Transformer


def _key(path) -> str:
    return ".".join(str(p) for p in path)


def _commit(tmp: str, out_dir: str, overwrite: bool) -> None:
    write_marker(tmp, "import")
    check_output(out_dir, "import", overwrite=overwrite, what="the import folder")  # it may have changed since
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.chmod(tmp, 0o755)
    os.rename(tmp, out_dir)


def write_native_from_hf(hf_dir: str, out_dir: str, overrides=None, *, dtype: Optional[str] = None,
                         overwrite: bool = False, progress: Optional[Callable] = None,
                         report: Optional[Callable[[str], None]] = None) -> Config:
    """Convert an HF folder into our folder format, one tensor at a time; returns the Config.

    The connectivity is import_config's (an exported "farskip_jax" section, else the family's;
    overrides win); `report` gets the line naming it and its source before any tensor is read."""
    out_dir = check_output(out_dir, "import", overwrite=overwrite, what="the import folder")
    ckpt = open_checkpoint(hf_dir)
    ov = list(overrides or []) + ([f"runtime.param_dtype={dtype}"] if dtype else [])
    cfg, origin = import_config(ckpt.config, ov, source=ckpt.path)
    if report:
        report(describe(cfg, origin))
    fam = family_for(ckpt.config)
    params = dict(nnx.to_flat_state(nnx.state(abstract_model(cfg))))
    specs = fam.specs(cfg)
    validate(ckpt, specs, params, ckpt.config, cfg.model.tie_embeddings, getattr(fam, "ignored", None))
    by_key = {_key(s.path): s for s in specs}
    entries = [(_key(s.path), tuple(s.shape), np.dtype(params[s.path].get_value().dtype)) for s in specs]
    dtypes = dict((k, d) for k, _, d in entries)
    count = {"i": 0}

    def produce(key: str) -> np.ndarray:
        if progress:
            progress(count["i"], len(entries), by_key[key])
        count["i"] += 1
        return by_key[key].read(ckpt).astype(dtypes[key])

    os.makedirs(os.path.dirname(out_dir) or ".", exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".import-", dir=os.path.dirname(out_dir) or ".")
    try:
        write_file(os.path.join(tmp, PARAMS), entries, produce, metadata={"format": "farskip_jax"})
        with open(os.path.join(tmp, "config.yaml"), "w") as f:
            f.write(dump_config(cfg))
        with open(os.path.join(tmp, "hf_config.json"), "w") as f:
            json.dump(ckpt.config, f, indent=2)
        for fn in ckpt.extra_files():
            shutil.copy(os.path.join(ckpt.path, fn), os.path.join(tmp, fn))
        _commit(tmp, out_dir, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return cfg


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
    missing = [_key(p) for p in params if _key(p) not in infos]
    if missing:
        raise CheckpointError(f"{path}/{PARAMS} lacks parameters {missing[:5]}")
    sharding_of = target_shardings(state, mesh)
    for p, var in params.items():
        info = infos[_key(p)]
        want = tuple(var.get_value().shape)
        if info.shape != want:
            raise CheckpointError(f"shape mismatch for {_key(p)}: expected {want}, found {info.shape}")
        t, d = MappedTensor(info), np.dtype(var.get_value().dtype)
        var.set_value(jax.make_array_from_callback(want, sharding_of(p), lambda idx, t=t, d=d: t[idx].astype(d)))
    hf = None
    if os.path.isfile(os.path.join(path, "hf_config.json")):
        hf = read_json(os.path.join(path, "hf_config.json"), "hf_config.json (the source's config.json)")
    return cfg, nnx.merge(graphdef, state), hf

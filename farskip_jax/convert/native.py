"""The folder `python -m farskip_jax.convert import` writes: our config + parameters, streamable.

    OUT_DIR/config.yaml          the resolved Config (native_config reads it; init_from_hf = the source)
    OUT_DIR/params.safetensors   one tensor per parameter, named by its NNX path ("layers.0.attn.q_proj.w")
    OUT_DIR/hf_config.json       the source config.json (export uses it as the base)
    OUT_DIR/tokenizer.json ...   copied from the HF folder when present
    OUT_DIR/.farskip_jax         the marker of an import folder (folders.py)

`write_native_from_hf` converts tensor by tensor straight from the HF memory map (no JAX arrays)
into a temporary folder renamed into place at the end; an existing OUT_DIR is replaced (overwrite)
only when it is an import folder farskip_jax wrote, never a run folder (folders.check_output);
loading/native.py reads it back (`load_native`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Callable, Optional

import numpy as np
from flax import nnx

from farskip_jax.config import Config, dump_config
from farskip_jax.folders import check_output, write_marker
from farskip_jax.loading.connectivity import describe
from farskip_jax.loading.families import family_for
from farskip_jax.loading.hf_folder import abstract_model, import_config, open_checkpoint, validate
from farskip_jax.loading.import_folder import PARAMS, flat_key
from farskip_jax.loading.safetensors_io import write_file


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
    by_key = {flat_key(s.path): s for s in specs}
    entries = [(flat_key(s.path), tuple(s.shape), np.dtype(params[s.path].get_value().dtype)) for s in specs]
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

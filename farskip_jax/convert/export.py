"""Export a farskip_jax Transformer to an HF folder that transformers loads, one tensor at a time.

    export_hf(model, cfg, "out/hf", base_config=hf_config_dict, tokenizer_dir="in/hf")

The family comes from `base_config` (the config.json the model was imported from; default: the
config.json of `cfg.init_from_hf`) or `family` (a model_type, for models trained from scratch). config.json = the family's HF config of `cfg` over
`base_config`, plus our FarSkip settings under "farskip_jax" (connectivity preset, converted layers,
skip distance); a DeepSeek-V3-layout model with FarSkip on also gets the Instella-style keys
("farskip", "farskip_start_idx", "farskip_end_idx") so it re-imports with FarSkip on. Tensors are
written by a streaming safetensors writer (sharded past `max_shard_bytes`, with an index). Everything
goes to a temporary folder renamed into place at the end: on failure OUT_DIR is not created.
A model with `model.scan_layers` exports the same folder: each stacked parameter is sliced per layer
on device (model/stacking.per_layer_values) and written under the per-layer HF names.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Optional

import jax
import numpy as np
from flax import nnx

from farskip_jax.config import Config
from farskip_jax.convert.families import family_by_name, family_for, farskip_native, text_part
from farskip_jax.convert.reader import TOKENIZER_FILES, read_hf_config
from farskip_jax.convert.safetensors_io import write_file
from farskip_jax.errors import CheckpointError
from farskip_jax.model.stacking import per_layer_values, plan_segments
from farskip_jax.model.transformer import Transformer

DTYPE_NAMES = {"float32": np.float32, "bfloat16": "bfloat16", "float16": np.float16}


def farskip_settings(cfg: Config) -> dict:
    fs = cfg.farskip
    n = cfg.model.num_layers
    return {"preset": fs.preset, "layers": sorted(fs.converted_layers(n)) if fs.preset != "standard" else [],
            "attn_input": fs.attn_input, "moe_input": fs.moe_input, "skip_distance": fs.skip_distance}


def hf_config_for(cfg: Config, base_config: Optional[dict] = None, family: Optional[str] = None) -> tuple[dict, object]:
    """(config.json dict, family module) for `cfg`."""
    if base_config is None and family is None:
        raise CheckpointError("export needs the source config.json (base_config) or a family model_type")
    base = dict(base_config) if base_config is not None else {"model_type": family}
    fam = family_for(base) if base_config is not None else family_by_name(family)
    base.setdefault("architectures", [fam.ARCHITECTURE])
    out = fam.hf_config(cfg, base)
    out["farskip_jax"] = farskip_settings(cfg)
    layers = out["farskip_jax"]["layers"]
    instella_style = fam is farskip_native or out.get("model_type") == "deepseek_v3"
    if instella_style:
        contiguous = bool(layers) and layers == list(range(layers[0], layers[-1] + 1))
        on = cfg.farskip.preset in ("farskip", "attn_only", "mlp_only") and contiguous and cfg.farskip.skip_distance == 1
        out.update(farskip=on, attn_only_farskip=cfg.farskip.preset == "attn_only",
                   mlp_only_farskip=cfg.farskip.preset == "mlp_only")
        if on:
            out.update(farskip_start_idx=layers[0], farskip_end_idx=layers[-1])
    out.pop("transformers_version", None)
    return out, fam


def _np_dtype(name: str):
    return np.dtype(DTYPE_NAMES[name]) if name != "bfloat16" else np.dtype(jax.numpy.bfloat16)


def export_hf(model: Transformer, cfg: Config, out_dir: str, *, base_config: Optional[dict] = None,
              family: Optional[str] = None, dtype: str = "float32", tokenizer_dir: Optional[str] = None,
              max_shard_bytes: Optional[int] = None, overwrite: bool = False, progress=None) -> str:
    """Write `model` as an HF checkpoint folder at out_dir; returns its path."""
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and not overwrite:
        raise CheckpointError(f"{out_dir} already exists; pass overwrite=True (CLI: --overwrite) or choose a new folder")
    src = cfg.init_from_hf
    if base_config is None and family is None and src and os.path.isfile(os.path.join(src, "config.json")):
        base_config = read_hf_config(src)  # the folder the model was imported from
        tokenizer_dir = tokenizer_dir or src
    if base_config is not None:
        base_config = text_part(base_config)[0]  # a multimodal source exports its language model
    hf_cfg, fam = hf_config_for(cfg, base_config, family)
    hf_cfg["dtype"] = dtype
    specs = fam.specs(cfg)
    values = per_layer_values(dict(nnx.to_flat_state(nnx.state(model))),
                              plan_segments(cfg) if cfg.model.scan_layers else None)  # stacked: one row per layer
    np_dtype = _np_dtype(dtype)

    # hf name -> (shape, [specs producing it]) in spec order
    order: dict[str, list] = {}
    for s in specs:
        for name, shape in s.hf_shapes().items():
            order.setdefault(name, [shape, []])[1].append(s)
    cache: dict = {}

    def param(spec) -> np.ndarray:
        if cache.get("path") != spec.path:
            cache.clear()
            cache.update(path=spec.path, arr=np.asarray(jax.device_get(values[spec.path]())))
        return cache["arr"]

    def produce(name: str) -> np.ndarray:
        shape, producers = order[name]
        if progress:
            progress(name)
        buf = None
        for s in producers:
            for n, arr, where in s.hf_pieces(param(s)):
                if n != name:
                    continue
                if where is None:
                    return arr.astype(np_dtype)
                if buf is None:
                    buf = np.zeros(shape, np_dtype)
                ax, start = where
                sl = [slice(None)] * len(shape)
                sl[ax] = slice(start, start + arr.shape[ax])
                buf[tuple(sl)] = arr
        return buf

    names = list(order)
    itemsize = np_dtype.itemsize
    shards, cur, size = [], [], 0
    for n in names:
        nbytes = int(np.prod(order[n][0])) * itemsize
        if cur and max_shard_bytes and size + nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(n)
        size += nbytes
    shards.append(cur)

    parent = os.path.dirname(out_dir) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
    try:
        files = ["model.safetensors"] if len(shards) == 1 else [
            f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        weight_map = {}
        for fname, group in zip(files, shards):
            write_file(os.path.join(tmp, fname), [(n, tuple(order[n][0]), np_dtype) for n in group], produce)
            weight_map.update({n: fname for n in group})
        if len(files) > 1:
            total = sum(int(np.prod(order[n][0])) * itemsize for n in names)
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_cfg, f, indent=2)
        if tokenizer_dir:
            for fn in TOKENIZER_FILES:
                src = os.path.join(tokenizer_dir, fn)
                if os.path.isfile(src):
                    shutil.copy(src, os.path.join(tmp, fn))
        os.chmod(tmp, 0o755)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir

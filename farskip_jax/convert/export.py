"""Export a farskip_jax Transformer to an HF folder that transformers loads, one tensor at a time.

    export_hf(model, cfg, "out/hf", base_config=hf_config_dict, tokenizer_dir="in/hf")

The family comes from `family` (a model_type) or else `base_config` (the config.json the model was
imported from; default: the config.json of `cfg.init_from_hf`); `family` over a base config keeps
the base's other keys (token ids, ...). The family must hold the model (convert/fit.py: the
config.json it writes reads back to the same architecture and tensors), else CheckpointError naming
what does not fit and the families that do. config.json = the family's HF config of `cfg` over the
base, plus our FarSkip settings under "farskip_jax" (connectivity preset, converted layers, skip
distance). DeepSeek-V3 layouts also get the FarSkip-native keys ("farskip", "farskip_start_idx",
"farskip_end_idx", "attn_only_farskip", "mlp_only_farskip") when the native layout can express the
connectivity, "farskip": false otherwise; `family="instella_moe"` writes the FarSkip-native layout
itself (`architectures: [InstellaMoEForCausalLM]`, model_type deepseek_v3, as Instella-MoE ships).
An export whose readers will not run the student's connectivity is reported (`report`, default
warnings.warn). `source` (e.g. {"run": RUN_DIR, "checkpoint": "best", "step": 120}) is written to
farskip_export.json: what the folder holds. Tensors are written by a streaming safetensors writer
(sharded past `max_shard_bytes`, with an index). Everything goes to a temporary folder renamed into
place at the end: on failure OUT_DIR is not created. The folder is marked as an export
(folders.write_marker); an existing OUT_DIR is replaced (overwrite=True) only when it is an export
farskip_jax wrote, never a run folder or the files a run writes (folders.check_output, checked before
anything is read and again before the rename). A model with `runtime.scan_layers` exports the same
folder: each stacked parameter is sliced per layer on device (convert/layer_keys.per_layer_values).

`run_export_dir(export_hf, run_dir)` is where a run's `distill.export_hf` goes: a relative path is
inside the run folder; the run folder itself, what the run writes in it (checkpoints, best, ...), a
folder holding the run, and an existing folder that is not this run's export are refused.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from typing import Callable, Optional

import jax
import numpy as np
from flax import nnx

from farskip_jax.config import Config
from farskip_jax.loading.families import family_by_name, family_for, farskip_native, text_part
from farskip_jax.loading.families.common import rope_notes
from farskip_jax.loading.reader import TOKENIZER_FILES, read_hf_config
from farskip_jax.loading.safetensors_io import write_file
from farskip_jax.convert.fit import connectivity_notes, families_that_fit, family_problems, native_keys
from farskip_jax.errors import CheckpointError, ConfigError
from farskip_jax.folders import RUN_ENTRIES, check_output, write_marker
from farskip_jax.loading.layer_keys import per_layer_values
from farskip_jax.model.stacking import plan_segments
from farskip_jax.model.transformer import Transformer

DTYPE_NAMES = {"float32": np.float32, "bfloat16": "bfloat16", "float16": np.float16}


EXPORT_INFO = "farskip_export.json"
NATIVE_KEYS = ("farskip", "farskip_start_idx", "farskip_end_idx", "attn_only_farskip", "mlp_only_farskip")


def farskip_settings(cfg: Config) -> dict:
    fs = cfg.farskip
    n = cfg.model.num_layers
    return {"preset": fs.preset, "layers": sorted(fs.converted_layers(n)) if fs.preset != "standard" else [],
            "attn_input": fs.attn_input, "moe_input": fs.moe_input, "skip_distance": fs.skip_distance}


def _target(base_config: Optional[dict], family: Optional[str]) -> tuple[dict, object]:
    """(base config.json dict, family module) of an export: `family` wins over the base's family."""
    if family is None:
        return dict(base_config), family_for(base_config)
    fam = family_by_name(family)
    base = dict(base_config or {})
    if base.get("model_type") != family or fam is farskip_native:
        base.pop("architectures", None)
        base.pop("auto_map", None)
    if fam is farskip_native:  # Instella-MoE's own config.json: model_type deepseek_v3, its architecture
        base.update(model_type="deepseek_v3", architectures=[fam.ARCHITECTURE])
    else:
        base["model_type"] = family
    return base, fam


def _build(cfg: Config, base: dict, fam) -> dict:
    base = dict(base)
    base.setdefault("architectures", [fam.ARCHITECTURE])
    out = fam.hf_config(cfg, base)
    out["farskip_jax"] = farskip_settings(cfg)
    for k in NATIVE_KEYS:
        out.pop(k, None)
    if fam is farskip_native or out.get("model_type") == "deepseek_v3":
        keys, _ = native_keys(cfg)
        out.update(keys if keys is not None else dict(farskip=False, attn_only_farskip=False, mlp_only_farskip=False))
    out.pop("transformers_version", None)
    return out


def hf_config_for(cfg: Config, base_config: Optional[dict] = None, family: Optional[str] = None) -> tuple[dict, object]:
    """(config.json dict, family module) for `cfg`; CheckpointError when the family cannot hold the model."""
    if base_config is None and family is None:
        raise CheckpointError("export needs the source config.json (base_config) or a family model_type")
    base, fam = _target(base_config, family)
    out = _build(cfg, base, fam)
    problems = family_problems(cfg, fam, out)
    if problems:
        fits = families_that_fit(cfg, lambda mt: (_build(cfg, *_target(None, mt)), family_by_name(mt)))
        name = family or out.get("model_type")
        raise CheckpointError(
            f"HF family {name!r} cannot hold this model (this model -> what a folder of {name} reads back: "
            f"{'; '.join(problems)}); families that can: "
            + (", ".join(fits) if fits else "none of the supported ones (keep the farskip_jax checkpoint)")
            + (" (CLI: --family MODEL_TYPE)" if fits else ""))
    return out, fam


def export_target(cfg: Config, base_config: Optional[dict] = None, family: Optional[str] = None) -> tuple[dict, object]:
    """(config.json dict, family module) export_hf writes for cfg: the base is `base_config`, else the
    config.json of cfg.init_from_hf when that folder still has one (its language model for a
    multimodal source). Reads no weights: callers check a target before loading a checkpoint."""
    src = cfg.init_from_hf
    if base_config is None and src and os.path.isfile(os.path.join(src, "config.json")):
        base_config = read_hf_config(src)
    if base_config is not None:
        base_config = text_part(base_config)[0]
    return hf_config_for(cfg, base_config, family)


def run_export_dir(export_hf: str, run_dir: str) -> str:
    """The folder a run's `distill.export_hf` names: a relative path is inside the run folder (one that
    already leads into it from the working directory is taken as it is); an absolute path is used as
    given. ConfigError when the export would replace the run folder, a folder holding it or what the
    run writes in it (checkpoints, best, ...), or an existing folder that is not this run's export."""
    run_dir = os.path.abspath(run_dir)
    p = os.path.expanduser(export_hf)
    inside = lambda q: os.path.commonpath([q, run_dir]) == run_dir  # noqa: E731
    out = os.path.abspath(p) if os.path.isabs(p) or inside(os.path.abspath(p)) else os.path.join(run_dir, p)
    out = os.path.normpath(out)
    what = f"distill.export_hf={export_hf!r}:"
    if os.path.commonpath([out, run_dir]) == out:
        raise ConfigError(f"{what} {out} is the run folder {run_dir} or holds it; the export replaces its folder: "
                          "set distill.export_hf to a new folder inside the run (a relative path, e.g. hf)")
    if inside(out) and os.path.relpath(out, run_dir).split(os.sep)[0] in RUN_ENTRIES:
        top = os.path.relpath(out, run_dir).split(os.sep)[0]
        raise ConfigError(f"{what} {out} lies in {os.path.join(run_dir, top)}, which the run writes itself; set "
                          "distill.export_hf to a new folder inside the run (a relative path, e.g. hf)")
    if os.path.exists(out) and not inside(out):
        info = read_export_info(out)
        if (info or {}).get("run") != run_dir:
            whose = f"the export of {info.get('run')}" if info and info.get("run") else "not an export of this run"
            raise ConfigError(f"{what} {out} already exists and is {whose}; a run writes its "
                              f"export only into its own folder or a new one: set distill.export_hf to a path inside "
                              f"the run folder (a relative one, e.g. hf) or to a new folder, or delete {out}")
    return check_output(out, "export", overwrite=True, what=what, flag="the FCSD export (distill.export_hf)")


def read_export_info(folder: str) -> Optional[dict]:
    """The farskip_export.json of an exported folder (what it holds), or None."""
    path = os.path.join(folder, EXPORT_INFO)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _np_dtype(name: str):
    return np.dtype(DTYPE_NAMES[name]) if name != "bfloat16" else np.dtype(jax.numpy.bfloat16)


def export_hf(model: Transformer, cfg: Config, out_dir: str, *, base_config: Optional[dict] = None,
              family: Optional[str] = None, dtype: str = "float32", tokenizer_dir: Optional[str] = None,
              max_shard_bytes: Optional[int] = None, overwrite: bool = False, progress=None,
              report: Optional[Callable[[str], None]] = None, source: Optional[dict] = None) -> str:
    """Write `model` as an HF checkpoint folder at out_dir; returns its path (module docstring)."""
    out_dir = check_output(out_dir, "export", overwrite=overwrite, what="the export folder")
    hf_cfg, fam = export_target(cfg, base_config, family)
    src = cfg.init_from_hf
    if base_config is None and src and os.path.isfile(os.path.join(src, "config.json")):
        tokenizer_dir = tokenizer_dir or src  # the folder the model was imported from
    hf_cfg["dtype"] = dtype
    for line in connectivity_notes(cfg, hf_cfg) + rope_notes(cfg):
        (report or (lambda m: warnings.warn(m, stacklevel=3)))(line)
    specs = fam.specs(cfg)
    values = per_layer_values(dict(nnx.to_flat_state(nnx.state(model))),
                              plan_segments(cfg) if cfg.runtime.scan_layers else None)  # stacked: one row per layer
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
        if source is not None:
            with open(os.path.join(tmp, EXPORT_INFO), "w") as f:
                json.dump(dict(source, family=hf_cfg.get("model_type"), architectures=hf_cfg.get("architectures"),
                               farskip=hf_cfg["farskip_jax"]), f, indent=2)
        if tokenizer_dir:
            for fn in TOKENIZER_FILES:
                src = os.path.join(tokenizer_dir, fn)
                if os.path.isfile(src):
                    shutil.copy(src, os.path.join(tmp, fn))
        write_marker(tmp, "export")
        os.chmod(tmp, 0o755)
        check_output(out_dir, "export", overwrite=overwrite, what="the export folder")  # it may have changed since
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir

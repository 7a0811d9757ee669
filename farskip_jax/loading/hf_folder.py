"""Import an HF checkpoint folder into a farskip_jax Transformer, streaming one tensor at a time.

    cfg, model = import_hf("path/to/hf", mesh=None, overrides=["farskip.preset=farskip"])

1. config.json -> our Config through the family module (overrides applied on top, then validated);
   the connectivity defaults to the "farskip_jax" section an export wrote (loading/connectivity.py),
   so an exported FCSD student re-imports as the FarSkip model it was trained as;
2. an abstract model (`nnx.eval_shape`, no memory) gives every parameter's shape and dtype;
3. every parameter is checked against the family's tensor specs (missing / unexpected HF tensors and
   shape mismatches raise CheckpointError naming the tensor), then built with
   `jax.make_array_from_callback(shape, sharding, cb)`: each device shard's callback reads only its
   slice from the memory-mapped safetensors and casts it to the parameter dtype (bf16/fp32). No host
   ever holds the whole model, only the slices of one tensor that its devices own. Under
   `runtime.scan_layers` a stacked parameter [repeats, ...] reads each of its layers' tensors
   (the HF names stay per layer; loading/layer_keys.py maps them).

With a mesh the model is placed as `parallel.build.create_model` places it: target shardings follow
the logical-axis rules (`parallel.sharding.state_shardings`), and the routed-expert exchange is
`parallel.build.routed_compute_on(cfg, mesh)`. A Federation of Experts with expert parallelism
(`parallel.build.is_foe_parallel`) goes onto the FoE mesh built from the given mesh's devices
(experts over group x expert, `parallel.foe.foe_state_shardings`). Without a mesh, everything goes
to the first device.
"""

from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import replace
from typing import Callable, Iterable, Optional, Union

import jax
import numpy as np
from flax import nnx
from jax.sharding import SingleDeviceSharding

from farskip_jax.config import Config, apply_overrides, from_dict
from farskip_jax.loading.connectivity import describe, import_connectivity
from farskip_jax.loading.families import family_for, text_part
from farskip_jax.loading.hf_fields import read_family_config
from farskip_jax.loading.import_folder import describe_import_folder, is_native
from farskip_jax.loading.reader import HFCheckpoint
from farskip_jax.loading.spec import TensorSpec
from farskip_jax.errors import CheckpointError
from farskip_jax.loading.layer_keys import stacked_specs
from farskip_jax.model.stacking import plan_segments
from farskip_jax.model.transformer import Transformer
from farskip_jax.parallel.build import placement_mesh, routed_compute_on, state_shardings_on

Overrides = Union[None, Iterable[str], dict]
ALWAYS_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def open_checkpoint(path: str) -> HFCheckpoint:
    """HFCheckpoint of `path`; for a multimodal checkpoint, the view of its language model.
    CheckpointError for an import folder of ours (convert/native.py), naming what it is and what reads it."""
    if is_native(path):
        raise CheckpointError(f"{describe_import_folder(path)}, not an HF folder: pass the HF folder it was imported "
                              f"from, or use it as it is with `eval.py --hf {path}` or `python -m "
                              f"farskip_jax.convert export {path} HF_DIR` (an HF folder for init_from_hf)")
    ckpt = HFCheckpoint(path)
    hf, prefix = text_part(ckpt.config)
    return ckpt.view(prefix, hf) if prefix else ckpt


def import_config(hf: dict, overrides: Overrides = None, *, source: Optional[str] = None) -> tuple[Config, str]:
    """(our Config, origin of its connectivity) for an HF config.json dict; `overrides`: ["a.b=v", ...]
    or {"a.b": v}. The farskip section defaults to the one export_hf saved under "farskip_jax", else
    the family's (standard, or the Instella keys of a FarSkip-native layout); overrides win
    (loading/connectivity.py). origin: "family default" | "exported config.json ..." | "override ..."."""
    if hf.get("quantization_config"):
        q = hf["quantization_config"].get("quant_method", "?")
        raise CheckpointError(f"quantized checkpoints ({q}) are not supported; dequantize to bf16/fp32 safetensors first")
    where = os.path.join(source, "config.json") if source else "config.json"
    tree = read_family_config(hf, family_for(hf).config_tree, where)  # fields checked: one error naming a bad one
    section, origin = import_connectivity(hf, tree.get("farskip"), overrides)
    tree["farskip"] = section
    if source:
        tree["init_from_hf"] = source
    return from_dict(Config, override_tree(tree, overrides)), origin


def override_tree(tree: dict, overrides: Overrides) -> dict:
    """`tree` with dotted overrides applied: ["a.b=v", ...] (values parsed as YAML) or {"a.b": v}."""
    if isinstance(overrides, dict):
        tree = dict(tree)
        for key, value in overrides.items():
            node = tree
            parts = key.split(".")
            for p in parts[:-1]:
                node[p] = dict(node.get(p) or {})
                node = node[p]
            node[parts[-1]] = value
        return tree
    return apply_overrides(tree, list(overrides)) if overrides else tree


def hf_to_config(hf: dict, overrides: Overrides = None, *, source: Optional[str] = None) -> Config:
    """Our Config for an HF config.json dict (import_config without the origin)."""
    return import_config(hf, overrides, source=source)[0]


def abstract_model(cfg: Config, routed_compute=None) -> Transformer:
    return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), routed_compute=routed_compute))


def _path_str(path) -> str:
    return ".".join(str(p) for p in path)


def validate(ckpt: HFCheckpoint, specs: list[TensorSpec], params: dict, hf: dict, tied: bool, ignored=None) -> None:
    """Every parameter has a spec, every spec's HF tensors exist with the right shapes, nothing is left over."""
    spec_paths = {s.path for s in specs}
    uncovered = sorted(_path_str(p) for p in params if p not in spec_paths)
    if uncovered:
        raise CheckpointError(f"internal: no HF tensor maps to parameters {uncovered[:5]} (family module incomplete)")
    stray = sorted(_path_str(p) for p in spec_paths if p not in params)
    if stray:
        raise CheckpointError(f"internal: tensor specs name parameters the model lacks: {stray[:5]}")
    wanted = {n for s in specs for n in s.hf}
    missing = sorted(n for n in wanted if not ckpt.has(n))
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"{ckpt.path}: missing tensor(s) {missing[:5]}{more} that config.json implies; "
                              "the checkpoint is incomplete or config.json does not match it")
    extra = [n for n in ckpt.names() if n not in wanted and not ALWAYS_IGNORED.match(n)
             and not (tied and n == "lm_head.weight") and not (ignored and ignored(n, hf))]
    if extra:
        more = f" (and {len(extra) - 5} more)" if len(extra) > 5 else ""
        raise CheckpointError(f"{ckpt.path}: unexpected tensor(s) {extra[:5]}{more} that config.json does not explain "
                              "(wrong model_type or config fields?)")
    for s in specs:
        s.check(ckpt)


def target_shardings(state, mesh) -> Callable[[tuple], jax.sharding.Sharding]:
    """path -> sharding of each parameter: one device without a mesh, else the logical-axis rules of
    parallel/sharding.py (experts over `expert`, embed over `fsdp`, heads/mlp/vocab over `tensor`;
    on a FoE mesh parallel/foe.py's rules: experts over `group` x `expert`)."""
    if mesh is None:
        dev = SingleDeviceSharding(jax.devices()[0])
        return lambda path: dev
    flat = dict(nnx.to_flat_state(state_shardings_on(state, mesh)))
    return lambda path: flat[path]


def model_placement(cfg: Config, mesh, routed_compute=None):
    """(mesh, routed_compute) the model of cfg is built with on `mesh` — the choices of
    parallel.build.create_model: the FoE mesh over the same devices for a FoE config with expert
    parallelism, and routed_compute_on(cfg, mesh) unless the caller passes its own."""
    if mesh is None:
        return None, routed_compute
    mesh = placement_mesh(cfg, mesh)
    return mesh, routed_compute if routed_compute is not None else routed_compute_on(cfg, mesh)


def _progress_printer(stream=sys.stderr):
    t0 = time.time()

    def show(i: int, n: int, spec: TensorSpec) -> None:
        print(f"[{i + 1}/{n}] {_path_str(spec.path)} <- {spec.hf[0]}{' ...' if len(spec.hf) > 1 else ''} "
              f"{tuple(spec.shape)} ({time.time() - t0:.1f}s)", file=stream, flush=True)

    return show


def load_params(ckpt: HFCheckpoint, cfg: Config, *, mesh=None, routed_compute=None,
                progress: Optional[Callable] = None) -> Transformer:
    """Build the Transformer of `cfg` with its parameters streamed from `ckpt`. Under
    runtime.scan_layers each stacked parameter [repeats, ...] is one array whose shard callback reads
    and stacks its rows' slices (loading/layer_keys.py), so the stacked layout streams like the per-layer one."""
    fam = family_for(ckpt.config)
    mesh, routed_compute = model_placement(cfg, mesh, routed_compute)
    model = abstract_model(cfg, routed_compute)
    graphdef, state = nnx.split(model)
    params = dict(nnx.to_flat_state(state))
    specs = fam.specs(cfg)
    scanned = cfg.runtime.scan_layers
    layer_params = params if not scanned else dict(nnx.to_flat_state(nnx.state(abstract_model(
        replace(cfg, runtime=replace(cfg.runtime, scan_layers=False))))))
    validate(ckpt, specs, layer_params, ckpt.config, cfg.model.tie_embeddings, getattr(fam, "ignored", None))
    sharding_of = target_shardings(state, mesh)
    groups = stacked_specs(specs, plan_segments(cfg)) if scanned else {s.path: [s] for s in specs}
    for i, (path, rows) in enumerate(groups.items()):
        var = params[path]
        dtype = np.dtype(var.get_value().dtype)
        if scanned and len(var.get_value().shape) == len(rows[0].shape) + 1:
            def read(idx, rows=rows, d=dtype):
                return np.stack([rows[r].read(ckpt, idx[1:]).astype(d) for r in range(len(rows))[idx[0]]])
            shape = (len(rows), *rows[0].shape)
        else:
            def read(idx, s=rows[0], d=dtype):
                return s.read(ckpt, idx).astype(d)
            shape = tuple(rows[0].shape)
        var.set_value(jax.make_array_from_callback(shape, sharding_of(path), read))
        if progress:
            progress(i, len(groups), rows[0])
    return nnx.merge(graphdef, state)


def import_hf(path: str, mesh=None, overrides: Overrides = None, *, dtype: Optional[str] = None, routed_compute=None,
              progress: Union[bool, Callable] = False,
              report: Optional[Callable[[str], None]] = None) -> tuple[Config, Transformer]:
    """(Config, Transformer) of the HF checkpoint folder `path` (see module docstring).

    dtype: "float32" | "bfloat16" parameter dtype (default: the config's, float32); progress: True
    prints one line per tensor to stderr, or a callable(i, n, spec); report: called once, before any
    tensor is read, with the line naming the connectivity and its source (connectivity.describe)."""
    ckpt = open_checkpoint(path)
    ov = dict(overrides) if isinstance(overrides, dict) else list(overrides or [])
    if dtype is not None:
        if isinstance(ov, dict):
            ov["runtime.param_dtype"] = dtype
        else:
            ov.append(f"runtime.param_dtype={dtype}")
    cfg, origin = import_config(ckpt.config, ov, source=ckpt.path)
    if report:
        report(describe(cfg, origin))
    prog = _progress_printer() if progress is True else (progress or None)
    return cfg, load_params(ckpt, cfg, mesh=mesh, routed_compute=routed_compute, progress=prog)

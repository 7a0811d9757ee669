"""Logical-axis rules and the helpers that place parameters and batches on the mesh.

Model parameters carry logical axis names in their `axes` metadata (model/layers.py); `RULES` maps
each name to mesh axes:

    batch     -> (data, fsdp, expert)   every token-parallel axis splits the batch
    expert    -> expert                 routed experts are split over the expert axis (EP)
    embed     -> fsdp                   FSDP: dense (and expert) weights split on d_model; GSPMD
                                        all-gathers them where they are used. No-op when fsdp = 1.
    vocab, heads, kv_heads, mlp -> tensor   Megatron-style tensor parallelism of the dense part
    head_dim, None -> replicated
    layers    -> replicated             the leading axis of stacked layer parameters (runtime.scan_layers,
                                        model/stacking.py): every other dim shards as in one layer, so
                                        a scan step slices its layer without any collective

Expert weights keep their `mlp` dim whole (the expert compute in shard_map is not tensor-parallel).
A dim that the mapped mesh axes do not divide stays replicated rather than failing (e.g. a vocab
of 50257 with tensor = 2), and a mesh axis is used at most once per array.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from farskip_jax.errors import ConfigError
from farskip_jax.parallel.mesh import BATCH_AXES, axis_size, batch_shards

RULES: dict[str, Any] = {
    "batch": BATCH_AXES,
    "expert": "expert",
    "embed": "fsdp",
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "head_dim": None,
    "layers": None,
}

EXPERT_RULES = {**RULES, "mlp": None}  # for arrays that have an "expert" axis


def logical_to_spec(axes: tuple, shape: tuple[int, ...], mesh: Mesh, rules: Optional[Mapping[str, Any]] = None) -> P:
    """PartitionSpec for an array of `shape` whose dims have logical names `axes`."""
    if rules is None:
        rules = EXPERT_RULES if "expert" in axes else RULES
    if len(axes) != len(shape):
        raise ConfigError(f"logical axes {axes} do not match the array shape {shape}")
    used: set[str] = set()
    spec = []
    for name, dim in zip(axes, shape):
        mesh_axes = rules.get(name) if name is not None else None
        if isinstance(mesh_axes, str):
            mesh_axes = (mesh_axes,)
        if mesh_axes:
            mesh_axes = tuple(a for a in mesh_axes if a in mesh.shape and a not in used)
        if not mesh_axes or axis_size(mesh, mesh_axes) == 1 or dim % axis_size(mesh, mesh_axes):
            spec.append(None)
            continue
        used.update(mesh_axes)
        spec.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return P(*spec)


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def state_shardings(state: Any, mesh: Mesh) -> Any:
    """A tree like `state` (an nnx.State of Variables, possibly abstract) with a NamedSharding per
    Variable, read from its `axes` metadata; Variables without `axes` are replicated."""

    def one(v):
        shape = np.shape(v.get_value()) if hasattr(v, "get_value") else np.shape(v[...])
        axes = v.get_metadata().get("axes")
        spec = P() if axes is None else logical_to_spec(tuple(axes), tuple(shape), mesh)
        return NamedSharding(mesh, spec)

    return jax.tree.map(one, state, is_leaf=_is_var)


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
    """Move an existing model's variables onto the mesh (in place) and return it."""
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, state_shardings(state, mesh)))
    return model


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Sharding of a [batch, ...] array: dim 0 split over data x fsdp x expert."""
    return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def shard_batch(batch: Any, mesh: Mesh) -> Any:
    """Place a tree of [batch, ...] arrays on the mesh, batch split over data x fsdp x expert.

    Single process: `batch` is the global batch. Several processes: each passes its own rows (the
    process-local slice, processes in order); the result is one global array per leaf.
    """
    n = batch_shards(mesh)
    multi = jax.process_count() > 1

    def one(x):
        x = np.asarray(x) if not isinstance(x, jax.Array) else x
        sharding = batch_sharding(mesh, x.ndim)
        rows = x.shape[0] * (jax.process_count() if multi else 1)
        if rows % n:
            raise ConfigError(
                f"global batch of {rows} rows cannot be split into data x fsdp x expert = {n} shards; "
                f"make the batch size a multiple of {n}"
            )
        if multi:
            return jax.make_array_from_process_local_data(sharding, np.asarray(x))
        return jax.device_put(x, sharding)

    return jax.tree.map(one, batch)


def place_state(state: Any, mesh: Optional[Mesh]) -> Any:
    """Leaves not yet on `mesh` (optimizer counters, step, rng, ...) are replicated onto it, so that
    the jitted step sees the same input types at every call (no recompilation after step 1)."""
    if mesh is None:
        return state
    rep = NamedSharding(mesh, P())

    def put(x):
        s = getattr(x, "sharding", None)
        if isinstance(s, NamedSharding) and s.mesh.axis_names == mesh.axis_names and s.mesh.shape == mesh.shape:
            return x
        return jax.device_put(x, rep)

    return jax.tree.map(put, state)


def placed_model(graphdef, abstract, state, shardings_of):
    """nnx.merge(graphdef, abstract) holding `state` placed by shardings_of(state). state: an nnx.State,
    or the {params, bias, rest} dict of loading/load.py, from any layout or device (resharded here)."""
    if isinstance(state, dict):
        state = nnx.merge_state(*(state[k] for k in ("params", "bias", "rest") if k in state))
    model = nnx.merge(graphdef, abstract)
    nnx.update(model, jax.device_put(state, shardings_of(state)))
    return model


def abstract_state(state, shardings):
    """`state` (an nnx.State of Variables) with every value a ShapeDtypeStruct carrying its sharding
    from `shardings` (the same tree of NamedShardings): lowers for any devices, allocates nothing."""

    def one(v, sh):
        x = v.get_value()
        return v.replace(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh))

    return jax.tree.map(one, state, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))

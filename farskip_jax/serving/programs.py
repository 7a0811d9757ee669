"""Serving-shaped generation on a mesh: the model placed for `cfg.inference.layout`, and the prefill /
decode programs as abstract (deviceless-lowerable) jitted functions.

    model, layout = serving_model(cfg, graphdef, st)          # layout None = the training layout
                                                              # tp_ep: TpEpLayout; foe: FoELayout
    out = generate(model, [ids_a, ids_b], 32, layout=layout)  # serving/generate.py, ragged prompts

    mesh = jax.sharding.Mesh(...)                            # e.g. over analysis.deviceless.gpu_devices
    fn, args = decode_program(cfg, mesh, batch=8, max_len=4096)           # one new token per row
    fn, args = prefill_program(cfg, mesh, batch=8, prompt_len=1024, max_len=4096)
    compiled = fn.lower(*args).compile(compiler_options=TpEpLayout.compiler_options())

Both programs are `make_decode_fn` of serving/generate.py (the same step `generate` runs) on the tp_ep
layout (serving/tp_ep.py), the dp_ep layout (serving/dp_ep.py: data-parallel attention, expert-parallel
all-to-alls), or with inference.layout=foe on the Federation-of-Experts layout
(serving/foe.py: one group per GPU, cache rows by group): state, tokens [b, t], start [], cache, pad [b] as ShapeDtypeStructs
with their shardings, so nothing is materialised and a CPU host can compile them for 8 GPUs. Under
runtime.scan_layers the programs are the scanned decode of serving/generate.py (the stacked cache:
per stack, per block, [repeats, b, max_len, heads, dim]). runtime.micro_batches = m > 1 (two-batch
overlap): the cache is a tuple of m such caches of batch / m rows (serving/generate.init_cache).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from farskip_jax.config import Config, MeshConfig, ModelConfig
from farskip_jax.errors import ConfigError
from farskip_jax.parallel.foe import foe_mesh_from
from farskip_jax.parallel.mesh import make_mesh
from farskip_jax.serving.dp_ep import abstract_dp_ep_model, dp_ep_model, layout_of as dp_ep_layout_of
from farskip_jax.serving.foe import FoELayout, abstract_foe_inference_model, check_foe_inference, foe_inference_model
from farskip_jax.serving.generate import decode_step, make_decode_fn, stacked_cache_shapes
from farskip_jax.serving.tp_ep import abstract_inference_model, inference_model, layout_for


def restore_mesh(devices=None) -> Mesh:
    """The mesh a checkpoint is restored on before serving_model reshards it: every device a data
    replica (parameters replicated), so any run's config restores whatever its runtime.dispatch."""
    return make_mesh(MeshConfig(data=-1), devices)


def serving_model(cfg: Config, graphdef, st: dict, mesh: Optional[Mesh] = None):
    """(model, layout) for generation with cfg.inference.layout: `training` -> the model as loaded
    and None; `tp_ep` -> inference_model on `mesh` (default make_mesh(cfg.mesh)) and its TpEpLayout;
    `dp_ep` -> dp_ep_model and its DpEpLayout; `foe` -> foe_inference_model on the FoE mesh of `mesh`
    and its FoELayout.
    st: {params, bias, rest} (loading/load.py)."""
    if cfg.inference.layout == "training":
        return nnx.merge(graphdef, st["params"], st["bias"], st["rest"]), None
    layout = serving_layout(cfg, mesh or make_mesh(cfg.mesh))
    return PLACE[cfg.inference.layout](cfg, layout.mesh, st), layout


def serving_layout(cfg: Config, mesh: Mesh):
    """The layout object of cfg.inference.layout on `mesh` (a plain mesh; foe: split into its FoE mesh)."""
    if cfg.inference.layout == "foe":
        check_foe_inference(cfg, mesh)
        return FoELayout(foe_mesh_from(mesh, cfg.runtime.num_groups))
    if cfg.inference.layout == "tp_ep":
        return layout_for(cfg, mesh)
    if cfg.inference.layout == "dp_ep":
        return dp_ep_layout_of(cfg, mesh)
    raise ConfigError(f"serving programs need inference.layout=tp_ep, dp_ep or foe (got {cfg.inference.layout!r})")


PLACE = {"tp_ep": inference_model, "dp_ep": dp_ep_model, "foe": foe_inference_model}  # layout -> placed model
ABSTRACT = {"tp_ep": abstract_inference_model, "dp_ep": abstract_dp_ep_model, "foe": abstract_foe_inference_model}


def cache_entry_shapes(m: ModelConfig, batch: int, max_len: int, layout, groups: int = 1) -> tuple:
    """Global (k, v) shapes of one layer's cache on the layout (GQA: kv heads, MLA: decompressed heads;
    Federation of Experts with H = groups: rows H * batch of kv / H heads)."""
    if m.attention == "mla":
        k = (batch, max_len, m.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim)
        v = (batch, max_len, m.num_heads, m.v_head_dim)
    else:
        h = layout.cache_heads(m, m.num_kv_heads)
        k = v = (batch * groups, max_len, h // groups, m.resolved_head_dim)
    return k, v


def _abstract_cache(cfg: Config, layout, rows: int, max_len: int):
    """The ShapeDtypeStructs of a KV cache of `rows` requests on the layout (serving/generate.init_cache)."""
    dt = jnp.dtype(cfg.runtime.compute_dtype)
    cs = layout.cache_sharding()
    ks, vs = cache_entry_shapes(cfg.model, rows, max_len, layout, cfg.runtime.num_groups)
    if cfg.runtime.scan_layers:  # the stacked cache of serving/generate.py: per stack, per block, [repeats, ...]
        ss = layout.stacked_cache_sharding()
        return tuple(tuple(tuple(jax.ShapeDtypeStruct(x, dt, sharding=ss) for x in kv) for kv in stack)
                     for stack in stacked_cache_shapes(cfg, lambda layer: (ks, vs)))
    return tuple((jax.ShapeDtypeStruct(ks, dt, sharding=cs), jax.ShapeDtypeStruct(vs, dt, sharding=cs))
                 for _ in range(cfg.model.num_layers))


def _program(cfg: Config, mesh: Mesh, batch: int, t: int, max_len: int, last_logits: bool = False):
    layout = serving_layout(cfg, mesh)
    mesh = layout.mesh
    graphdef, state = ABSTRACT[cfg.inference.layout](cfg, mesh)
    mb = cfg.runtime.micro_batches
    if batch % mb:
        raise ConfigError(f"runtime.micro_batches={mb} needs a batch that is a multiple of {mb}, got {batch} rows")
    cache = _abstract_cache(cfg, layout, batch // mb, max_len)
    if mb > 1:  # two-batch overlap: one cache per micro-batch
        cache = (cache,) * mb
    args = (state, jax.ShapeDtypeStruct((batch, t), jnp.int32, sharding=layout.batch_sharding(2)),
            jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P())), cache,
            jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=layout.batch_sharding(1)))
    if not last_logits:
        return make_decode_fn(graphdef, cfg.farskip, layout), args
    fs = cfg.farskip

    def fn(state, tokens, start, cache, pad):  # make_decode_fn's step, final norm + LM head on the last slot only
        model = nnx.merge(graphdef, state)
        output = model.output
        model.output = lambda full, *rest, **kw: output(full[:, -1:], *rest, **kw)
        return decode_step(model, tokens, start, cache, fs, pad)

    return jax.jit(fn, donate_argnums=3, compiler_options=layout.compiler_options()), args


def decode_program(cfg: Config, mesh: Mesh, batch: int, max_len: int):
    """(jitted decode step, abstract args): one token per row against a max_len cache, connectivity
    cfg.farskip, on the cfg.inference.layout of `mesh`."""
    return _program(cfg, mesh, batch, 1, max_len)


def prefill_program(cfg: Config, mesh: Mesh, batch: int, prompt_len: int, max_len: int, last_logits: bool = False):
    """(jitted prefill, abstract args): prompt_len tokens per row (left-padded) into a max_len cache.
    last_logits: the final norm and LM head on the last prompt slot only (logits [b, 1, V]), as a
    server computes the first token (what TTFT measures); default every slot (generate's prefill)."""
    return _program(cfg, mesh, batch, prompt_len, max_len, last_logits)

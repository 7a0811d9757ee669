"""Fused attention core on CPU: a C++ XLA FFI kernel (csrc/attention.cc) with a FlashAttention-2 VJP.

    fused_attention_core(q [b, t, h, d], k [b, s, kv, d], v [b, s, kv, dv], mask [b, 1, t, s] bool, scale)
        -> [b, t, h, dv]

The same function as kernels/attention.attention_core (logits = where(mask, scale q k^T, -1e30), softmax in
float32, GQA by kv head = h // (h / kv)), computed per (batch, kv head) with the [64, keys] score
block in cache instead of materialising [b, kv, g, t, s] scores and their softmax passes in memory;
only the key range holding an allowed key of a query block is computed (causal: about half). The
backward recomputes the probabilities from each row's saved max and sum. Any mask works (causal,
document, chunked; a row with no allowed key is uniform like the naive core). float32 math; other
dtypes are computed in float32 and returned in q.dtype. Built and loaded with the grouped-GEMM
kernel by kernels/cpu/library.py; `available()` there says whether this machine has it.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from farskip_jax.kernels.cpu import library


def _fwd_call(q, k, v, mask, scale):
    b, t, h, _ = q.shape
    shapes = (jax.ShapeDtypeStruct((b, t, h, v.shape[-1]), jnp.float32),
              jax.ShapeDtypeStruct((b, h, t), jnp.float32), jax.ShapeDtypeStruct((b, h, t), jnp.float32))
    return jax.ffi.ffi_call("farskip_attention_fwd", shapes)(q, k, v, mask, scale=np.float32(scale))


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _core(q, k, v, mask, scale):
    return _fwd_call(q, k, v, mask, scale)[0]


def _core_fwd(q, k, v, mask, scale):
    o, m, l = _fwd_call(q, k, v, mask, scale)
    return o, (q, k, v, mask, o, m, l)


def _core_bwd(scale, res, do):
    q, k, v, mask, o, m, l = res
    shapes = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(k.shape, jnp.float32),
              jax.ShapeDtypeStruct(v.shape, jnp.float32))
    dq, dk, dv = jax.ffi.ffi_call("farskip_attention_bwd", shapes)(
        q, k, v, mask, o, m, l, do.astype(jnp.float32), scale=np.float32(scale))
    return dq, dk, dv, None


_core.defvjp(_core_fwd, _core_bwd)


def fused_attention_core(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float) -> jax.Array:
    """attention_core through the CPU kernel; see the module docstring. Raises KernelUnavailable when
    the kernel library cannot be built here."""
    library.require()
    b, t, s = q.shape[0], q.shape[1], k.shape[1]
    mask = jnp.broadcast_to(mask, (b, 1, t, s)).astype(jnp.bool_)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    return _core(f32(q), f32(k), f32(v), mask, float(scale)).astype(q.dtype)

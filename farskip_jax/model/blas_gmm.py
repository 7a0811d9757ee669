"""CPU grouped matmul through BLAS (`moe.gmm=blas`): csrc/grouped_gemm.cc, one sgemm per group part.

    gmm(lhs [M, K], rhs [G, K, N], group_sizes [G]) -> [M, N]      (rows sorted by group, float32)
    tgmm(lhs [M, K], dy [M, N], group_sizes [G]) -> [G, K, N]       (per-group lhs^T dy: weight gradient)

The kernel reads every group's rows and weight slice in place and calls cblas_sgemm on them, so
it has none of the costs XLA:CPU adds to a loop of dynamic-slice dots (a copy of each weight
slice, zero-filled loop carries, read-modify-write gradient slices), and it splits the work over
XLA's own CPU threads (XLA:CPU's small dots run at about one thread's speed). `gmm` has a custom VJP
made of the same two kernels: d lhs = gmm(dy, rhs^T), d rhs = tgmm(lhs, dy). The library is built
and loaded by model/cpu_kernels.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from farskip_jax.model import cpu_kernels


def _gmm_call(lhs, rhs, group_sizes, transpose_rhs: bool):
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    return jax.ffi.ffi_call("farskip_gmm", jax.ShapeDtypeStruct((lhs.shape[0], n), jnp.float32))(
        lhs, rhs, group_sizes, transpose_rhs=transpose_rhs)


def _tgmm_call(lhs, dy, group_sizes):
    shape = (group_sizes.shape[0], lhs.shape[1], dy.shape[1])
    return jax.ffi.ffi_call("farskip_tgmm", jax.ShapeDtypeStruct(shape, jnp.float32))(lhs, dy, group_sizes)


@jax.custom_vjp
def _gmm_f32(lhs, rhs, group_sizes):
    return _gmm_call(lhs, rhs, group_sizes, False)


def _gmm_f32_fwd(lhs, rhs, group_sizes):
    return _gmm_call(lhs, rhs, group_sizes, False), (lhs, rhs, group_sizes)


def _gmm_f32_bwd(res, dy):
    lhs, rhs, group_sizes = res
    return _gmm_call(dy, rhs, group_sizes, True), _tgmm_call(lhs, dy, group_sizes), None


_gmm_f32.defvjp(_gmm_f32_fwd, _gmm_f32_bwd)


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """out[rows of g] = lhs[rows of g] @ rhs[g] in float32 BLAS (other dtypes are computed in float32
    and returned in lhs.dtype); rows past sum(group_sizes) are zero. Differentiable in lhs and rhs."""
    cpu_kernels.require()
    y = _gmm_f32(lhs.astype(jnp.float32), rhs.astype(jnp.float32), group_sizes.astype(jnp.int32))
    return y.astype(lhs.dtype)

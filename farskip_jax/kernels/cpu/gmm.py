"""CPU grouped matmul through BLAS (backends `blas` and `blas_dense`): csrc/grouped_gemm.cc, one sgemm
per group part.

    gmm(lhs [M, K], rhs [G, K, N], group_sizes [G]) -> [M, N]      (rows sorted by group, float32)
    tgmm(lhs [M, K], dy [M, N], group_sizes [G]) -> [G, K, N]       (per-group lhs^T dy: weight gradient)
    matmul(x [M, K], w [K, N] or [N, K]) -> [M, N]                 (dense float32: one group)

The kernel reads every group's rows and weight slice in place and calls cblas_sgemm on them, so
it has none of the costs XLA:CPU adds to a loop of dynamic-slice dots (a copy of each weight
slice, zero-filled loop carries, read-modify-write gradient slices), and it splits the work over
XLA's own CPU threads (XLA:CPU's small dots run at about one thread's speed). `gmm` has a custom VJP
made of the same two kernels: d lhs = gmm(dy, rhs^T), d rhs = tgmm(lhs, dy). The library is built
and loaded by kernels/cpu/library.py.

bfloat16 operands (runtime.compute_dtype: bfloat16) on a CPU with Intel AMX (library.amx_available)
run csrc/bf16_gemm.cc instead: the same two kernels on AMX tiles, bf16 rows, float32 weights rounded
to bf16 as the kernel packs them, float32 accumulation (the output rounded to bf16 on return, the
weight gradient float32). K and N must be multiples of 32 there; other shapes, and CPUs without AMX,
compute the same rounded operands in float32 BLAS.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from farskip_jax.kernels.cpu import library


def _gmm_call(lhs, rhs, group_sizes, transpose_rhs: bool, bf16: bool = False):
    """farskip_gmm (float32 operands) or, with bf16, farskip_gmm_bf16 (bf16 lhs, float32 rhs, AMX)."""
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    target = "farskip_gmm_bf16" if bf16 else "farskip_gmm"
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((lhs.shape[0], n), jnp.float32))(
        lhs, rhs, group_sizes, transpose_rhs=transpose_rhs)


def _tgmm_call(lhs, dy, group_sizes, bf16: bool = False):
    """farskip_tgmm (float32) or, with bf16, farskip_tgmm_bf16 (bf16 lhs and dy, AMX) -> float32 [G, K, N]."""
    shape = (group_sizes.shape[0], lhs.shape[1], dy.shape[1])
    target = "farskip_tgmm_bf16" if bf16 else "farskip_tgmm"
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(shape, jnp.float32))(lhs, dy, group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm_f32(lhs, rhs, group_sizes, transpose_rhs=False):
    """rhs [G, K, N], or [G, N, K] used transposed."""
    return _gmm_call(lhs, rhs, group_sizes, transpose_rhs)


def _gmm_f32_fwd(lhs, rhs, group_sizes, transpose_rhs=False):
    return _gmm_call(lhs, rhs, group_sizes, transpose_rhs), (lhs, rhs, group_sizes)


def _gmm_f32_bwd(transpose_rhs, res, dy):
    lhs, rhs, group_sizes = res
    d_rhs = _tgmm_call(dy, lhs, group_sizes) if transpose_rhs else _tgmm_call(lhs, dy, group_sizes)
    return _gmm_call(dy, rhs, group_sizes, not transpose_rhs), d_rhs, None


_gmm_f32.defvjp(_gmm_f32_fwd, _gmm_f32_bwd)


@jax.custom_vjp
def _gmm_bf16(lhs, rhs, group_sizes):
    """bf16 lhs [M, K], float32 rhs [G, K, N] (rounded to bf16 in the kernel) -> float32 [M, N] on AMX;
    the weight gradient comes back in float32 with no cast pass over the weights."""
    return _gmm_call(lhs, rhs, group_sizes, False, bf16=True)


def _gmm_bf16_fwd(lhs, rhs, group_sizes):
    return _gmm_call(lhs, rhs, group_sizes, False, bf16=True), (lhs, rhs, group_sizes)


def _gmm_bf16_bwd(res, dy):
    lhs, rhs, group_sizes = res
    dy = dy.astype(jnp.bfloat16)
    return (_gmm_call(dy, rhs, group_sizes, True, bf16=True).astype(jnp.bfloat16),
            _tgmm_call(lhs, dy, group_sizes, bf16=True), None)


_gmm_bf16.defvjp(_gmm_bf16_fwd, _gmm_bf16_bwd)


def matmul(x: jax.Array, w: jax.Array, transpose_w: bool = False) -> jax.Array:
    """Dense x [M, K] @ w [K, N] (or w [N, K] with transpose_w) -> [M, N] in x.dtype: `gmm` with one
    group (AMX for bf16 rows where `uses_amx`, not transposed), else float32 BLAS, one sgemm per thread
    part, forward and both gradients (against XLA:CPU's own dot: benchmarks/dense_matmul.py)."""
    sizes = jnp.full((1,), x.shape[0], jnp.int32)
    if not transpose_w:
        return gmm(x, w[None], sizes)
    if x.dtype != jnp.float32:
        raise ValueError(f"kernels.gmm.matmul(transpose_w=True) takes float32 rows, not {x.dtype}")
    library.require()
    return _gmm_f32(x.astype(jnp.float32), w.astype(jnp.float32)[None], sizes, True).astype(x.dtype)


def uses_amx(lhs: jax.Array, rhs: jax.Array) -> bool:
    """Whether gmm(lhs, rhs, .) runs the AMX kernel: bf16 rows, K and N multiples of 32, AMX here."""
    return (lhs.dtype == jnp.bfloat16 and rhs.dtype in (jnp.bfloat16, jnp.float32) and lhs.shape[1] % 32 == 0
            and rhs.shape[2] % 32 == 0 and library.amx_available())


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """out[rows of g] = lhs[rows of g] @ rhs[g] -> [M, N] in lhs.dtype, rows past sum(group_sizes) zero;
    differentiable in lhs and rhs. The operands are rhs rounded to lhs.dtype and lhs, the products
    accumulated in float32: on AMX tiles where `uses_amx` (rhs may stay float32 master weights: the
    kernel rounds them as it packs, and their gradient is float32), else in float32 BLAS."""
    library.require()
    if uses_amx(lhs, rhs):
        return _gmm_bf16(lhs, rhs.astype(jnp.float32), group_sizes.astype(jnp.int32)).astype(lhs.dtype)
    rhs32 = rhs.astype(jnp.float32)
    if lhs.dtype != jnp.float32:  # rhs rounded to lhs.dtype, its gradient passed through in float32 (as on AMX)
        rhs32 = rhs32 + jax.lax.stop_gradient(rhs32.astype(lhs.dtype).astype(jnp.float32) - rhs32)
    y = _gmm_f32(lhs.astype(jnp.float32), rhs32, group_sizes.astype(jnp.int32))
    return y.astype(lhs.dtype)

"""Basic NNX layers: Linear, Embed, RMSNorm, SwiGLU MLP.

Parameters carry an `axes` metadata tuple of logical axis names (e.g. ("embed", "mlp")) that
parallel/sharding.py maps to mesh axes; the model itself never touches a mesh.
Parameters are stored in `param_dtype`; matmuls run in `compute_dtype`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from farskip_jax.kernels import ops

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def dtype_of(name: str):
    return DTYPES[name]


def normal_init(rngs: nnx.Rngs, shape, std: float, dtype) -> jax.Array:
    return (jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype)


def matmul_2d(x: jax.Array, w: jax.Array, transpose_w: bool = False) -> jax.Array:
    """x [..., i] @ w [i, o] (or w [o, i] with transpose_w) -> [..., o] in x.dtype, with w rounded to
    x.dtype, as ONE 2-D dot over the flattened leading dims (kernels/ops.matmul: XLA's dot, or a
    registered CPU kernel in programs lowered for the CPU). Same result as einsum("...i,io->...o");
    the point is the backward: with several leading dims XLA:CPU contracts the weight gradient over
    two dims and inserts a slow transposing copy of the [tokens, out] gradient; a 2-D dot has none."""
    y = ops.matmul(x.reshape(-1, x.shape[-1]), w, transpose_w)
    return y.reshape(*x.shape[:-1], y.shape[-1])


class Linear(nnx.Module):
    """y = x @ w (+ b). w: [in, out] with logical axes `axes`."""

    def __init__(self, d_in: int, d_out: int, *, axes: tuple[str, str], rngs: nnx.Rngs, std: float = 0.02,
                 bias: bool = False, param_dtype=jnp.float32, compute_dtype=jnp.float32):
        self.w = nnx.Param(normal_init(rngs, (d_in, d_out), std, param_dtype), axes=axes)
        self.b = nnx.Param(jnp.zeros((d_out,), param_dtype), axes=(axes[1],)) if bias else None
        self.compute_dtype = compute_dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        y = matmul_2d(x.astype(self.compute_dtype), self.w[...])  # w used rounded to the compute dtype
        if self.b is not None:
            y = y + self.b[...].astype(self.compute_dtype)
        return y

    def grouped(self, x_h: jax.Array, num_groups: int, split: str = "out") -> jax.Array:
        """This layer applied per group h of H = num_groups (Federation of Experts, model/foe.py):
        split "out": x_h [H, ..., in] -> [H, ..., out/H], group h through columns [h*out/H, (h+1)*out/H)
        (and that slice of the bias); split "in": x_h [H, ..., in/H] -> [H, ..., out] through rows
        [h*in/H, (h+1)*in/H) (no bias: the groups' outputs are summed by the caller)."""
        cd, hg = self.compute_dtype, num_groups
        w = self.w[...].astype(cd)
        if split == "in":
            return jnp.einsum("h...i,hio->h...o", x_h.astype(cd), w.reshape(hg, w.shape[0] // hg, w.shape[1]))
        y = jnp.einsum("h...i,iho->h...o", x_h.astype(cd), w.reshape(w.shape[0], hg, w.shape[1] // hg))
        if self.b is not None:
            b = self.b[...].astype(cd).reshape(hg, -1)
            y = y + b.reshape(hg, *([1] * (y.ndim - 2)), b.shape[-1])
        return y


class Embed(nnx.Module):
    """Token embedding table [vocab, d_model]; `attend` gives tied output logits."""

    def __init__(self, vocab: int, d_model: int, *, rngs: nnx.Rngs, std: float = 0.02,
                 param_dtype=jnp.float32, compute_dtype=jnp.float32):
        self.table = nnx.Param(normal_init(rngs, (vocab, d_model), std, param_dtype), axes=("vocab", "embed"))
        self.compute_dtype = compute_dtype

    def __call__(self, tokens_bt: jax.Array) -> jax.Array:
        return jnp.take(self.table[...], tokens_bt, axis=0).astype(self.compute_dtype)

    def attend(self, x_btd: jax.Array) -> jax.Array:
        return matmul_2d(x_btd.astype(self.compute_dtype), self.table[...].astype(self.compute_dtype), transpose_w=True)


class RMSNorm(nnx.Module):
    """x * rsqrt(mean(x^2) + eps) * scale, computed in float32, returned in x.dtype."""

    def __init__(self, dim: int, *, eps: float = 1e-6, param_dtype=jnp.float32, axes=("embed",)):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), axes=axes)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class SwiGLU(nnx.Module):
    """Dense SwiGLU MLP: down(silu(gate(x)) * up(x)). x: [..., d_model] -> [..., d_model]."""

    def __init__(self, d_model: int, hidden: int, *, rngs: nnx.Rngs, std: float = 0.02,
                 param_dtype=jnp.float32, compute_dtype=jnp.float32, out_std: float | None = None):
        kw = dict(rngs=rngs, param_dtype=param_dtype, compute_dtype=compute_dtype)
        self.gate = Linear(d_model, hidden, axes=("embed", "mlp"), std=std, **kw)
        self.up = Linear(d_model, hidden, axes=("embed", "mlp"), std=std, **kw)
        self.down = Linear(hidden, d_model, axes=("mlp", "embed"), std=out_std or std, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))

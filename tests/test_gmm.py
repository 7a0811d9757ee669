"""Grouped matmul backends and the local routed-expert compute against per-group / per-token loops."""

import os

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from farskip_jax.config import RuntimeConfig
from farskip_jax.kernels import gmm as gmm_mod
from farskip_jax.model.experts import ExpertWeights, inverse_permutation, local_routed_compute, weighted_combine
from farskip_jax.kernels.gmm import gmm, resolve_backend
from farskip_jax.model.router import RouteResult

BACKENDS = ["blas", "tiled", "einsum", "ragged_dot"]
# (rows M, group sizes, tile): empty groups, groups larger than a tile (several full tiles plus a
# tail), rows past sum(group_sizes), a last group ending at row M (tail tile shifted back), M < tile.
CASES = [
    (64, [0, 21, 9, 0, 3, 1], 8),
    (100, [40, 0, 17, 35], 16),
    (37, [5, 9, 2, 0, 21], 128),
    (24, [0, 0, 0], 8),
]


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


def _np_gmm(x, w, sizes):
    out = np.zeros((x.shape[0], w.shape[2]), np.float64)
    s = 0
    for g, n in enumerate(sizes):
        out[s:s + n] = x[s:s + n].astype(np.float64) @ w[g].astype(np.float64)
        s += n
    return out


def _jnp_gmm_loop(x, w, sizes):
    """Obviously right JAX oracle (static per-group slices), differentiable by plain autodiff."""
    parts, s = [], 0
    for g, n in enumerate(sizes):
        parts.append(x[s:s + n] @ w[g])
        s += n
    parts.append(jnp.zeros((x.shape[0] - s, w.shape[2]), x.dtype))
    return jnp.concatenate(parts, 0)


def _data(m, sizes, k=6, n=5, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((len(sizes), k, n)).astype(np.float32)
    return x, w


@pytest.mark.parametrize("backend", BACKENDS)
def test_gmm_matches_group_loop(backend):
    for m, sizes, tile in CASES:
        x, w = _data(m, sizes)
        f = jax.jit(gmm, static_argnums=(3, 4))
        y = np.asarray(f(x, w, jnp.asarray(sizes, jnp.int32), backend, tile))
        ref = _np_gmm(x, w, sizes)
        assert _rel(y, ref) < 1e-5, (backend, m, sizes, tile)
        assert np.all(y[sum(sizes):] == 0), "rows past sum(group_sizes) must be zero"


@pytest.mark.parametrize("backend", ["blas", "tiled", "einsum"])
def test_gmm_gradients_match_loop_oracle(backend):
    for m, sizes, tile in CASES[:3]:
        x, w = _data(m, sizes, seed=1)
        ct = np.random.default_rng(2).standard_normal((m, w.shape[2])).astype(np.float32)
        gs = jnp.asarray(sizes, jnp.int32)
        got = jax.jit(jax.grad(lambda x, w: jnp.sum(gmm(x, w, gs, backend, tile) * ct), (0, 1)))(x, w)
        ref = jax.grad(lambda x, w: jnp.sum(_jnp_gmm_loop(x, w, sizes) * ct), (0, 1))(x, w)
        for a, b, name in zip(got, ref, ("lhs", "rhs")):
            assert _rel(a, b) < 1e-5, (backend, name, m, sizes)
        # empty groups get exactly zero weight gradient; rows past the groups get zero input gradient
        for g, n in enumerate(sizes):
            if n == 0:
                assert np.all(np.asarray(got[1][g]) == 0)
        assert np.all(np.asarray(got[0][sum(sizes):]) == 0)


def _jnp_swiglu_loop(x, wg, wu, wd, sizes):
    """Per-group SwiGLU oracle (static slices), zeros past sum(sizes); plain autodiff."""
    parts, s = [], 0
    for g, n in enumerate(sizes):
        xg = x[s:s + n]
        parts.append((jax.nn.silu(xg @ wg[g]) * (xg @ wu[g])) @ wd[g])
        s += n
    parts.append(jnp.zeros((x.shape[0] - s, wd.shape[2]), x.dtype))
    return jnp.concatenate(parts, 0)


@pytest.mark.parametrize("tile", [8, 128])
def test_grouped_swiglu_matches_loop_oracle(tile):
    """The fused SwiGLU walk against a per-group loop: values and all four gradients, fp32 1e-5.
    tile 8: groups span several full tiles after their tail window (gradients accumulate); 128:
    every group is one window (gradients written once)."""
    rng = np.random.default_rng(7)
    for m, sizes, _ in CASES + [(96, [30, 2, 0, 64, 0], None)]:
        d, h = 6, 5
        x = rng.standard_normal((m, d)).astype(np.float32)
        ws = [rng.standard_normal(sh).astype(np.float32) * 0.5
              for sh in [(len(sizes), d, h), (len(sizes), d, h), (len(sizes), h, d)]]
        ct = rng.standard_normal((m, d)).astype(np.float32)
        gs = jnp.asarray(sizes, jnp.int32)
        f = lambda x, a, b, c: jnp.sum(gmm_mod.grouped_swiglu(x, a, b, c, gs, tile) * ct)  # noqa: E731
        ref_f = lambda x, a, b, c: jnp.sum(_jnp_swiglu_loop(x, a, b, c, sizes) * ct)  # noqa: E731
        y = jax.jit(lambda *a: gmm_mod.grouped_swiglu(*a, gs, tile))(x, *ws)
        assert _rel(y, _jnp_swiglu_loop(x, *ws, sizes)) < 1e-5, (tile, m, sizes)
        assert np.all(np.asarray(y)[sum(sizes):] == 0)
        got = jax.jit(jax.grad(f, argnums=(0, 1, 2, 3)))(x, *ws)
        ref = jax.grad(ref_f, argnums=(0, 1, 2, 3))(x, *ws)
        for a, r, name in zip(got, ref, ("x", "w_gate", "w_up", "w_down")):
            assert _rel(a, r) < 1e-5, (tile, name, m, sizes)


def test_tail_buckets_and_backend_resolution():
    assert gmm_mod._buckets(4096, 256) == (8, 16, 32, 64, 96, 128, 160, 192, 224, 256)  # steps of 32
    assert gmm_mod._buckets(1000, 64) == (8, 16, 32, 64)
    assert gmm_mod._buckets(12288, 1024) == (8, 16, 128, 256, 384, 512, 640, 768, 896, 1024)  # P / 8
    assert gmm_mod._buckets(20, 128) == (8, 16, 20)  # capped at M
    assert gmm_mod._buckets(5, 128) == (5,)
    assert resolve_backend("auto", "cpu") == "blas"  # the BLAS kernel builds on every machine this runs on
    with pytest.raises(ValueError, match="CPU kernel"):
        resolve_backend("blas", "gpu")
    assert resolve_backend("auto", "gpu") == "ragged_dot"
    assert resolve_backend("einsum", "gpu") == "einsum"
    with pytest.raises(ValueError, match="unknown gmm backend"):
        resolve_backend("magic")


def test_blas_unavailable_falls_back_to_tiled_and_explicit_blas_fails_clearly(tmp_path):
    """No working compiler: `auto` resolves to `tiled` with one warning naming the reason, an explicit
    runtime.gmm=blas raises KernelUnavailable naming the fix (fresh process: the kernel load is cached);
    the cache folder comes from the environment override of kernels.cache_dir."""
    import subprocess
    import sys

    code = (
        "import warnings, jax.numpy as jnp\n"
        "from farskip_jax.kernels.gmm import gmm, resolve_backend\n"
        "from farskip_jax import kernels\n"
        "from farskip_jax.config import kernels_from_env\n"
        "kernels.install(kernels_from_env())  # FARSKIP_KERNEL_CACHE: the override of kernels.cache_dir\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    print(resolve_backend('auto', 'cpu'))\n"
        "    print(len(w), str(w[0].message)[:200] if w else '')\n"
        "try:\n"
        "    gmm(jnp.ones((4, 3)), jnp.ones((2, 3, 5)), jnp.asarray([2, 2]), 'blas')\n"
        "except kernels.KernelUnavailable as e:\n"
        "    print('raised', 'kernels.enabled: false' in str(e))\n"
    )
    env = {**os.environ, "CXX": "/nonexistent/c++", "FARSKIP_KERNEL_CACHE": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "tiled"
    assert lines[1].startswith("1 ") and "/nonexistent/c++" in lines[1]
    assert lines[2] == "raised True"
    assert not list(tmp_path.glob("*.so")), "a failed build must not leave a library behind"


_BLAS_RUN = (
    "import sys, numpy as np, jax.numpy as jnp, jax\n"
    "from farskip_jax import kernels\n"
    "from farskip_jax.config import KernelsConfig\n"
    "from farskip_jax.kernels.cpu import library\n"
    "from farskip_jax.kernels.gmm import gmm\n"
    "kernels.install(KernelsConfig(blas=sys.argv[2]))\n"
    "x, w, g, sizes = (np.load(f'{sys.argv[1]}/{n}.npy') for n in ('x', 'w', 'g', 'sizes'))\n"
    "f = lambda x, w: jnp.vdot(gmm(x, w, jnp.asarray(sizes), 'blas'), g)\n"
    "dx, dw = jax.grad(f, argnums=(0, 1))(x, w)\n"
    "np.save(f'{sys.argv[1]}/out.npy', np.asarray(gmm(x, w, jnp.asarray(sizes), 'blas')))\n"
    "np.save(f'{sys.argv[1]}/dx.npy', np.asarray(dx)); np.save(f'{sys.argv[1]}/dw.npy', np.asarray(dw))\n"
    "print(library.load())\n"
)


@pytest.mark.parametrize("choice", ["openblas", "mkl"])
def test_each_blas_library_gives_the_group_loop_result(choice, tmp_path):
    """kernels.blas picks the sgemm library (fresh process: the load is cached); OpenBLAS and, where the
    `mkl` extra is installed, MKL both give the float64 group loop's values and gradients to fp32
    rounding (1e-5 of the largest entry; measured ~3e-7)."""
    import glob
    import subprocess
    import sys

    if choice == "mkl" and not glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so*")):
        pytest.skip("the `mkl` extra is not installed in this environment")
    sizes = [37, 0, 90, 1]
    x, w = _data(128, sizes, k=48, n=72)
    g = np.random.default_rng(1).standard_normal((128, 72)).astype(np.float32)
    for name, a in dict(x=x, w=w, g=g, sizes=np.asarray(sizes, np.int32)).items():
        np.save(tmp_path / f"{name}.npy", a)
    env = {k: v for k, v in os.environ.items() if k != "FARSKIP_BLAS_LIB"}
    env = {k: v for k, v in env.items() if k != "FARSKIP_BLAS"}
    env.update(JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _BLAS_RUN, str(tmp_path), choice], env=env, capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    desc = out.stdout.strip().splitlines()[-1]
    assert ("libmkl_rt" in desc) == (choice == "mkl"), desc
    bounds = np.cumsum([0] + sizes)
    ref_dw = np.stack([x[s:e].T.astype(np.float64) @ g[s:e] for s, e in zip(bounds[:-1], bounds[1:])])
    assert _rel(np.load(tmp_path / "out.npy"), _np_gmm(x, w, sizes)) < 1e-5
    assert _rel(np.load(tmp_path / "dx.npy"), _np_gmm(g, w.transpose(0, 2, 1), sizes)) < 1e-5
    assert _rel(np.load(tmp_path / "dw.npy"), ref_dw) < 1e-5


def test_bad_blas_choice_is_one_clear_error():
    """kernels.blas and its environment override FARSKIP_BLAS: a value that is not a choice is one
    ConfigError naming the key (or variable) and the choices."""
    from farskip_jax.config import kernels_env_overrides, load_config
    from farskip_jax.errors import ConfigError

    with pytest.raises(ConfigError, match=r"kernels.blas='acml' is not allowed.*'openblas'"):
        load_config(None, ["kernels.blas=acml"])
    with pytest.raises(ConfigError, match=r"FARSKIP_BLAS='acml' is not a choice \(it sets kernels.blas\).*'openblas'"):
        kernels_env_overrides({"FARSKIP_BLAS": "acml"})


def test_blas_backend_bf16_inputs():
    """bf16 operands are computed in float32 BLAS and returned in bf16 (the tiled/einsum convention)."""
    m, sizes = 64, [0, 21, 9, 0, 3, 1]
    x, w = _data(m, sizes)
    y = gmm(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), jnp.asarray(sizes, jnp.int32), "blas")
    assert y.dtype == jnp.bfloat16
    ref = _np_gmm(np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32), np.asarray(jnp.asarray(w, jnp.bfloat16), np.float32), sizes)
    assert _rel(np.asarray(y, np.float32), ref) < 1e-2


# ------------------------------------------------------------------------------ bf16 on Intel AMX

def _amx_or_skip():
    from farskip_jax import kernels

    if not kernels.amx_available():
        pytest.skip("no usable AMX-BF16 on this CPU (the float32 kernels serve bf16 here)")


# (rows, group sizes, K, N): ragged groups with empty ones and rows past the groups, row counts that
# are not multiples of 32 (zero-padded last block), one group (a dense layer), K/N of 32 and 3 x 32
AMX_CASES = [(300, [67, 0, 75, 88], 64, 96), (257, [100, 150], 256, 512), (33, [3, 0, 9], 32, 64),
             (64, [64], 96, 32)]


@pytest.mark.parametrize("m,sizes,k,n", AMX_CASES)
def test_amx_kernels_match_group_loop(m, sizes, k, n):
    """The three AMX kernels (y = x W, dx = dy W^T, dW = x^T dy per group) on bf16 operands, float32
    weights rounded to bf16: equal to a float64 per-group loop on the same rounded values (float32
    accumulation: 1e-5 relative); rows past the groups are zero."""
    from farskip_jax.kernels.cpu import gmm as blas_gmm

    _amx_or_skip()
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((len(sizes), k, n)) * 0.1, jnp.float32)
    g = jnp.asarray(sizes, jnp.int32)
    y = jax.jit(lambda x, w: blas_gmm._gmm_call(x, w, g, False, bf16=True))(x, w)
    dx = jax.jit(lambda d, w: blas_gmm._gmm_call(d, w, g, True, bf16=True))(dy, w)
    dw = jax.jit(lambda x, d: blas_gmm._tgmm_call(x, d, g, bf16=True))(x, dy)
    xf, dyf = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    wf = np.asarray(w.astype(jnp.bfloat16), np.float64)
    y_ref, dx_ref, dw_ref, s = np.zeros((m, n)), np.zeros((m, k)), np.zeros(wf.shape), 0
    for e, c in enumerate(sizes):
        y_ref[s:s + c], dx_ref[s:s + c] = xf[s:s + c] @ wf[e], dyf[s:s + c] @ wf[e].T
        dw_ref[e] = xf[s:s + c].T @ dyf[s:s + c]
        s += c
    assert _rel(y, y_ref) < 1e-5 and _rel(dx, dx_ref) < 1e-5 and _rel(dw, dw_ref) < 1e-5
    assert not np.asarray(y[s:]).any() and not np.asarray(dx[s:]).any()


def test_amx_gmm_equals_float32_path_with_gradients(kernels_config):
    """gmm on bf16 rows with float32 weights: the AMX path and the float32-BLAS path (kernels.amx: off)
    compute the same rounded operands, so values and gradients agree to bf16 rounding of the outputs;
    the weight gradient is float32 (no cast pass), the row gradient bf16."""
    _amx_or_skip()
    m, sizes = 200, [50, 0, 70, 60]
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((m, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((4, 64, 96)) * 0.1, jnp.float32)
    ct = jnp.asarray(rng.standard_normal((m, 96)), jnp.float32)
    g = jnp.asarray(sizes, jnp.int32)

    def run():
        f = jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(gmm(x, w, g, "blas").astype(jnp.float32) * ct),
                                       argnums=(0, 1)))
        return f(x, w)

    (v_amx, (dx_amx, dw_amx)) = run()
    kernels_config(amx="off")
    (v_f32, (dx_f32, dw_f32)) = run()
    assert dw_amx.dtype == jnp.float32 and dx_amx.dtype == jnp.bfloat16
    # measured: values 2.7e-7, row gradient 0 (same bf16 rounding), weight gradient 1.1e-7
    assert _rel(v_amx, v_f32) < 1e-5
    assert _rel(dx_amx, dx_f32) < 4e-3 and _rel(dw_amx, dw_f32) < 1e-5  # dx: within one bf16 ulp


def test_bf16_dense_matmul_on_amx_lowers_per_platform(monkeypatch):
    """matmul_2d on bf16 rows: the AMX kernel in a program lowered for the CPU, XLA's dot otherwise;
    equal values (bf16 output rounding) and float32 weight gradients either way."""
    from farskip_jax.kernels.cpu import dispatch
    from farskip_jax.model.layers import matmul_2d

    _amx_or_skip()
    monkeypatch.setattr(dispatch, "process_devices", lambda: 1)  # the suite's process has 8 CPU devices
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((4, 40, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((64, 96)) * 0.1, jnp.float32)
    f = jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(matmul_2d(x, w).astype(jnp.float32) ** 2), argnums=(0, 1)))
    text = f.lower(x, w).as_text()
    assert "farskip_gmm_bf16" in text and "farskip_tgmm_bf16" in text and "dot_general" not in text
    v, (dx, dw) = f(x, w)
    ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.bfloat16).astype(jnp.float32))
    assert _rel(matmul_2d(x, w), ref) < 4e-3 and dw.dtype == jnp.float32  # bf16 output: measured 2.2e-3
    assert _rel(v, jnp.sum(ref.astype(jnp.bfloat16).astype(jnp.float32) ** 2)) < 1e-3


@pytest.mark.parametrize("transpose_w", [False, True])
def test_float32_dense_matmul_on_blas_equals_float64_with_gradients(transpose_w, monkeypatch, kernels_config):
    """matmul_2d on float32 in a CPU program runs kernels/gmm.matmul (one-group kernels, no XLA dot):
    values and both gradients equal the float64 products to 1e-5 of the largest entry (measured
    ~3e-7); kernels.dense_matmul: xla gives back XLA's dot, a bad value is one clear error."""
    from farskip_jax import kernels
    from farskip_jax.config import load_config
    from farskip_jax.errors import ConfigError
    from farskip_jax.kernels.cpu import dispatch
    from farskip_jax.model.layers import matmul_2d

    if not kernels.available():
        pytest.skip("CPU kernels unavailable")
    monkeypatch.setattr(dispatch, "process_devices", lambda: 1)  # the suite's process has 8 CPU devices
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 41, 64)).astype(np.float32)
    w = (rng.standard_normal((96, 64) if transpose_w else (64, 96)) * 0.1).astype(np.float32)
    g = rng.standard_normal((3, 41, 96)).astype(np.float32)
    f = jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(matmul_2d(x, w, transpose_w) * g), argnums=(0, 1)))
    text = f.lower(x, w).as_text()
    assert "farskip_gmm" in text and "farskip_tgmm" in text and "dot_general" not in text
    _, (dx, dw) = f(x, w)
    w64 = w.astype(np.float64).T if transpose_w else w.astype(np.float64)
    x2, g2 = x.reshape(-1, 64).astype(np.float64), g.reshape(-1, 96).astype(np.float64)
    rel = lambda a, b: float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())  # noqa: E731
    assert rel(matmul_2d(jnp.asarray(x), jnp.asarray(w), transpose_w).reshape(-1, 96), x2 @ w64) < 1e-5
    assert rel(dx.reshape(-1, 64), g2 @ w64.T) < 1e-5
    ref_dw = x2.T @ g2
    assert rel(dw, ref_dw.T if transpose_w else ref_dw) < 1e-5
    kernels_config(dense_matmul="xla")
    assert "farskip_gmm" not in jax.jit(lambda x, w: matmul_2d(x, w, transpose_w)).lower(x, w).as_text()
    kernels_config(dense_matmul="auto")
    monkeypatch.setattr(dispatch, "process_devices", lambda: 2)  # sharded programs keep XLA's dot
    assert "farskip_gmm" not in jax.jit(lambda x, w: matmul_2d(x, w, transpose_w)).lower(x, w).as_text()
    with pytest.raises(ConfigError, match="kernels.dense_matmul='mkl'"):
        load_config(None, ["kernels.dense_matmul=mkl"])


def test_inverse_permutation():
    perm = jnp.asarray(np.random.default_rng(0).permutation(50), jnp.int32)
    inv = inverse_permutation(perm)
    np.testing.assert_array_equal(np.asarray(perm)[np.asarray(inv)], np.arange(50))


def test_weighted_combine_and_its_vjp_match_the_plain_formula():
    rng = np.random.default_rng(1)
    t, k, d = 12, 3, 8
    order = jnp.asarray(rng.permutation(t * k), jnp.int32)
    inv = inverse_permutation(order)
    ys = jnp.asarray(rng.standard_normal((t * k, d)), jnp.float32)
    w = jnp.asarray(rng.random((t, k)), jnp.float32)

    def plain(ys, w):  # un-sort every row, weight, sum the k choices of each token
        return (ys[inv] * w.reshape(-1, 1)).reshape(t, k, d).sum(1)

    ct = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    got, got_vjp = jax.vjp(lambda a, b: weighted_combine(a, inv, order, b, k), ys, w)
    ref, ref_vjp = jax.vjp(plain, ys, w)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    for g, r in zip(got_vjp(ct), ref_vjp(ct)):
        np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------ routed compute

def _swiglu_np(x, wg, wu, wd):
    g, u = x @ wg, x @ wu
    return (g / (1 + np.exp(-g)) * u) @ wd


def _routed_oracle(x, idx, wts, ew, cap):
    """Per-expert, per-token loop: expert e keeps its first `cap` assignments in token order."""
    b, s, d = x.shape
    k = idx.shape[-1]
    xt = x.reshape(b * s, d).astype(np.float64)
    it, wt = idx.reshape(b * s, k), wts.reshape(b * s, k).astype(np.float64)
    y = np.zeros_like(xt)
    dropped = 0
    for e in range(ew[0].shape[0]):
        taken = 0
        for t in range(b * s):
            for j in range(k):
                if it[t, j] != e:
                    continue
                if cap is not None and taken >= cap:
                    dropped += 1
                    continue
                taken += 1
                y[t] += wt[t, j] * _swiglu_np(xt[t:t + 1], *(np.asarray(w[e], np.float64) for w in ew))[0]
    return y.reshape(b, s, d), dropped


def _route(b, s, e, k, seed):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((b, s, e))
    logits[..., 0] += 1.5  # an overloaded expert so that capacity drops happen
    idx = np.argsort(-logits, -1)[..., :k].astype(np.int32)
    wts = rng.uniform(0.1, 1.0, (b, s, k)).astype(np.float32)
    return idx, wts


@pytest.mark.parametrize("backend", ["blas", "tiled", "einsum", "ragged_dot"])
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_local_routed_compute_matches_token_loop(backend, capacity_factor):
    b, s, d, e, k, h = 2, 12, 8, 5, 2, 6
    rng = np.random.default_rng(3)
    x = rng.standard_normal((b, s, d)).astype(np.float32)
    ew = tuple(rng.standard_normal(shape).astype(np.float32) * 0.5 for shape in [(e, d, h), (e, d, h), (e, h, d)])
    idx, wts = _route(b, s, e, k, seed=4)
    cfg = RuntimeConfig(gmm=backend, gmm_tile=8,
                    capacity_factor=capacity_factor)
    cap = None if capacity_factor is None else int(np.ceil(capacity_factor * b * s * k / e))
    route = RouteResult(indices=jnp.asarray(idx), weights=jnp.asarray(wts), aux_loss=jnp.zeros(()),
                        z_loss=jnp.zeros(()), load=jnp.zeros((e,)))
    out = jax.jit(local_routed_compute, static_argnums=(3,))(jnp.asarray(x), route, ExpertWeights(*ew), cfg)
    ref, dropped = _routed_oracle(x, idx, wts, ew, cap)
    assert _rel(out.y, ref) < 1e-5
    assert int(out.dropped) == dropped
    if capacity_factor is not None:
        assert dropped > 0, "the test route must overload an expert"
    else:
        assert dropped == 0


@pytest.mark.parametrize("backend", ["blas", "tiled", "einsum"])
def test_local_routed_compute_gradients_match_dense_oracle(backend):
    """Gradients (input, expert weights, routing weights) vs autodiff of a dense all-experts oracle,
    for the tiled backend's fused SwiGLU walk (custom VJP) and the einsum backend's three gmms."""
    b, s, d, e, k, h = 2, 10, 8, 4, 2, 6
    rng = np.random.default_rng(5)
    x = rng.standard_normal((b, s, d)).astype(np.float32)
    ew = tuple(rng.standard_normal(shape).astype(np.float32) * 0.5 for shape in [(e, d, h), (e, d, h), (e, h, d)])
    idx, wts = _route(b, s, e, k, seed=6)
    ct = rng.standard_normal((b, s, d)).astype(np.float32)
    cfg = RuntimeConfig(gmm=backend, gmm_tile=8)

    def ours(x, wg, wu, wd, wts):
        route = RouteResult(indices=jnp.asarray(idx), weights=wts, aux_loss=jnp.zeros(()),
                            z_loss=jnp.zeros(()), load=jnp.zeros((e,)))
        return jnp.sum(local_routed_compute(x, route, ExpertWeights(wg, wu, wd), cfg).y * ct)

    def dense(x, wg, wu, wd, wts):
        ye = jnp.einsum("bseh,ehd->bsed", jax.nn.silu(jnp.einsum("bsd,edh->bseh", x, wg))
                        * jnp.einsum("bsd,edh->bseh", x, wu), wd)  # every expert on every token
        comb = jnp.sum(jax.nn.one_hot(idx, e) * wts[..., None], axis=2)  # [b, s, e]
        return jnp.sum(jnp.einsum("bsed,bse->bsd", ye, comb) * ct)

    args = (x, *ew, wts)
    got = jax.jit(jax.grad(ours, argnums=(0, 1, 2, 3, 4)))(*args)
    ref = jax.grad(dense, argnums=(0, 1, 2, 3, 4))(*args)
    for a, r, name in zip(got, ref, ("x", "w_gate", "w_up", "w_down", "weights")):
        assert _rel(a, r) < 1e-5, name

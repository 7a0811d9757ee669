"""CPU grouped matmul through BLAS: a small C++ XLA FFI kernel (csrc/grouped_gemm.cc), one sgemm per group;
and the build/load of the project's CPU kernel library (also csrc/attention.cc, model/blas_attention.py).

    gmm(lhs [M, K], rhs [G, K, N], group_sizes [G]) -> [M, N]      (rows sorted by group, float32)
    tgmm(lhs [M, K], dy [M, N], group_sizes [G]) -> [G, K, N]       (per-group lhs^T dy: weight gradient)

The kernel reads every group's rows and weight slice in place and calls cblas_sgemm on them, so
it has none of the costs XLA:CPU adds to a loop of dynamic-slice dots (a copy of each weight
slice, zero-filled loop carries, read-modify-write gradient slices) and it gets BLAS's
multithreaded GEMM (XLA:CPU's small dots run at about one thread's speed). `gmm` has a custom VJP
made of the same two kernels: d lhs = gmm(dy, rhs^T), d rhs = tgmm(lhs, dy).

Build and BLAS. On first use the kernel is compiled with the system C++ compiler ($CXX, g++,
c++ or clang++; about 4 s) against jaxlib's FFI headers into a cache folder
($FARSKIP_KERNEL_CACHE, default ~/.cache/farskip_jax), keyed by the source, the jaxlib version
and the flags. It links no BLAS: at load time it is handed the address of cblas_sgemm from the
first library that has one, in order: $FARSKIP_BLAS_LIB, numpy's bundled OpenBLAS (scipy-openblas,
ILP64), the scipy_openblas32/64 wheels, a system OpenBLAS/CBLAS. `available()` says whether all of
this worked; `moe.gmm: auto` uses this backend on CPU when it did and falls back to `tiled`
(with one warning naming the reason) when it did not.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "grouped_gemm.cc", CSRC / "attention.cc")  # one library: the CPU kernels
HEADERS = (CSRC / "blas_common.h",)
CXX_FLAGS = ("-O3", "-shared", "-fPIC", "-std=c++17", "-w")
# (symbol, ILP64?) in the order tried in each library
_SGEMM_SYMBOLS = (("scipy_cblas_sgemm64_", 1), ("cblas_sgemm64_", 1), ("scipy_cblas_sgemm", 0), ("cblas_sgemm", 0))


class KernelUnavailable(RuntimeError):
    """The BLAS grouped-GEMM kernel could not be built or given a BLAS; the message says why and the fix."""


def _cache_dir() -> Path:
    return Path(os.environ.get("FARSKIP_KERNEL_CACHE") or Path.home() / ".cache" / "farskip_jax")


def _compiler() -> str:
    """$CXX when set (used as given), else the first of g++, c++, clang++ on PATH."""
    if os.environ.get("CXX"):
        return os.environ["CXX"]
    for c in ("g++", "c++", "clang++"):
        if shutil.which(c):
            return c
    raise KernelUnavailable("no C++ compiler found (tried $CXX, g++, c++, clang++); install one "
                            "(e.g. `apt install g++`) or set moe.gmm: tiled")


def build() -> Path:
    """Compile the kernel once per (source, jaxlib, flags) and return the shared library's path."""
    import jaxlib

    src = b"".join(f.read_bytes() for f in (*SOURCES, *HEADERS))
    key = hashlib.sha256(src + jaxlib.__version__.encode() + " ".join(CXX_FLAGS).encode()).hexdigest()[:16]
    out = _cache_dir() / f"libfarskip_cpu_kernels_{key}.so"
    if out.exists():
        return out
    cxx = _compiler()
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)  # build beside, then rename: concurrent builds race safely
    os.close(fd)
    cmd = [cxx, *CXX_FLAGS, f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", tmp]
    try:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            raise KernelUnavailable(f"cannot run the C++ compiler {cxx!r} ({e}); set CXX to a working one "
                                    "or moe.gmm: tiled") from e
        if proc.returncode != 0:
            raise KernelUnavailable(f"compiling {', '.join(f.name for f in SOURCES)} failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _blas_candidates() -> list[str]:
    paths = []
    if os.environ.get("FARSKIP_BLAS_LIB"):
        paths.append(os.environ["FARSKIP_BLAS_LIB"])
    np_root = Path(np.__file__).resolve().parent
    for pattern in ("../numpy.libs/libscipy_openblas*.so*", ".dylibs/libscipy_openblas*.dylib", "../numpy.libs/*openblas*.so*"):
        paths += sorted(glob.glob(str(np_root / pattern)))
    for mod in ("scipy_openblas64", "scipy_openblas32"):
        try:
            m = __import__(mod)
            paths.append(os.path.join(m.get_lib_dir(), m.get_library() + (".dll" if os.name == "nt" else "")))
            paths += sorted(glob.glob(os.path.join(m.get_lib_dir(), "lib*openblas*.so*")))
        except Exception:  # noqa: BLE001 - optional wheels
            pass
    for name in ("openblas", "cblas", "blas", "Accelerate"):
        found = ctypes.util.find_library(name)
        if found:
            paths.append(found)
    return paths


_SET_THREADS_SYMBOLS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads64_",
                        "openblas_set_num_threads")


def _private_copy(path: str) -> str:
    """A copy of the BLAS library file in the kernel cache, so that loading it gives this kernel its
    own BLAS state: its thread count is set to 1 (the kernel runs one sgemm per XLA thread) without
    touching the copy numpy and the rest of the process use. A bare library name (no file) is used
    as it is."""
    src = Path(path)
    if not src.is_file():
        return path
    data_key = hashlib.sha256(f"{src.resolve()}:{src.stat().st_size}:{src.stat().st_mtime_ns}".encode()).hexdigest()[:16]
    dst = _cache_dir() / f"blas_{data_key}{''.join(src.suffixes[-1:]) or '.so'}"
    if not dst.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=dst.parent)
        os.close(fd)
        try:
            shutil.copyfile(src, tmp)
            os.replace(tmp, dst)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return str(dst)


def _find_sgemm() -> tuple[ctypes.CDLL, int, int, str]:
    """(library, address of cblas_sgemm, ilp64 flag, description) from the first library that has
    one, loaded from a private copy with its thread count set to 1."""
    tried = []
    for path in _blas_candidates():
        try:
            probe = ctypes.CDLL(path)
        except OSError:
            tried.append(path)
            continue
        found = next(((sym, ilp64) for sym, ilp64 in _SGEMM_SYMBOLS if getattr(probe, sym, None) is not None), None)
        if found is None:
            tried.append(path)
            continue
        sym, ilp64 = found
        # the copy finds its own dependencies (numpy.libs' libgfortran, named relative to $ORIGIN)
        # by soname among the libraries already loaded: `probe`, the original, loaded them
        lib = ctypes.CDLL(_private_copy(path))
        fn = getattr(lib, sym)
        threads = "its own threads"
        for set_sym in _SET_THREADS_SYMBOLS:
            setter = getattr(lib, set_sym, None)
            if setter is not None:
                setter.argtypes = (ctypes.c_int64 if set_sym.endswith("64_") else ctypes.c_int,)
                setter(1)
                threads = "1 thread per call"
                break
        _KEEP_ALIVE.append(probe)
        return lib, ctypes.cast(fn, ctypes.c_void_p).value, ilp64, f"{sym} from {path} ({threads})"
    raise KernelUnavailable(f"no cblas_sgemm found (tried {tried or 'no library'}); point FARSKIP_BLAS_LIB at an "
                            "OpenBLAS/CBLAS shared library or set moe.gmm: tiled")


@functools.lru_cache(maxsize=1)
def load() -> str:
    """Build, load and register the kernels (once per process); returns the BLAS used. Raises
    KernelUnavailable with the reason."""
    try:
        path = build()
        lib = ctypes.CDLL(str(path))
        blas_lib, addr, ilp64, desc = _find_sgemm()
    except OSError as e:  # an unwritable cache folder, a library that does not load
        raise KernelUnavailable(f"{e}; set FARSKIP_KERNEL_CACHE to a writable folder (now {_cache_dir()}) "
                                "or moe.gmm: tiled") from e
    lib.farskip_set_sgemm.argtypes = (ctypes.c_void_p, ctypes.c_int)
    lib.farskip_set_sgemm(addr, ilp64)
    _KEEP_ALIVE.extend([lib, blas_lib])
    jax.ffi.register_ffi_target("farskip_gmm", jax.ffi.pycapsule(lib.FarskipGmm), platform="cpu")
    jax.ffi.register_ffi_target("farskip_tgmm", jax.ffi.pycapsule(lib.FarskipTgmm), platform="cpu")
    jax.ffi.register_ffi_target("farskip_attention_fwd", jax.ffi.pycapsule(lib.FarskipAttentionFwd), platform="cpu")
    jax.ffi.register_ffi_target("farskip_attention_bwd", jax.ffi.pycapsule(lib.FarskipAttentionBwd), platform="cpu")
    return desc


_KEEP_ALIVE: list = []


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """None when the kernel is ready, else why not (also warned once)."""
    try:
        load()
        return None
    except KernelUnavailable as e:
        warnings.warn(f"the CPU BLAS kernels are unavailable (moe.gmm=auto uses `tiled`, "
                      f"model.attention_impl=auto the naive core): {e}", stacklevel=2)
        return str(e)


def available() -> bool:
    return unavailable_reason() is None


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
    reason = unavailable_reason()
    if reason:
        raise KernelUnavailable(reason)
    y = _gmm_f32(lhs.astype(jnp.float32), rhs.astype(jnp.float32), group_sizes.astype(jnp.int32))
    return y.astype(lhs.dtype)

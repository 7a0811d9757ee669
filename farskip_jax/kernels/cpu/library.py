"""The project's CPU kernel library (csrc/: grouped GEMM and attention as XLA FFI custom calls): build
and load.

On first use the library is compiled with the system C++ compiler ($CXX, else g++, c++ or clang++) against jaxlib's FFI headers into a cache folder (kernels.cache_dir, default
~/.cache/farskip_jax), keyed by the sources, the jaxlib version and the flags. It links no BLAS: at
load time it is handed the address of cblas_sgemm from the first library that has one, in order:
kernels.blas_lib, Intel MKL from the `mkl` wheel (the `mkl` extra; on Intel CPUs, or anywhere with
kernels.blas: mkl; never with kernels.blas: openblas), numpy's bundled OpenBLAS (scipy-openblas,
ILP64), the scipy_openblas32/64 wheels, a system OpenBLAS/CBLAS. OpenBLAS is loaded from a private
copy set to one thread per call (the kernels run one sgemm per XLA thread) so numpy's copy keeps its
threads; MKL runs in its sequential threading layer. `available()` says whether all of this worked;
`amx_available()` whether the bf16 grouped GEMM (Intel AMX tiles) can run too.
The settings are the config's `kernels:` section, handed over by kernels.install (`configure`);
they are read once, at the first load of the process.
Users: kernels/cpu/gmm.py, kernels/cpu/attention.py; the choice of kernel is kernels/cpu/dispatch.py's.
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
import sys
import tempfile
import warnings
from pathlib import Path

import jax
import numpy as np
import jaxlib

from farskip_jax.config import KernelsConfig
from farskip_jax.errors import ConfigError

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "grouped_gemm.cc", CSRC / "attention.cc", CSRC / "bf16_gemm.cc")  # one library: the CPU kernels
HEADERS = (CSRC / "blas_common.h",)
CXX_FLAGS = ("-O3", "-shared", "-fPIC", "-std=c++17", "-w")
# (symbol, ILP64?) in the order tried in each library
_SGEMM_SYMBOLS = (("scipy_cblas_sgemm64_", 1), ("cblas_sgemm64_", 1), ("scipy_cblas_sgemm", 0), ("cblas_sgemm", 0))


class KernelUnavailable(RuntimeError):
    """The CPU kernel library could not be built or given a BLAS; the message says why and the fix."""


_settings = KernelsConfig()
_LOAD_KEYS = ("blas", "blas_lib", "cache_dir")  # what the first load fixed for the process


def configure(cfg: KernelsConfig) -> None:
    """Use `cfg`'s library settings from now on. After the library is loaded, a different BLAS
    choice or cache folder cannot take effect in this process: ConfigError names the keys."""
    global _settings
    if load.cache_info().currsize:
        changed = [k for k in _LOAD_KEYS if getattr(cfg, k) != getattr(_settings, k)]
        if changed:
            raise ConfigError(f"kernels.{', kernels.'.join(changed)} changed after the CPU kernels were loaded with "
                              f"{ {k: getattr(_settings, k) for k in changed} }; the library is loaded once per "
                              "process: start a new process for the new setting")
    _settings = cfg


def settings() -> KernelsConfig:
    return _settings


def _cache_dir() -> Path:
    return Path(_settings.cache_dir or Path.home() / ".cache" / "farskip_jax")


def _compiler() -> str:
    """$CXX when set (used as given), else the first of g++, c++, clang++ on PATH."""
    if os.environ.get("CXX"):
        return os.environ["CXX"]
    for c in ("g++", "c++", "clang++"):
        if shutil.which(c):
            return c
    raise KernelUnavailable("no C++ compiler found (tried $CXX, g++, c++, clang++); install one "
                            "(e.g. `apt install g++`) or set kernels.enabled: false")


def _publish(dst: Path, write) -> None:
    """write(tmp_path) into a temporary file beside dst, then rename it to dst: processes that race
    (parallel test workers) each publish a whole file, and a failed write leaves nothing behind."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=dst.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build() -> Path:
    """Compile the library once per (sources, jaxlib, flags) and return the shared library's path."""
    src = b"".join(f.read_bytes() for f in (*SOURCES, *HEADERS))
    key = hashlib.sha256(src + jaxlib.__version__.encode() + " ".join(CXX_FLAGS).encode()).hexdigest()[:16]
    out = _cache_dir() / f"libfarskip_cpu_kernels_{key}.so"
    if out.exists():
        return out
    cxx = _compiler()

    def compile_to(tmp: str) -> None:
        cmd = [cxx, *CXX_FLAGS, f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", tmp]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            raise KernelUnavailable(f"cannot run the C++ compiler {cxx!r} ({e}); set CXX to a working one "
                                    "or kernels.enabled: false") from e
        if proc.returncode != 0:
            raise KernelUnavailable(f"compiling {', '.join(f.name for f in SOURCES)} failed "
                                    f"({' '.join(cmd)}):\n{proc.stderr[-2000:]}")

    _publish(out, compile_to)
    return out


def _intel_cpu() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "GenuineIntel" in f.read(4096)
    except OSError:
        return False


def _mkl_libraries() -> list[str]:
    """libmkl_rt of the `mkl` wheel (the `mkl` extra) in this environment; under kernels.blas: auto
    only on Intel CPUs, where its sgemm is faster than OpenBLAS's on the expert shapes
    (benchmarks/moe_layer.py) -- MKL takes slower paths on other vendors' CPUs."""
    choice = _settings.blas
    if choice == "openblas" or (choice == "auto" and not _intel_cpu()):
        return []
    found = sorted(glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so*")))[:1]
    if choice == "mkl" and not found:
        raise KernelUnavailable(f"kernels.blas=mkl but no libmkl_rt under {sys.prefix}/lib; install the extra "
                                "(pip install -e '.[mkl]') or set kernels.blas: auto")
    return found


def _blas_candidates() -> list[str]:
    paths = []
    if _settings.blas_lib:
        paths.append(_settings.blas_lib)
    paths += _mkl_libraries()
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
    as it is, and so is MKL (its single dispatch library loads its siblings from its own folder; no
    one else in the process uses that file: numpy has OpenBLAS, torch links its MKL statically)."""
    src = Path(path)
    if not src.is_file() or src.name.startswith("libmkl_rt"):
        return path
    data_key = hashlib.sha256(f"{src.resolve()}:{src.stat().st_size}:{src.stat().st_mtime_ns}".encode()).hexdigest()[:16]
    dst = _cache_dir() / f"blas_{data_key}{''.join(src.suffixes[-1:]) or '.so'}"
    if not dst.exists():
        _publish(dst, lambda tmp: shutil.copyfile(src, tmp))
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
        if getattr(lib, "MKL_Set_Threading_Layer", None) is not None:  # before its first call
            lib.MKL_Set_Threading_Layer.argtypes = (ctypes.c_int,)
            lib.MKL_Set_Threading_Layer(1)  # MKL_THREADING_SEQUENTIAL: one thread per call
            threads = "sequential"
        for set_sym in _SET_THREADS_SYMBOLS:
            setter = getattr(lib, set_sym, None)
            if setter is not None:
                setter.argtypes = (ctypes.c_int64 if set_sym.endswith("64_") else ctypes.c_int,)
                setter(1)
                threads = "1 thread per call"
                break
        _KEEP_ALIVE.append(probe)
        return lib, ctypes.cast(fn, ctypes.c_void_p).value, ilp64, f"{sym} from {path} ({threads})"
    raise KernelUnavailable(f"no cblas_sgemm found (tried {tried or 'no library'}); point kernels.blas_lib at an "
                            "OpenBLAS/CBLAS shared library or set kernels.enabled: false")


@functools.lru_cache(maxsize=1)
def load() -> str:
    """Build, load and register the kernels (once per process); returns the BLAS used. Raises
    KernelUnavailable with the reason."""
    try:
        path = build()
        lib = ctypes.CDLL(str(path))
        blas_lib, addr, ilp64, desc = _find_sgemm()
    except OSError as e:  # an unwritable cache folder, a library that does not load
        raise KernelUnavailable(f"{e}; set kernels.cache_dir to a writable folder (now {_cache_dir()}) "
                                "or kernels.enabled: false") from e
    lib.farskip_set_sgemm.argtypes = (ctypes.c_void_p, ctypes.c_int)
    lib.farskip_set_sgemm(addr, ilp64)
    _KEEP_ALIVE.extend([lib, blas_lib])
    jax.ffi.register_ffi_target("farskip_gmm", jax.ffi.pycapsule(lib.FarskipGmm), platform="cpu")
    jax.ffi.register_ffi_target("farskip_tgmm", jax.ffi.pycapsule(lib.FarskipTgmm), platform="cpu")
    jax.ffi.register_ffi_target("farskip_attention_fwd", jax.ffi.pycapsule(lib.FarskipAttentionFwd), platform="cpu")
    jax.ffi.register_ffi_target("farskip_attention_bwd", jax.ffi.pycapsule(lib.FarskipAttentionBwd), platform="cpu")
    jax.ffi.register_ffi_target("farskip_gmm_bf16", jax.ffi.pycapsule(lib.FarskipGmmBf16), platform="cpu")
    jax.ffi.register_ffi_target("farskip_tgmm_bf16", jax.ffi.pycapsule(lib.FarskipTgmmBf16), platform="cpu")
    return desc


@functools.lru_cache(maxsize=1)
def _amx_usable() -> bool:
    """The loaded library's answer: the CPU has AMX-BF16 and Linux granted the tile state."""
    return bool(ctypes.CDLL(str(build())).farskip_amx_usable())  # the handle load() opened


def amx_available() -> bool:
    """The bf16 grouped GEMM on Intel AMX can run here: the kernels are available, the CPU has AMX-BF16,
    Linux granted the tile state, and kernels.amx is not `off` (which forces the float32 kernels)."""
    return _settings.amx == "auto" and available() and _amx_usable()


_KEEP_ALIVE: list = []


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """None when the kernels are ready, else why not (also warned once)."""
    try:
        load()
        return None
    except KernelUnavailable as e:
        warnings.warn(f"the CPU BLAS kernels are unavailable (runtime.gmm=auto uses `tiled`, "
                      f"runtime.attention_impl=auto the naive core, Linear layers XLA's dot): {e}", stacklevel=2)
        return str(e)


def available() -> bool:
    return unavailable_reason() is None


def require() -> None:
    """Raise KernelUnavailable (with the reason and the fix) unless the kernels are ready."""
    reason = unavailable_reason()
    if reason:
        raise KernelUnavailable(reason)

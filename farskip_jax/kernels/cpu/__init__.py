"""CPU fast paths: C++ XLA FFI kernels behind one small dispatcher.

    dispatch.py     named backends, `resolve(cfg.kernels)`, `install(cfg.kernels)` into kernels/ops.py
    library.py      build (system C++ compiler) and load of csrc/, the BLAS it is given, AMX probe
    gmm.py          grouped matmul / dense matmul through BLAS sgemm or AMX tiles (custom VJPs)
    attention.py    fused attention core (FlashAttention-2 VJP)
    csrc/           the C++ sources

CPU programs only: each backend is registered for platform "cpu".
"""

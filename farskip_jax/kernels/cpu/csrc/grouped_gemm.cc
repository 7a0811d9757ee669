// Grouped GEMM for routed experts on CPU, as XLA FFI custom calls (see farskip_jax/model/blas_gmm.py).
//
//   farskip_gmm : lhs [M, K] rows sorted by group, rhs [G, K, N] (or [G, N, K] with transpose_rhs),
//                 group_sizes [G] int32 -> out [M, N]; out[rows of g] = lhs[rows of g] @ op(rhs[g]),
//                 rows past sum(group_sizes) are zero.
//   farskip_tgmm: lhs [M, K], dy [M, N], group_sizes [G] -> out [G, K, N];
//                 out[g] = lhs[rows of g]^T @ dy[rows of g], zero for empty groups.
//
// BLAS sgemm calls on each group's rows and weight slice, read in place at row offsets (no weight
// copy, no zero-filled loop carry). The work is split into equal parts over XLA's intra-op thread
// pool (the threads XLA itself computes with, so nothing is oversubscribed): gmm by output rows,
// tgmm by whole groups (or by output columns when there are few groups); each part calls sgemm,
// which the Python side has set to one thread. The
// sgemm is a cblas function pointer handed in at load time (farskip_set_sgemm), so this file needs
// no BLAS headers or link-time library: the Python side loads MKL (sequential) or a private copy of
// numpy's bundled OpenBLAS (or another) and passes its cblas_sgemm, LP64 or ILP64.

#include "blas_common.h"

namespace ffi = xla::ffi;

namespace farskip {
void* g_sgemm = nullptr;
int g_ilp64 = 0;
}  // namespace farskip

namespace {

using namespace farskip;

ffi::Error GmmImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> lhs, ffi::Buffer<ffi::F32> rhs,
                   ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> out, bool transpose_rhs) {
  if (!g_sgemm) return NoBlas();
  auto ld = lhs.dimensions();
  auto rd = rhs.dimensions();
  if (ld.size() != 2 || rd.size() != 3) return ffi::Error::InvalidArgument("farskip_gmm: lhs [M, K], rhs [G, ., .]");
  const int64_t m = ld[0], k = ld[1], g = rd[0];
  const int64_t n = transpose_rhs ? rd[1] : rd[2];
  if ((transpose_rhs ? rd[2] : rd[1]) != k || group_sizes.element_count() != static_cast<size_t>(g))
    return ffi::Error::InvalidArgument("farskip_gmm: shape mismatch between lhs, rhs and group_sizes");
  const float* x = lhs.typed_data();
  const float* w = rhs.typed_data();
  const int32_t* gs = group_sizes.typed_data();
  float* y = out->typed_data();
  int64_t rows = 0;  // rows covered by the groups (at most m)
  for (int64_t e = 0; e < g; ++e) rows = std::min<int64_t>(m, rows + std::max<int32_t>(gs[e], 0));
  if (rows < m) std::memset(y + rows * n, 0, sizeof(float) * (m - rows) * n);
  const int64_t parts = NumParts(pool, 2.0 * rows * n * k, std::max<int64_t>(1, rows / 8));
  // part i computes the output rows [i * rows / parts, (i + 1) * rows / parts), group by group
  ParallelParts(pool, parts, [&](int64_t i) {
    const int64_t lo = i * rows / parts, hi = (i + 1) * rows / parts;
    int64_t off = 0;
    for (int64_t e = 0; e < g && off < hi; ++e) {
      const int64_t s = std::min<int64_t>(std::max<int32_t>(gs[e], 0), m - off);
      const int64_t a = std::max(off, lo), b = std::min(off + s, hi);
      if (b > a) Sgemm(false, transpose_rhs, b - a, n, k, x + a * k, k, w + e * rd[1] * rd[2], rd[2], y + a * n, n);
      off += s;
    }
  });
  return ffi::Error::Success();
}

ffi::Error TgmmImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> lhs, ffi::Buffer<ffi::F32> dy,
                    ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> out) {
  if (!g_sgemm) return NoBlas();
  auto ld = lhs.dimensions();
  auto dd = dy.dimensions();
  auto od = out->dimensions();
  if (ld.size() != 2 || dd.size() != 2 || od.size() != 3 || ld[0] != dd[0] || od[1] != ld[1] || od[2] != dd[1] ||
      group_sizes.element_count() != static_cast<size_t>(od[0]))
    return ffi::Error::InvalidArgument("farskip_tgmm: lhs [M, K], dy [M, N], out [G, K, N]");
  const int64_t m = ld[0], k = ld[1], n = dd[1], g = od[0];
  const float* x = lhs.typed_data();
  const float* d = dy.typed_data();
  const int32_t* gs = group_sizes.typed_data();
  float* o = out->typed_data();
  int64_t rows = 0;
  for (int64_t e = 0; e < g; ++e) {
    const int64_t s = std::min<int64_t>(std::max<int32_t>(gs[e], 0), m - rows);
    if (s == 0) std::memset(o + e * k * n, 0, sizeof(float) * k * n);
    rows += s;
  }
  const int64_t parts = NumParts(pool, 2.0 * rows * n * k, std::max<int64_t>(1, n / 16));
  // With several groups per part, part i takes the groups whose rows start in
  // [i * rows / parts, (i + 1) * rows / parts) (whole weight gradients, contiguous); with few
  // groups, it takes the output columns [i * n / parts, (i + 1) * n / parts) of every group.
  const bool by_group = g >= 4 * parts;
  ParallelParts(pool, parts, [&](int64_t i) {
    const int64_t lo = by_group ? 0 : i * n / parts, hi = by_group ? n : (i + 1) * n / parts;
    const int64_t row_lo = i * rows / parts, row_hi = (i + 1) * rows / parts;
    int64_t off = 0;
    for (int64_t e = 0; e < g; ++e) {
      const int64_t s = std::min<int64_t>(std::max<int32_t>(gs[e], 0), m - off);
      if (s > 0 && (!by_group || (off >= row_lo && off < row_hi)))
        Sgemm(true, false, k, hi - lo, s, x + off * k, k, d + off * n + lo, n, o + e * k * n + lo, n);
      off += s;
    }
  });
  return ffi::Error::Success();
}

}  // namespace

extern "C" void farskip_set_sgemm(void* fn, int ilp64) {
  farskip::g_sgemm = fn;
  farskip::g_ilp64 = ilp64;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(FarskipGmm, GmmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("transpose_rhs"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FarskipTgmm, TgmmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

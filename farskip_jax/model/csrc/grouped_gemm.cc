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
// tgmm by output columns; each part calls sgemm, which the Python side has set to one thread. The
// sgemm is a cblas function pointer handed in at load time (farskip_set_sgemm), so this file needs
// no BLAS headers or link-time library: the Python side loads a private copy of numpy's bundled
// OpenBLAS (or another) and passes its cblas_sgemm, LP64 or ILP64.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;  // cblas enum values

using SgemmLp64 = void (*)(int, int, int, int32_t, int32_t, int32_t, float, const float*, int32_t,
                           const float*, int32_t, float, float*, int32_t);
using SgemmIlp64 = void (*)(int, int, int, int64_t, int64_t, int64_t, float, const float*, int64_t,
                            const float*, int64_t, float, float*, int64_t);

void* g_sgemm = nullptr;
int g_ilp64 = 0;
constexpr double kMinFlopsPerPart = 4e6;  // below this a part is not worth a task

void Sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
           const float* b, int64_t ldb, float* c, int64_t ldc) {
  const int ta = trans_a ? kTrans : kNoTrans, tb = trans_b ? kTrans : kNoTrans;
  if (g_ilp64) {
    reinterpret_cast<SgemmIlp64>(g_sgemm)(kRowMajor, ta, tb, m, n, k, 1.0f, a, lda, b, ldb, 0.0f, c, ldc);
  } else {
    reinterpret_cast<SgemmLp64>(g_sgemm)(kRowMajor, ta, tb, static_cast<int32_t>(m), static_cast<int32_t>(n),
                                         static_cast<int32_t>(k), 1.0f, a, static_cast<int32_t>(lda), b,
                                         static_cast<int32_t>(ldb), 0.0f, c, static_cast<int32_t>(ldc));
  }
}

ffi::Error NoBlas() {
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    "farskip grouped GEMM: no BLAS sgemm was registered (farskip_set_sgemm)");
}

// Run part(i) for i in [0, parts): the caller takes parts too, and waits only for parts that other
// threads have already started (a task that starts late finds nothing left), so it cannot deadlock
// on a busy pool.
void ParallelParts(ffi::ThreadPool& pool, int64_t parts, const std::function<void(int64_t)>& part) {
  if (parts <= 1) {
    part(0);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();
  auto work = std::make_shared<std::function<void(int64_t)>>(part);
  const int64_t n = parts;
  auto run = [state, work, n]() {
    for (int64_t i; (i = state->next.fetch_add(1)) < n;) {
      (*work)(i);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < parts; ++t) pool.Schedule([run]() { run(); });
  run();
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

int64_t NumParts(ffi::ThreadPool& pool, double flops, int64_t max_parts) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t by_size = static_cast<int64_t>(flops / kMinFlopsPerPart);
  return std::max<int64_t>(1, std::min({threads, by_size, max_parts}));
}

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
  g_sgemm = fn;
  g_ilp64 = ilp64;
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

// Shared by the CPU kernels (grouped_gemm.cc, attention.cc): the cblas sgemm handed in at load time,
// and a deadlock-free split of work into parts over XLA's intra-op thread pool.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace farskip {

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;  // cblas enum values

using SgemmLp64 = void (*)(int, int, int, int32_t, int32_t, int32_t, float, const float*, int32_t,
                           const float*, int32_t, float, float*, int32_t);
using SgemmIlp64 = void (*)(int, int, int, int64_t, int64_t, int64_t, float, const float*, int64_t,
                            const float*, int64_t, float, float*, int64_t);

extern void* g_sgemm;
extern int g_ilp64;
constexpr double kMinFlopsPerPart = 4e6;  // below this a part is not worth a task

// C = op(A) op(B) + beta C, row-major
inline void Sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                  const float* b, int64_t ldb, float* c, int64_t ldc, float beta = 0.0f) {
  const int ta = trans_a ? kTrans : kNoTrans, tb = trans_b ? kTrans : kNoTrans;
  if (g_ilp64) {
    reinterpret_cast<SgemmIlp64>(g_sgemm)(kRowMajor, ta, tb, m, n, k, 1.0f, a, lda, b, ldb, beta, c, ldc);
  } else {
    reinterpret_cast<SgemmLp64>(g_sgemm)(kRowMajor, ta, tb, static_cast<int32_t>(m), static_cast<int32_t>(n),
                                         static_cast<int32_t>(k), 1.0f, a, static_cast<int32_t>(lda), b,
                                         static_cast<int32_t>(ldb), beta, c, static_cast<int32_t>(ldc));
  }
}

inline ffi::Error NoBlas() {
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    "farskip CPU kernels: no BLAS sgemm was registered (farskip_set_sgemm)");
}

// Run part(i) for i in [0, parts): the caller takes parts too, and waits only for parts that other
// threads have already started (a task that starts late finds nothing left), so it cannot deadlock
// on a busy pool.
inline void ParallelParts(ffi::ThreadPool& pool, int64_t parts, const std::function<void(int64_t)>& part) {
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

inline int64_t NumParts(ffi::ThreadPool& pool, double flops, int64_t max_parts) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t by_size = static_cast<int64_t>(flops / kMinFlopsPerPart);
  return std::max<int64_t>(1, std::min({threads, by_size, max_parts}));
}

}  // namespace farskip

// bfloat16 grouped GEMM on Intel AMX (float32 accumulation), as XLA FFI custom calls (see
// farskip_jax/model/blas_gmm.py, which uses them for bf16 operands when farskip_amx_usable()).
//
//   farskip_gmm_bf16 : lhs [M, K] bf16 rows sorted by group, rhs [G, K, N] f32 (or [G, N, K] with
//                      transpose_rhs; rounded to bf16 as it is packed), group_sizes [G] -> out [M, N]
//                      f32; rows past the groups are 0.
//   farskip_tgmm_bf16: lhs [M, K] bf16, dy [M, N] bf16, group_sizes [G] -> out [G, K, N] f32,
//                      out[g] = lhs[rows of g]^T @ dy[rows of g] (zero for empty groups).
// Both need K and N to be multiples of 32 (the caller checks; other shapes use the float32 kernels).
//
// The AMX unit multiplies 16 x 32 bf16 tiles of A by 32 x 16 tiles of B (B stored as pairs of rows
// interleaved, "VNNI"), accumulating 16 x 16 float32 tiles. Here: B (the float32 weight slice, or dy
// for the weight gradient) is repacked into that layout once per call, then each 32-row block of A is
// multiplied against it in 32-column blocks (2 x 2 accumulator tiles). A row count that is not a
// multiple of 32 goes through a zero-padded copy of its last block. Work is split over XLA's thread
// pool like the float32 kernels; every part loads its own tile configuration (per-thread state).

#include <string>
#include <vector>

#include "blas_common.h"

#if defined(__x86_64__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 11))
#define FARSKIP_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace ffi = xla::ffi;

namespace {

using farskip::NumParts;
using farskip::ParallelParts;
using bf16 = uint16_t;

int64_t RoundUp32(int64_t x) { return (x + 31) / 32 * 32; }


// One 16 x 32 tile of packed B from a full block of 32 source rows k0..k0+31 (vector code: AMX
// CPUs have AVX512-BF16). Row-major source (cs == 1): rows k0+2r and k0+2r+1 are converted together
// and interleaved. Column-major source (rs == 1): each column's 32 contiguous k values are 16 pairs,
// scattered down tile column c.
#ifdef FARSKIP_AMX
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline __m512i Pair(const float* lo, const float* hi) {
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(hi), _mm512_loadu_ps(lo));  // [lo | hi] as bf16
}
__attribute__((target("avx512f,avx512bw"))) inline __m512i Pair(const bf16* lo, const bf16* hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi)), 1);
}
template <typename T>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void PackTile(const T* src, int64_t rs, int64_t cs,
                                                                      bf16* t) {
  if (cs == 1) {  // lanes 0-15: row 2r, lanes 16-31: row 2r+1 -> interleave (2c, 2c+1)
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t r = 0; r < 16; ++r)
      _mm512_storeu_si512(t + r * 32, _mm512_permutexvar_epi16(idx, Pair(src + 2 * r * rs, src + (2 * r + 1) * rs)));
  } else {  // rs == 1: column c's k values in order = 16 (even, odd) pairs = tile column c
    const __m512i rows = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48, 32, 16, 0);
    for (int64_t c = 0; c < 16; ++c)  // Pair() gives [k0..k15 | k16..k31]: already the 16 (even, odd) pairs
      _mm512_i32scatter_epi32(reinterpret_cast<int*>(t) + c, rows, Pair(src + c * cs, src + c * cs + 16), 4);
  }
}
#endif

inline bf16 ToBf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<bf16>(u >> 16);
}
inline bf16 ToBf16(bf16 b) { return b; }

// Pack B[k][n] = src[k * rs + n * cs] (k < kv; rows kv..RoundUp32(kv) are zero) as bf16 into tiles
// ordered [n / 16][k / 32], each 16 rows x 32 bf16: row r holds (B[2r][c], B[2r + 1][c]) for
// c = 0..15. Full 32-row blocks with a contiguous axis (cs == 1 or rs == 1) take the vector code.
template <typename T>
void PackB(const T* src, int64_t rs, int64_t cs, int64_t kv, int64_t n, bf16* dst) {
  const int64_t kb_count = RoundUp32(kv) / 32;
  for (int64_t nb = 0; nb < n / 16; ++nb)
    for (int64_t kb = 0; kb < kb_count; ++kb) {
      bf16* t = dst + (nb * kb_count + kb) * 512;
      const int64_t k0 = kb * 32, kend = std::min<int64_t>(32, kv - k0);
#ifdef FARSKIP_AMX
      if (kend == 32 && (cs == 1 || rs == 1)) {
        PackTile(src + k0 * rs + nb * 16 * cs, rs, cs, t);
        continue;
      }
#endif
      if (kend < 32) std::memset(t, 0, 512 * sizeof(bf16));
      for (int64_t q = 0; q < kend; ++q)
        for (int64_t c = 0; c < 16; ++c) t[(q / 2) * 32 + 2 * c + (q & 1)] = ToBf16(src[(k0 + q) * rs + (nb * 16 + c) * cs]);
    }
}

#ifdef FARSKIP_AMX

bool AmxUsable() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 22) & 1u) || !((d >> 24) & 1u)) return false;  // AMX-BF16, AMX-TILE
    // the kernel must ask Linux for the tile data state (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return ok;
}

struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

__attribute__((target("amx-tile"))) void TileBegin() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  __asm__ volatile("" : : "r"(&cfg) : "memory");  // keep the stores: ldtilecfg reads them
  _tile_loadconfig(&cfg);
}

__attribute__((target("amx-tile"))) void TileEnd() { _tile_release(); }

// c [32, n] f32 (ldc) = a [32, 32 * kb_count] bf16 (lda) @ packed b; tiles 0-3 accumulate, 4-5 hold
// A, 6-7 hold B
__attribute__((target("amx-tile,amx-bf16"))) void Block32(const bf16* a, int64_t lda, const bf16* bp, int64_t n,
                                                           int64_t kb_count, float* c, int64_t ldc) {
  for (int64_t j0 = 0; j0 < n; j0 += 32) {
    const bf16* b0 = bp + (j0 / 16) * kb_count * 512;
    const bf16* b1 = b0 + kb_count * 512;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < kb_count; ++kb) {
      _tile_loadd(4, a + kb * 32, lda * 2);
      _tile_loadd(5, a + 16 * lda + kb * 32, lda * 2);
      _tile_loadd(6, b0 + kb * 512, 64);
      _tile_loadd(7, b1 + kb * 512, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c + j0, ldc * 4);
    _tile_stored(1, c + j0 + 16, ldc * 4);
    _tile_stored(2, c + 16 * ldc + j0, ldc * 4);
    _tile_stored(3, c + 16 * ldc + j0 + 16, ldc * 4);
  }
}

#else

bool AmxUsable() { return false; }
void TileBegin() {}
void TileEnd() {}
void Block32(const bf16*, int64_t, const bf16*, int64_t, int64_t, float*, int64_t) {}

#endif

// c [rows, n] (ldc) = a [rows, k] (lda) @ packed b: whole 32-row blocks in place, the last partial
// block through a zero-padded copy
void RowsTimesPacked(const bf16* a, int64_t lda, int64_t rows, const bf16* bp, int64_t n, int64_t k, float* c,
                     int64_t ldc) {
  const int64_t full = rows / 32 * 32;
  for (int64_t i = 0; i < full; i += 32) Block32(a + i * lda, lda, bp, n, k / 32, c + i * ldc, ldc);
  if (rows > full) {
    std::vector<bf16> at(32 * k, 0);
    std::vector<float> ct(32 * n);
    for (int64_t r = 0; r < rows - full; ++r) std::memcpy(at.data() + r * k, a + (full + r) * lda, 2 * k);
    Block32(at.data(), k, bp, n, k / 32, ct.data(), n);
    for (int64_t r = 0; r < rows - full; ++r) std::memcpy(c + (full + r) * ldc, ct.data() + r * n, 4 * n);
  }
}

ffi::Error Unsupported(const char* what) {
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition, std::string("farskip bf16 kernels: ") + what);
}

const bf16* Bits(const ffi::Buffer<ffi::BF16>& b) { return reinterpret_cast<const bf16*>(b.untyped_data()); }

ffi::Error GmmBf16Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> lhs, ffi::Buffer<ffi::F32> rhs,
                       ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> out, bool transpose_rhs) {
  if (!AmxUsable()) return Unsupported("this CPU or OS has no usable AMX-BF16");
  auto ld = lhs.dimensions();
  auto rd = rhs.dimensions();
  if (ld.size() != 2 || rd.size() != 3) return ffi::Error::InvalidArgument("farskip_gmm_bf16: lhs [M, K], rhs [G, ., .]");
  const int64_t m = ld[0], k = ld[1], g = rd[0];
  const int64_t n = transpose_rhs ? rd[1] : rd[2];
  if ((transpose_rhs ? rd[2] : rd[1]) != k || group_sizes.element_count() != static_cast<size_t>(g))
    return ffi::Error::InvalidArgument("farskip_gmm_bf16: shape mismatch between lhs, rhs and group_sizes");
  if (k % 32 || n % 32) return ffi::Error::InvalidArgument("farskip_gmm_bf16: K and N must be multiples of 32");
  const bf16* x = Bits(lhs);
  const float* w = rhs.typed_data();
  const int32_t* gs = group_sizes.typed_data();
  float* y = out->typed_data();
  std::vector<int64_t> off(g + 1, 0);  // clipped group row offsets
  for (int64_t e = 0; e < g; ++e) off[e + 1] = std::min<int64_t>(m, off[e] + std::max<int32_t>(gs[e], 0));
  const int64_t rows = off[g];
  if (rows < m) std::memset(y + rows * n, 0, sizeof(float) * (m - rows) * n);
  // B of group e: w[e] as [K, N] (rs = N, cs = 1), or w[e]^T from [N, K] (rs = 1, cs = K), packed by
  // the part that uses it just before its rows (still in cache); a group split between two parts is
  // packed by both
  const int64_t parts = NumParts(pool, 2.0 * rows * n * k, std::max<int64_t>(1, rows / 32));
  ParallelParts(pool, parts, [&](int64_t i) {
    const int64_t lo = i * rows / parts / 32 * 32, hi = i + 1 == parts ? rows : (i + 1) * rows / parts / 32 * 32;
    std::unique_ptr<bf16[]> packed(new bf16[k * n]);
    TileBegin();
    for (int64_t e = 0; e < g; ++e) {
      const int64_t a = std::max(off[e], lo), b = std::min(off[e + 1], hi);
      if (b <= a) continue;
      PackB(w + e * k * n, transpose_rhs ? 1 : n, transpose_rhs ? k : 1, k, n, packed.get());
      RowsTimesPacked(x + a * k, k, b - a, packed.get(), n, k, y + a * n, n);
    }
    TileEnd();
  });
  return ffi::Error::Success();
}

ffi::Error TgmmBf16Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> lhs, ffi::Buffer<ffi::BF16> dy,
                        ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> out) {
  if (!AmxUsable()) return Unsupported("this CPU or OS has no usable AMX-BF16");
  auto ld = lhs.dimensions();
  auto dd = dy.dimensions();
  auto od = out->dimensions();
  if (ld.size() != 2 || dd.size() != 2 || od.size() != 3 || ld[0] != dd[0] || od[1] != ld[1] || od[2] != dd[1] ||
      group_sizes.element_count() != static_cast<size_t>(od[0]))
    return ffi::Error::InvalidArgument("farskip_tgmm_bf16: lhs [M, K], dy [M, N], out [G, K, N]");
  const int64_t m = ld[0], k = ld[1], n = dd[1], g = od[0];
  if (k % 32 || n % 32) return ffi::Error::InvalidArgument("farskip_tgmm_bf16: K and N must be multiples of 32");
  const bf16* x = Bits(lhs);
  const bf16* d = Bits(dy);
  const int32_t* gs = group_sizes.typed_data();
  float* o = out->typed_data();
  // group e: rows [off[e], off[e] + s_e) of lhs and dy; its contraction runs over sp_e = RoundUp32(s_e)
  std::vector<int64_t> off(g + 1, 0), poff(g + 1, 0);
  for (int64_t e = 0; e < g; ++e) {
    const int64_t s = std::min<int64_t>(std::max<int32_t>(gs[e], 0), m - off[e]);
    off[e + 1] = off[e] + s;
    poff[e + 1] = poff[e] + RoundUp32(s);
  }
  // A of group e = lhs rows^T: [K, sp_e] zero-padded (at k * poff[e]); B = dy rows packed (at n * poff[e])
  std::unique_ptr<bf16[]> at(new bf16[k * poff[g]]), bp(new bf16[n * poff[g]]);
  const int64_t pack_parts = std::max<int64_t>(1, std::min<int64_t>(g, pool.num_threads()));
  ParallelParts(pool, pack_parts, [&](int64_t i) {
    for (int64_t e = i * g / pack_parts; e < (i + 1) * g / pack_parts; ++e) {
      const int64_t s = off[e + 1] - off[e], sp = poff[e + 1] - poff[e];
      if (s == 0) {
        std::memset(o + e * k * n, 0, sizeof(float) * k * n);
        continue;
      }
      bf16* a = at.get() + k * poff[e];
      for (int64_t r0 = 0; r0 < s; r0 += 16) {  // 16 source rows at a time: their cache lines stay in L1
        const int64_t rn = std::min<int64_t>(16, s - r0);
        const bf16* src = x + (off[e] + r0) * k;
        for (int64_t c = 0; c < k; ++c)
          for (int64_t r = 0; r < rn; ++r) a[c * sp + r0 + r] = src[r * k + c];
      }
      for (int64_t c = 0; c < k; ++c) std::fill(a + c * sp + s, a + (c + 1) * sp, bf16{0});
      PackB(d + off[e] * n, n, 1, s, n, bp.get() + n * poff[e]);
    }
  });
  // work items: (group, 32-row block of the [K, N] output), split evenly over the parts
  std::vector<std::pair<int64_t, int64_t>> items;
  for (int64_t e = 0; e < g; ++e)
    if (off[e + 1] > off[e])
      for (int64_t r = 0; r < k; r += 32) items.emplace_back(e, r);
  const int64_t count = static_cast<int64_t>(items.size());
  if (count == 0) return ffi::Error::Success();
  const int64_t parts = NumParts(pool, 2.0 * off[g] * n * k, count);
  ParallelParts(pool, parts, [&](int64_t i) {
    TileBegin();
    for (int64_t j = i * count / parts; j < (i + 1) * count / parts; ++j) {
      const auto [e, r] = items[j];
      const int64_t sp = poff[e + 1] - poff[e];
      Block32(at.get() + k * poff[e] + r * sp, sp, bp.get() + n * poff[e], n, sp / 32, o + e * k * n + r * n, n);
    }
    TileEnd();
  });
  return ffi::Error::Success();
}

}  // namespace

extern "C" int farskip_amx_usable() { return AmxUsable() ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(FarskipGmmBf16, GmmBf16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("transpose_rhs"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FarskipTgmmBf16, TgmmBf16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

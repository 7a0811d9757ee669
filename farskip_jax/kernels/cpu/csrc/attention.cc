// Fused attention core for CPU (FlashAttention-2 style, one (batch, kv head) pair per task), as XLA FFI
// custom calls (see farskip_jax/model/blas_attention.py). Shapes (row-major, float32):
//
//   farskip_attention_fwd: q [B, T, H, D], k [B, S, KV, D], v [B, S, KV, Dv], mask [B, 1, T, S] bool
//       -> o [B, T, H, Dv], m [B, H, T], l [B, H, T]
//   farskip_attention_bwd: q, k, v, mask, o, m, l, do [B, T, H, Dv] -> dq, dk, dv
//
// Semantics are those of the naive core: logits = where(mask, scale * q k^T, -1e30), softmax over keys
// (a row with no allowed key is uniform), o = p v, gradients flowing only through allowed logits.
// m and l are each row's max and sum of exp(logit - m), so the backward recomputes p = exp(s - m) / l
// exactly, fully masked rows included. Query heads h share kv head h / (H / KV) (GQA).
//
// Per task (b, kv head): for every head of the group and every block of kBlock query rows, the
// scores [rows, keys] live in a task-local buffer (in cache) and only the key range holding an
// allowed key for some row of the block is computed (under a causal mask, about half). Matmuls are
// single-threaded BLAS sgemm calls on strided slices read in place; tasks own disjoint dk/dv slices.

#include <cmath>
#include <vector>

#include "blas_common.h"

namespace {

using namespace farskip;

constexpr int64_t kBlock = 64;
constexpr float kMasked = -1e30f;

struct Dims {
  int64_t b, t, h, d, s, kv, dv, g;
};

// false when the shapes do not fit q [B,T,H,D], k [B,S,KV,D], v [B,S,KV,Dv], mask [B,1,T,S]
bool GetDims(const ffi::Buffer<ffi::F32>& q, const ffi::Buffer<ffi::F32>& k, const ffi::Buffer<ffi::F32>& v,
             const ffi::Buffer<ffi::PRED>& mask, Dims* out) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), md = mask.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || md.size() != 4) return false;
  Dims x{qd[0], qd[1], qd[2], qd[3], kd[1], kd[2], vd[3], 0};
  if (kd[0] != x.b || vd[0] != x.b || kd[3] != x.d || vd[1] != x.s || vd[2] != x.kv || x.kv == 0 ||
      x.h % x.kv != 0 || md[0] != x.b || md[1] != 1 || md[2] != x.t || md[3] != x.s)
    return false;
  x.g = x.h / x.kv;
  *out = x;
  return true;
}

ffi::Error BadShapes() {
  return ffi::Error::InvalidArgument("farskip attention: q [B,T,H,D], k [B,S,KV,D], v [B,S,KV,Dv], mask [B,1,T,S]");
}

// The key range [lo, hi) holding every allowed key of rows [r0, r1); [0, S) when some row has none.
void KeyRange(const bool* mask, int64_t s, int64_t r0, int64_t r1, int64_t* lo, int64_t* hi) {
  int64_t a = s, z = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const bool* row = mask + r * s;
    int64_t first = 0;
    while (first < s && !row[first]) ++first;
    if (first == s) {  // no allowed key: the uniform row needs every key
      *lo = 0, *hi = s;
      return;
    }
    int64_t last = s;
    while (!row[last - 1]) --last;
    a = std::min(a, first), z = std::max(z, last);
  }
  *lo = a, *hi = z;
}

// scores [rows, n] = q_blk k[lo:hi]^T, masked and scaled in place (kMasked where not allowed)
void Scores(const Dims& x, const float* qb, const float* kb, const bool* mrows, int64_t rows, int64_t lo, int64_t n,
            float scale, float* sc) {
  Sgemm(false, true, rows, n, x.d, qb, x.h * x.d, kb + lo * x.kv * x.d, x.kv * x.d, sc, n);
  for (int64_t i = 0; i < rows; ++i) {
    const bool* mr = mrows + i * x.s + lo;
    float* si = sc + i * n;
    for (int64_t j = 0; j < n; ++j) si[j] = mr[j] ? si[j] * scale : kMasked;
  }
}

// One block of query rows of one head: rows [r0, r0 + rows) of head h (kv head kvh) in batch b,
// the allowed keys all in [lo, lo + n); mask points at the block's first mask row.
struct QBlock {
  int64_t b, kvh, h, r0, rows, lo, n;
  const bool* mask;
};

// Part-local buffers of one task walk: p and dp hold [kBlock, S] scores, delta [kBlock].
struct Scratch {
  std::vector<float> p, dp, delta;
};

// Calls task_start(b, kvh) once per (batch, kv head) task, then block(QBlock, Scratch&) for every
// query block of the task's heads; tasks are spread over the pool (parts of consecutive tasks), so a
// task owns dk/dv[b, :, kvh, :].
template <class TaskStart, class Block>
void ForEachQueryBlock(ffi::ThreadPool& pool, const Dims& x, const bool* mask, double flops, TaskStart task_start,
                       Block block) {
  const int64_t tasks = x.b * x.kv;
  const int64_t parts = NumParts(pool, flops, tasks);
  ParallelParts(pool, parts, [&](int64_t part) {
    Scratch scratch{std::vector<float>(kBlock * x.s), std::vector<float>(kBlock * x.s), std::vector<float>(kBlock)};
    for (int64_t task = part * tasks / parts; task < (part + 1) * tasks / parts; ++task) {
      const int64_t b = task / x.kv, kvh = task % x.kv;
      task_start(b, kvh);
      const bool* mb = mask + b * x.t * x.s;
      for (int64_t h = kvh * x.g; h < (kvh + 1) * x.g; ++h) {
        for (int64_t r0 = 0; r0 < x.t; r0 += kBlock) {
          const int64_t rows = std::min(kBlock, x.t - r0);
          int64_t lo, hi;
          KeyRange(mb, x.s, r0, r0 + rows, &lo, &hi);
          block(QBlock{b, kvh, h, r0, rows, lo, hi - lo, mb + r0 * x.s}, scratch);
        }
      }
    }
  });
}

ffi::Error FwdImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                   ffi::Buffer<ffi::PRED> mask, ffi::ResultBuffer<ffi::F32> o, ffi::ResultBuffer<ffi::F32> m_out,
                   ffi::ResultBuffer<ffi::F32> l_out, float scale) {
  if (!g_sgemm) return NoBlas();
  Dims x;
  if (!GetDims(q, k, v, mask, &x)) return BadShapes();
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  float *op = o->typed_data(), *mo = m_out->typed_data(), *lo_ = l_out->typed_data();
  ForEachQueryBlock(pool, x, mask.typed_data(), 4.0 * x.b * x.h * x.t * x.s * x.d, [](int64_t, int64_t) {},
                    [&](const QBlock& blk, Scratch& scratch) {
    const int64_t n = blk.n;
    float* sc = scratch.p.data();
    const float* kb = kp + blk.b * x.s * x.kv * x.d + blk.kvh * x.d;
    const float* vb = vp + blk.b * x.s * x.kv * x.dv + blk.kvh * x.dv;
    Scores(x, qp + (blk.b * x.t + blk.r0) * x.h * x.d + blk.h * x.d, kb, blk.mask, blk.rows, blk.lo, n, scale, sc);
    for (int64_t i = 0; i < blk.rows; ++i) {
      float* si = sc + i * n;
      float mx = kMasked;
      for (int64_t j = 0; j < n; ++j) mx = std::max(mx, si[j]);
      float sum = 0.0f;
      for (int64_t j = 0; j < n; ++j) sum += (si[j] = std::exp(si[j] - mx));
      // keys outside [lo, hi) are masked for this row: exp(kMasked - mx) is 0 unless the row
      // has no allowed key, and then [lo, hi) is every key
      const float inv = 1.0f / sum;
      for (int64_t j = 0; j < n; ++j) si[j] *= inv;
      const int64_t stat = (blk.b * x.h + blk.h) * x.t + blk.r0 + i;
      mo[stat] = mx, lo_[stat] = sum;
    }
    Sgemm(false, false, blk.rows, x.dv, n, sc, n, vb + blk.lo * x.kv * x.dv, x.kv * x.dv,
          op + (blk.b * x.t + blk.r0) * x.h * x.dv + blk.h * x.dv, x.h * x.dv);
  });
  return ffi::Error::Success();
}

ffi::Error BwdImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                   ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::F32> o, ffi::Buffer<ffi::F32> m_in,
                   ffi::Buffer<ffi::F32> l_in, ffi::Buffer<ffi::F32> dout, ffi::ResultBuffer<ffi::F32> dq,
                   ffi::ResultBuffer<ffi::F32> dk, ffi::ResultBuffer<ffi::F32> dv, float scale) {
  if (!g_sgemm) return NoBlas();
  Dims x;
  if (!GetDims(q, k, v, mask, &x)) return BadShapes();
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data(), *opp = o.typed_data();
  const float *mi = m_in.typed_data(), *li = l_in.typed_data(), *dop = dout.typed_data();
  float *dqp = dq->typed_data(), *dkp = dk->typed_data(), *dvp = dv->typed_data();
  const int64_t kstride = x.kv * x.d, vstride = x.kv * x.dv;  // row strides of k/dk and v/dv
  auto zero_task = [&](int64_t b, int64_t kvh) {  // the task owns dk/dv[b, :, kvh, :]
    for (int64_t j = 0; j < x.s; ++j) {
      std::memset(dkp + (b * x.s + j) * kstride + kvh * x.d, 0, sizeof(float) * x.d);
      std::memset(dvp + (b * x.s + j) * vstride + kvh * x.dv, 0, sizeof(float) * x.dv);
    }
  };
  ForEachQueryBlock(pool, x, mask.typed_data(), 8.0 * x.b * x.h * x.t * x.s * x.d, zero_task,
                    [&](const QBlock& blk, Scratch& scratch) {
    const int64_t n = blk.n, rows = blk.rows;
    float *p = scratch.p.data(), *dp = scratch.dp.data(), *delta = scratch.delta.data();
    const int64_t kvoff = blk.b * x.s;  // first key row of this batch
    const float* kb = kp + (kvoff + blk.lo) * kstride + blk.kvh * x.d;
    const float* vb = vp + (kvoff + blk.lo) * vstride + blk.kvh * x.dv;
    const int64_t qoff = (blk.b * x.t + blk.r0) * x.h * x.d + blk.h * x.d;
    const int64_t ooff = (blk.b * x.t + blk.r0) * x.h * x.dv + blk.h * x.dv;
    const float* qb = qp + qoff;
    const float* dob = dop + ooff;
    Scores(x, qb, kp + kvoff * kstride + blk.kvh * x.d, blk.mask, rows, blk.lo, n, scale, p);
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t stat = (blk.b * x.h + blk.h) * x.t + blk.r0 + i;
      const float mx = mi[stat], inv = 1.0f / li[stat];
      float* pi = p + i * n;
      for (int64_t j = 0; j < n; ++j) pi[j] = std::exp(pi[j] - mx) * inv;
      const float* oi = opp + ooff + i * x.h * x.dv;
      const float* doi = dob + i * x.h * x.dv;
      float acc = 0.0f;
      for (int64_t c = 0; c < x.dv; ++c) acc += oi[c] * doi[c];
      delta[i] = acc;
    }
    // dv[lo:hi] += p^T do
    Sgemm(true, false, n, x.dv, rows, p, n, dob, x.h * x.dv, dvp + (kvoff + blk.lo) * vstride + blk.kvh * x.dv,
          vstride, 1.0f);
    // dp = do v[lo:hi]^T; ds = p (dp - delta) scale where allowed, 0 elsewhere
    Sgemm(false, true, rows, n, x.dv, dob, x.h * x.dv, vb, vstride, dp, n);
    for (int64_t i = 0; i < rows; ++i) {
      const bool* mr = blk.mask + i * x.s + blk.lo;
      const float* pi = p + i * n;
      float* di = dp + i * n;
      for (int64_t j = 0; j < n; ++j) di[j] = mr[j] ? pi[j] * (di[j] - delta[i]) * scale : 0.0f;
    }
    // dq rows = ds k[lo:hi] (every key this block touches is in [lo, hi))
    Sgemm(false, false, rows, x.d, n, dp, n, kb, kstride, dqp + qoff, x.h * x.d);
    // dk[lo:hi] += ds^T q_blk
    Sgemm(true, false, n, x.d, rows, dp, n, qb, x.h * x.d, dkp + (kvoff + blk.lo) * kstride + blk.kvh * x.d, kstride,
          1.0f);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FarskipAttentionFwd, FwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FarskipAttentionBwd, BwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));

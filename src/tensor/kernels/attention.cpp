// Fused causal attention, flash-attention style, for the CPU.
//
// Scores are computed transposed, keys x queries: a vector register then holds 16 queries, so the
// softmax over keys (running max, sum) is a vertical reduction over rows with one max/sum per
// query lane, never a horizontal one, and the per-query state (max, sum, rescale factor) is a
// vector too.
//
// Forward: for each (batch, head, query tile) the key tiles are visited once: s^T (keys x
// queries) = K q^T, folded into a running max / running sum (online softmax), the output
// accumulator o (queries x HS) rescaled and o += p v, where p is read transposed from p^T. Only
// the output and the log-sum-exp per query are stored.
// Backward (FlashAttention-2 order): for each (batch, kv head) the key tiles are the outer loop;
// for every query tile that sees a key tile, p^T and dp^T are recomputed from q, k, v and the
// saved log-sum-exp; dk and dv of the key tile accumulate in local buffers, dq in place. One task
// owns a kv head (and the query heads that share it), so there are no races and the result does
// not depend on the thread count.
//
// Tiles are 64 x 64 and aligned, so a key tile is either entirely visible to a query tile or is
// its diagonal tile. On the diagonal the products skip the part the causal mask hides (whole
// column vectors of s^T, and the keys past a query block in p v), which saves about a third of
// the diagonal tiles' work. Every operand of a tile product is first packed (rows of q, k, v, dout
// and their transposes) so that it sits in L1: the strided rows of a (B, T, 3C) qkv tensor are a
// power of two apart and would map onto the same L1 sets. The strided rows are read with software
// prefetch a few rows ahead (see kPrefetchRows); prefetching the next head's rows instead was
// measured no faster.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "acc/tensor/kernels.hpp"
#include "acc/tensor/threading.hpp"
#include "simd.hpp"
#include "tile_gemm.hpp"
#include "vec_math.hpp"

namespace acc::kernels {
namespace {

constexpr int64_t kTile = 64;  // query and key tile
constexpr int64_t W = tile::kWidth;
static_assert(kTile % W == 0);

inline const float* row(const AttnOperand& a, int64_t b, int64_t h, int64_t t) {
  return a.ptr + b * a.sb + h * a.sh + t * a.st;
}
inline float* row(const AttnGrad& a, int64_t b, int64_t h, int64_t t) {
  return a.ptr + b * a.sb + h * a.sh + t * a.st;
}

// The row stride of transposed (HS x Tp) copies of a head: T rounded up to 16, plus 16 so that
// rows do not sit a power of two apart (which maps them onto the same L1 sets).
inline int64_t padded(int64_t T) {
  return (T + 15) / 16 * 16 + 16;
}

// How many rows ahead packed_rows and the D pass prefetch (load_transposed, which reads blocks of
// 16 rows, prefetches the next block). A head's row is HS floats (a few cache lines) out of a row
// of all heads, so consecutive rows sit a page or more apart and the hardware prefetchers, which
// follow streams within a page, do not fetch them: without software prefetch each row costs a
// memory latency (one-off timing, 8 x 8 heads of a (8, 256, 1536) tensor: 4.3 GB/s without,
// 6.1-6.5 GB/s with 8 rows ahead).
constexpr int64_t kPrefetchRows = 8;

// Prefetches the cache lines of a head's row [p, p + n) into L1.
inline void prefetch_row(const float* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 64 / sizeof(float)) __builtin_prefetch(p + i, 0, 3);
}

// Rows [0, T) of head (b, h) of `a` as a contiguous (T x HS) block: in place when they already
// are, else copied into `buf`.
const float* packed_rows(float* buf, const AttnOperand& a, int64_t b, int64_t h, int64_t T,
                         int64_t HS) {
  if (a.st == HS) return row(a, b, h, 0);
  for (int64_t t = 0; t < T; ++t) {
    if (t + kPrefetchRows < T) prefetch_row(row(a, b, h, t + kPrefetchRows), HS);
    std::memcpy(buf + t * HS, row(a, b, h, t), sizeof(float) * HS);
  }
  return buf;
}

// dst[0, n) = src[0, n). With a vector-aligned destination the stores bypass the caches: the
// output rows of a head (and the gradient rows of k and v) go to a large buffer that is written
// once here and only read again by the next op, and ordinary stores would first read every line
// of it from memory. Callers issue simd::stream_fence() before the written rows are read by
// another thread.
inline void store_row_streaming(float* dst, const float* src, int64_t n) {
  if (n % W == 0 && reinterpret_cast<uintptr_t>(dst) % simd::kStreamAlign == 0) {
    for (int64_t i = 0; i < n; i += W) simd::stream(dst + i, simd::load(src + i));
    return;
  }
  std::memcpy(dst, src, sizeof(float) * n);
}

#if defined(__AVX512F__)
// 16 x 16 transpose in registers: r[c] becomes column c of the rows r[0..15]. The maskz forms
// with a full mask are the plain shuffles (the unmasked intrinsics trip GCC 12's
// -Wmaybe-uninitialized through _mm512_undefined_ps).
inline void transpose16(__m512 r[16]) {
  constexpr __mmask16 k16 = 0xFFFF;
  constexpr __mmask8 k8 = 0xFF;
  __m512 t[16], u[16];
  for (int p = 0; p < 8; ++p) {
    t[2 * p] = _mm512_maskz_unpacklo_ps(k16, r[2 * p], r[2 * p + 1]);
    t[2 * p + 1] = _mm512_maskz_unpackhi_ps(k16, r[2 * p], r[2 * p + 1]);
  }
  // u[4q + x], 128-bit lane L: column 4L + x of rows 4q .. 4q + 3.
  for (int q = 0; q < 4; ++q) {
    const __m512d a = _mm512_castps_pd(t[4 * q]), b = _mm512_castps_pd(t[4 * q + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * q + 2]), d = _mm512_castps_pd(t[4 * q + 3]);
    u[4 * q] = _mm512_castpd_ps(_mm512_maskz_unpacklo_pd(k8, a, c));
    u[4 * q + 1] = _mm512_castpd_ps(_mm512_maskz_unpackhi_pd(k8, a, c));
    u[4 * q + 2] = _mm512_castpd_ps(_mm512_maskz_unpacklo_pd(k8, b, d));
    u[4 * q + 3] = _mm512_castpd_ps(_mm512_maskz_unpackhi_pd(k8, b, d));
  }
  for (int x = 0; x < 4; ++x) {
    const __m512 s0 = _mm512_maskz_shuffle_f32x4(k16, u[x], u[4 + x], 0x44);
    const __m512 s1 = _mm512_maskz_shuffle_f32x4(k16, u[x], u[4 + x], 0xEE);
    const __m512 s2 = _mm512_maskz_shuffle_f32x4(k16, u[8 + x], u[12 + x], 0x44);
    const __m512 s3 = _mm512_maskz_shuffle_f32x4(k16, u[8 + x], u[12 + x], 0xEE);
    r[x] = _mm512_maskz_shuffle_f32x4(k16, s0, s2, 0x88);
    r[4 + x] = _mm512_maskz_shuffle_f32x4(k16, s0, s2, 0xDD);
    r[8 + x] = _mm512_maskz_shuffle_f32x4(k16, s1, s3, 0x88);
    r[12 + x] = _mm512_maskz_shuffle_f32x4(k16, s1, s3, 0xDD);
  }
}
#endif

// dst (HS x ld) columns [0, n) = f * rows [0, n) of head (b, h) of `a` transposed; columns
// [n, pad) zeroed.
void load_transposed(float* dst, int64_t ld, const AttnOperand& a, int64_t b, int64_t h, int64_t n,
                     int64_t pad, int64_t HS, float f = 1.f) {
  int64_t j0 = 0;
#if defined(__AVX512F__)
  for (; j0 + 16 <= n; j0 += 16) {
    int64_t d0 = 0;
    for (; d0 + 16 <= HS; d0 += 16) {
      __m512 r[16];
      const __m512 vf = _mm512_set1_ps(f);
      for (int jj = 0; jj < 16; ++jj) {
        if (d0 == 0 && j0 + 16 + jj < n) prefetch_row(row(a, b, h, j0 + 16 + jj), HS);
        r[jj] = _mm512_mul_ps(_mm512_loadu_ps(row(a, b, h, j0 + jj) + d0), vf);
      }
      transpose16(r);
      for (int dd = 0; dd < 16; ++dd) _mm512_storeu_ps(dst + (d0 + dd) * ld + j0, r[dd]);
    }
    for (int64_t jj = 0; jj < 16 && d0 < HS; ++jj) {
      const float* src = row(a, b, h, j0 + jj);
      for (int64_t d = d0; d < HS; ++d) dst[d * ld + j0 + jj] = src[d] * f;
    }
  }
#endif
  // Blocks of 16 rows: each output row segment of 16 is written contiguously.
  constexpr int64_t kBlock = 16;
  const float* rows[kBlock];
  for (; j0 < n; j0 += kBlock) {
    const int64_t nb = std::min(kBlock, n - j0);
    for (int64_t jj = 0; jj < nb; ++jj) rows[jj] = row(a, b, h, j0 + jj);
    for (int64_t d = 0; d < HS; ++d) {
      float* out = dst + d * ld + j0;
      for (int64_t jj = 0; jj < nb; ++jj) out[jj] = rows[jj][d] * f;
    }
  }
  for (int64_t d = 0; d < HS; ++d) {
    for (int64_t j = n; j < pad; ++j) dst[d * ld + j] = 0.f;
  }
}

// On a diagonal tile, the first column vector (of queries) that row j of a keys x queries tile
// has visible entries in, rounded down to the start of j's row block in tile::gemm_blocks (all
// rows of a block compute the same columns). Query i sees key j when i >= j.
inline int64_t diag_vec0(int64_t j) {
  return j / tile::kRows * tile::kRows / W;
}

// range() for products whose rows are keys and columns queries (s^T = K q^T): on the diagonal,
// skip the column vectors the whole block cannot see.
struct KeyRowsRange {
  bool diag;
  int64_t K;
  tile::BlockRange operator()(int64_t s, int) const { return {diag ? diag_vec0(s) * W : 0, 0, K}; }
};
// range() for products whose rows are keys and K runs over queries (dv = p^T dout): on the
// diagonal, queries before the block's first visible vector contribute nothing.
struct KeyRowsQueryKRange {
  bool diag;
  int64_t nq;
  tile::BlockRange operator()(int64_t s, int) const { return {0, diag ? diag_vec0(s) * W : 0, nq}; }
};
// range() for products whose rows are queries and K runs over keys (o = p v): on the diagonal,
// a query block [s, s + R) sees keys [0, s + R) only.
struct QueryRowsKeyKRange {
  bool diag;
  int64_t nk;
  tile::BlockRange operator()(int64_t s, int R) const {
    return {0, 0, diag ? std::min<int64_t>(nk, s + R) : nk};
  }
};

// Online softmax down each column (query) of a key tile sT (nk x NV*W, row stride kTile) of
// scaled scores: sT becomes p = exp(s - m_new) (0 where the mask hides a key), and the running
// max m, running sum l and rescale factor alpha = exp(m_old - m_new) of each query are updated.
// On the diagonal (Diag) query i sees key j when i >= j, and only the rows that have entries in
// a column vector (see diag_vec0) are read or written.
template <bool Diag>
void online_softmax(float* sT, int64_t nk, int64_t NV, float* m, float* l, float* alpha) {
  using simd::vreg;
  const vreg ninf = simd::set1(-INFINITY), zero = simd::set1(0.f);
  for (int64_t c = 0; c < NV; ++c) {
    int64_t jend = nk;
    if (Diag) {
      jend = 0;
      while (jend < nk && diag_vec0(jend) <= c) ++jend;
    }
    const vreg qi = simd::add(simd::iota(), simd::set1(static_cast<float>(c * W)));
    const vreg m_old = simd::load(m + c * W);
    vreg mx = m_old;
    for (int64_t j = 0; j < jend; ++j) {
      vreg x = simd::load(sT + j * kTile + c * W);
      if (Diag) x = simd::select_lt(qi, simd::set1(static_cast<float>(j)), ninf, x);
      mx = simd::max(mx, x);
    }
    // A column with no visible key yet keeps max -inf; subtract 0 instead so that exp gives 0
    // rather than NaN.
    const vreg msafe = simd::select_lt(mx, simd::set1(-3.0e38f), zero, mx);
    vreg sum = zero;
    for (int64_t j = 0; j < jend; ++j) {
      float* sp = sT + j * kTile + c * W;
      vreg p = simd::exp(simd::sub(simd::load(sp), msafe));
      if (Diag) p = simd::select_lt(qi, simd::set1(static_cast<float>(j)), zero, p);
      simd::store(sp, p);
      sum = simd::add(sum, p);
    }
    const vreg a = simd::exp(simd::sub(m_old, msafe));
    simd::store(l + c * W, simd::add(simd::mul(simd::load(l + c * W), a), sum));
    simd::store(m + c * W, mx);
    simd::store(alpha + c * W, a);
  }
}

// Backward of a key tile: pT (nk x NV*W, scaled scores) becomes p = exp(s - lse), dsT (dp)
// becomes ds = p (dp - D) scale, 0 where the mask hides a key; Lq and Dq hold lse and D of the
// tile's queries.
template <bool Diag>
void softmax_backward(float* pT, float* dsT, int64_t nk, int64_t NV, const float* Lq,
                      const float* Dq, float scale) {
  using simd::vreg;
  const vreg vscale = simd::set1(scale), zero = simd::set1(0.f);
  for (int64_t j = 0; j < nk; ++j) {
    const vreg vj = simd::set1(static_cast<float>(j));
    for (int64_t c = Diag ? diag_vec0(j) : 0; c < NV; ++c) {
      float* pp = pT + j * kTile + c * W;
      float* dp = dsT + j * kTile + c * W;
      vreg p = simd::exp(simd::sub(simd::load(pp), simd::load(Lq + c * W)));
      if (Diag) {
        const vreg qi = simd::add(simd::iota(), simd::set1(static_cast<float>(c * W)));
        p = simd::select_lt(qi, vj, zero, p);
      }
      simd::store(pp, p);
      simd::store(
          dp, simd::mul(simd::mul(p, simd::sub(simd::load(dp), simd::load(Dq + c * W))), vscale));
    }
  }
}

}  // namespace

void attention_forward(AttnGrad out, float* lse, AttnOperand q, AttnOperand k, AttnOperand v,
                       int64_t B, int64_t NH, int64_t NKV, int64_t T, int64_t HS, float scale,
                       bool causal) {
  const int64_t group = NH / NKV, Tp = padded(T);
  // One task per (batch, kv head): K and V are packed once and serve every query tile of every
  // query head that shares them.
  parallel_for(B * NKV, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> kbuf(static_cast<size_t>(T * HS)), vbuf(kbuf.size());
    std::vector<float> qT(static_cast<size_t>(HS * Tp));        // scale * q^T
    std::vector<float> sT(static_cast<size_t>(kTile * kTile));  // s^T, then p^T (keys x queries)
    std::vector<float> o(static_cast<size_t>(kTile * HS));      // output accumulator
    alignas(64) float m[kTile], l[kTile], alpha[kTile];
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t kvh = w % NKV, b = w / NKV;
      const float* kp = packed_rows(kbuf.data(), k, b, kvh, T, HS);
      const float* vp = packed_rows(vbuf.data(), v, b, kvh, T, HS);
      for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
        // The score scale goes into q^T: s = (scale q) k^T needs no pass of its own.
        load_transposed(qT.data(), Tp, q, b, h, T, Tp, HS, scale);
        for (int64_t q0 = 0; q0 < T; q0 += kTile) {
          const int64_t nq = std::min<int64_t>(kTile, T - q0), NV = (nq + W - 1) / W;
          for (int64_t i = 0; i < NV * W; ++i) {
            m[i] = -INFINITY;
            l[i] = 0.f;
          }
          const int64_t kend = causal ? q0 + nq : T;
          for (int64_t k0 = 0; k0 < kend; k0 += kTile) {
            const int64_t nk = std::min<int64_t>(kTile, kend - k0);
            const bool diag = causal && k0 == q0;
            // sT (nk x NV*W) = k (nk x HS) @ qT[:, q0:] (HS x NV*W)
            tile::gemm_blocks<false, false>(sT.data(), kTile, kp + k0 * HS, HS, qT.data() + q0, Tp,
                                            nk, NV * W, KeyRowsRange{diag, HS});
            if (diag) {
              online_softmax<true>(sT.data(), nk, NV, m, l, alpha);
            } else {
              online_softmax<false>(sT.data(), nk, NV, m, l, alpha);
            }
            // o (nq x HS) = alpha * o + p (nq x nk) @ v (nk x HS), p read from sT transposed.
            const float* vk = vp + k0 * HS;
            if (k0 == 0) {
              tile::gemm_blocks<false, true>(o.data(), HS, sT.data(), kTile, vk, HS, nq, HS,
                                             QueryRowsKeyKRange{diag, nk});
            } else {
              for (int64_t i = 0; i < nq; ++i) {
                if (alpha[i] == 1.f) continue;
                float* oi = o.data() + i * HS;
                for (int64_t d = 0; d < HS; ++d) oi[d] *= alpha[i];
              }
              tile::gemm_blocks<true, true>(o.data(), HS, sT.data(), kTile, vk, HS, nq, HS,
                                            QueryRowsKeyKRange{diag, nk});
            }
          }
          for (int64_t i = 0; i < nq; ++i) {
            const float inv = 1.f / l[i];
            float* a = o.data() + i * HS;
            for (int64_t d = 0; d < HS; ++d) a[d] *= inv;
            store_row_streaming(row(out, b, h, q0 + i), a, HS);
            lse[(b * NH + h) * T + q0 + i] = m[i] + std::log(l[i]);
          }
        }
      }
    }
    simd::stream_fence();
  });
}

void attention_backward(AttnGrad dq, AttnGrad dk, AttnGrad dv, AttnOperand dout, AttnOperand q,
                        AttnOperand k, AttnOperand v, AttnOperand out, const float* lse, int64_t B,
                        int64_t NH, int64_t NKV, int64_t T, int64_t HS, float scale, bool causal) {
  const int64_t group = NH / NKV, Tp = padded(T);
  parallel_for(B * NKV, 1, [&](int64_t w0, int64_t w1) {
    const size_t tile_sq = static_cast<size_t>(kTile * kTile);
    const size_t head_rows = static_cast<size_t>(T * HS), head_cols = static_cast<size_t>(HS * Tp);
    // Packed rows of K and V of the kv head; of each query head: rows of q and dout, scale * q^T
    // and dout^T (HS x Tp).
    std::vector<float> kbuf(head_rows), vbuf(head_rows);
    std::vector<float> qbuf(group * head_rows), dobuf(group * head_rows);
    std::vector<const float*> qp(group), dop(group);
    std::vector<float> qT(group * head_cols), doT(group * head_cols);
    std::vector<float> pT(tile_sq), dsT(tile_sq);  // keys x queries
    // dk and dv of one key tile (nk x HS), accumulated over every query tile.
    std::vector<float> dkb(static_cast<size_t>(kTile * HS)), dvb(dkb.size());
    // Log-sum-exp and D = dout . out per query, padded to whole vectors.
    std::vector<float> L(static_cast<size_t>(group * Tp)), D(L.size());
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t kvh = w % NKV, b = w / NKV, h0 = kvh * group;
      const float* kp = packed_rows(kbuf.data(), k, b, kvh, T, HS);
      const float* vp = packed_rows(vbuf.data(), v, b, kvh, T, HS);
      for (int64_t g = 0; g < group; ++g) {
        qp[g] = packed_rows(qbuf.data() + g * head_rows, q, b, h0 + g, T, HS);
        dop[g] = packed_rows(dobuf.data() + g * head_rows, dout, b, h0 + g, T, HS);
        // Transposed from the packed rows, which are in cache: q and dout are read from memory
        // once.
        const AttnOperand qrows{qp[g], 0, 0, HS}, dorows{dop[g], 0, 0, HS};
        load_transposed(qT.data() + g * head_cols, Tp, qrows, 0, 0, T, Tp, HS, scale);
        load_transposed(doT.data() + g * head_cols, Tp, dorows, 0, 0, T, Tp, HS);
        const float* lse_bh = lse + (b * NH + h0 + g) * T;
        for (int64_t t = 0; t < Tp; ++t) {
          if (t + kPrefetchRows < T) prefetch_row(row(out, b, h0 + g, t + kPrefetchRows), HS);
          L[g * Tp + t] = t < T ? lse_bh[t] : 0.f;
          D[g * Tp + t] = t < T ? vec::dot(row(out, b, h0 + g, t), dop[g] + t * HS, HS) : 0.f;
        }
      }
      for (int64_t k0 = 0; k0 < T; k0 += kTile) {
        const int64_t nk = std::min<int64_t>(kTile, T - k0);
        std::fill(dkb.begin(), dkb.end(), 0.f);
        std::fill(dvb.begin(), dvb.end(), 0.f);
        const float* kk = kp + k0 * HS;
        const float* vk = vp + k0 * HS;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t h = h0 + g;
          const float* qTg = qT.data() + g * head_cols;
          const float* doTg = doT.data() + g * head_cols;
          for (int64_t q0 = causal ? k0 : 0; q0 < T; q0 += kTile) {
            const int64_t nq = std::min<int64_t>(kTile, T - q0), NV = (nq + W - 1) / W;
            const bool diag = causal && q0 == k0;
            // pT = k qT (scaled scores), dsT = v doT (dp), both (nk x NV*W).
            tile::gemm_blocks<false, false>(pT.data(), kTile, kk, HS, qTg + q0, Tp, nk, NV * W,
                                            KeyRowsRange{diag, HS});
            tile::gemm_blocks<false, false>(dsT.data(), kTile, vk, HS, doTg + q0, Tp, nk, NV * W,
                                            KeyRowsRange{diag, HS});
            const float* Lq = L.data() + g * Tp + q0;
            const float* Dq = D.data() + g * Tp + q0;
            if (diag) {
              softmax_backward<true>(pT.data(), dsT.data(), nk, NV, Lq, Dq, scale);
            } else {
              softmax_backward<false>(pT.data(), dsT.data(), nk, NV, Lq, Dq, scale);
            }
            // dv (nk x HS) += p^T (nk x nq) @ dout (nq x HS); dk += ds^T @ q;
            // dq (nq x HS) (+)= ds (nq x nk) @ k (nk x HS), ds read from dsT transposed.
            tile::gemm_blocks<true, false>(dvb.data(), HS, pT.data(), kTile, dop[g] + q0 * HS, HS,
                                           nk, HS, KeyRowsQueryKRange{diag, nq});
            tile::gemm_blocks<true, false>(dkb.data(), HS, dsT.data(), kTile, qp[g] + q0 * HS, HS,
                                           nk, HS, KeyRowsQueryKRange{diag, nq});
            if (k0 == 0) {
              tile::gemm_blocks<false, true>(row(dq, b, h, q0), dq.st, dsT.data(), kTile, kk, HS,
                                             nq, HS, QueryRowsKeyKRange{diag, nk});
            } else {
              tile::gemm_blocks<true, true>(row(dq, b, h, q0), dq.st, dsT.data(), kTile, kk, HS, nq,
                                            HS, QueryRowsKeyKRange{diag, nk});
            }
          }
        }
        for (int64_t j = 0; j < nk; ++j) {
          store_row_streaming(row(dk, b, kvh, k0 + j), dkb.data() + j * HS, HS);
          store_row_streaming(row(dv, b, kvh, k0 + j), dvb.data() + j * HS, HS);
        }
      }
    }
    simd::stream_fence();
  });
}

}  // namespace acc::kernels

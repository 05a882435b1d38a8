// Fused causal attention, flash-attention style, for the CPU.
//
// Forward: for each (batch, head, query tile) the key tiles are visited once; scores for a tile
// are computed into a small buffer, folded into a running max / running sum (online softmax) and
// the output accumulator is rescaled. Only the output and the log-sum-exp per row are stored.
// Backward (FlashAttention-2 order): for each (batch, kv head) the key tiles are the outer loop;
// for every query tile that sees a key tile, the probabilities are recomputed from q, k and the
// saved log-sum-exp, dk/dv for the key tile accumulate in registers-sized buffers, and dq
// accumulates in place. One task owns a kv head (and the query heads that share it), so there
// are no races and the result does not depend on the thread count.
//
// Every product inside a tile goes through tile::gemm_set/gemm_acc (a register-blocked FMA
// micro-kernel).

#include <algorithm>
#include <cmath>
#include <vector>

#include "acc/tensor/kernels.hpp"
#include "acc/tensor/threading.hpp"
#include "simd.hpp"
#include "tile_gemm.hpp"
#include "vec_math.hpp"

namespace acc::kernels {
namespace {

// Query tiles of 64 rows against key blocks of 256: large key blocks mean fewer online-softmax
// rescales and larger, more efficient tile products; the causal mask only wastes work inside the
// 64-wide diagonal.
constexpr int kQTile = 64;
constexpr int kKTile = 64;

// Columns of a key block the tile products compute: nk rounded up to a vector width (the
// transposed copies are zero-padded that far).
inline int64_t product_cols(int64_t nk) {
  return (nk + 15) / 16 * 16;
}

inline const float* row(const AttnOperand& a, int64_t b, int64_t h, int64_t t) {
  return a.ptr + b * a.sb + h * a.sh + t * a.st;
}
inline float* row(const AttnGrad& a, int64_t b, int64_t h, int64_t t) {
  return a.ptr + b * a.sb + h * a.sh + t * a.st;
}

// dst (HS x ld) columns [0, n) = rows [t0, t0 + n) of `a` transposed; columns [n, pad) zeroed.
void load_transposed(float* dst, int64_t ld, const AttnOperand& a, int64_t b, int64_t h, int64_t t0,
                     int64_t n, int64_t pad, int64_t HS) {
  // Blocks of 16 rows: each output row segment of 16 is written contiguously.
  constexpr int64_t kBlock = 16;
  const float* rows[kBlock];
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    const int64_t nb = std::min(kBlock, n - j0);
    for (int64_t jj = 0; jj < nb; ++jj) rows[jj] = row(a, b, h, t0 + j0 + jj);
    for (int64_t d = 0; d < HS; ++d) {
      float* out = dst + d * ld + j0;
      for (int64_t jj = 0; jj < nb; ++jj) out[jj] = rows[jj][d];
    }
  }
  for (int64_t d = 0; d < HS; ++d) {
    for (int64_t j = n; j < pad; ++j) dst[d * ld + j] = 0.f;
  }
}

// Number of keys of tile [k0, k0 + nk) that query t may attend to.
inline int64_t visible(int64_t t, int64_t k0, int64_t nk, bool causal) {
  return causal ? std::clamp<int64_t>(t - k0 + 1, 0, nk) : nk;
}

// The row stride of transposed (HS x Tp) copies of a head: T rounded up to 16, plus 16 so that
// rows do not sit a power of two apart (which maps them onto the same L1 sets).
inline int64_t padded(int64_t T) {
  return (T + 15) / 16 * 16 + 16;
}

}  // namespace

void attention_forward(AttnGrad out, float* lse, AttnOperand q, AttnOperand k, AttnOperand v,
                       int64_t B, int64_t NH, int64_t NKV, int64_t T, int64_t HS, float scale,
                       bool causal) {
  const int64_t group = NH / NKV, Tp = padded(T);
  // One task per (batch, kv head): K is transposed once and serves every query tile of every
  // query head that shares it.
  parallel_for(B * NKV, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> kT(static_cast<size_t>(HS * Tp));
    std::vector<float> s(static_cast<size_t>(kQTile * kKTile));
    std::vector<float> acc(static_cast<size_t>(kQTile * HS));
    float m[kQTile], l[kQTile];
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t kvh = w % NKV, b = w / NKV;
      load_transposed(kT.data(), Tp, k, b, kvh, 0, T, Tp, HS);
      for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
        for (int64_t q0 = 0; q0 < T; q0 += kQTile) {
          const int64_t nq = std::min<int64_t>(kQTile, T - q0);
          for (int64_t i = 0; i < nq; ++i) {
            m[i] = -INFINITY;
            l[i] = 0.f;
          }
          std::fill(acc.begin(), acc.begin() + nq * HS, 0.f);
          const int64_t kend = causal ? q0 + nq : T;
          for (int64_t k0 = 0; k0 < kend; k0 += kKTile) {
            const int64_t nk = std::min<int64_t>(kKTile, kend - k0), nc = product_cols(nk);
            // s (nq x nc) = q (nq x HS) @ kT[:, k0:k0+nc] (HS x nc)
            tile::gemm_set(s.data(), kKTile, row(q, b, h, q0), q.st, kT.data() + k0, Tp, nq, nc,
                           HS);
            for (int64_t i = 0; i < nq; ++i) {
              float* srow = s.data() + i * kKTile;
              const int64_t jmax = visible(q0 + i, k0, nk, causal);
              if (jmax == 0) {
                std::fill(srow, srow + kKTile, 0.f);
                continue;
              }
              const float alpha = simd::online_softmax_row<kKTile>(srow, jmax, scale, m[i], l[i]);
              if (alpha != 1.f) {
                float* a = acc.data() + i * HS;
                for (int64_t d = 0; d < HS; ++d) a[d] *= alpha;
              }
            }
            // acc (nq x HS) += p (nq x nk) @ v (nk x HS)
            tile::gemm_acc(acc.data(), HS, s.data(), kKTile, row(v, b, kvh, k0), v.st, nq, HS, nk);
          }
          for (int64_t i = 0; i < nq; ++i) {
            float* o = row(out, b, h, q0 + i);
            const float inv = 1.f / l[i];
            const float* a = acc.data() + i * HS;
            for (int64_t d = 0; d < HS; ++d) o[d] = a[d] * inv;
            lse[(b * NH + h) * T + q0 + i] = m[i] + std::log(l[i]);
          }
        }
      }
    }
  });
}

void attention_backward(AttnGrad dq, AttnGrad dk, AttnGrad dv, AttnOperand dout, AttnOperand q,
                        AttnOperand k, AttnOperand v, AttnOperand out, const float* lse, int64_t B,
                        int64_t NH, int64_t NKV, int64_t T, int64_t HS, float scale, bool causal) {
  const int64_t group = NH / NKV, Tp = padded(T);
  parallel_for(B * NKV, 1, [&](int64_t w0, int64_t w1) {
    const size_t tile_sq = static_cast<size_t>(kQTile * kKTile);
    // Transposed copies (HS x Tp): K and V of the kv head, Q and dout of each query head.
    std::vector<float> kT(static_cast<size_t>(HS * Tp)), vT(kT.size());
    std::vector<float> qT(static_cast<size_t>(group * HS * Tp)), doT(qT.size());
    std::vector<float> p(tile_sq), ds(tile_sq);
    // dk and dv of one key block, accumulated transposed (HS x kKTile) over every query tile.
    std::vector<float> dkT(static_cast<size_t>(HS * kKTile)), dvT(dkT.size());
    std::vector<float> D(static_cast<size_t>(group * T));
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t kvh = w % NKV, b = w / NKV, h0 = kvh * group;
      load_transposed(kT.data(), Tp, k, b, kvh, 0, T, Tp, HS);
      load_transposed(vT.data(), Tp, v, b, kvh, 0, T, Tp, HS);
      for (int64_t g = 0; g < group; ++g) {
        load_transposed(qT.data() + g * HS * Tp, Tp, q, b, h0 + g, 0, T, Tp, HS);
        load_transposed(doT.data() + g * HS * Tp, Tp, dout, b, h0 + g, 0, T, Tp, HS);
        // D[t] = dout . out (the row term of the softmax backward); dq starts at zero.
        for (int64_t t = 0; t < T; ++t) {
          D[g * T + t] = vec::dot(row(out, b, h0 + g, t), row(dout, b, h0 + g, t), HS);
          std::fill(row(dq, b, h0 + g, t), row(dq, b, h0 + g, t) + HS, 0.f);
        }
      }
      for (int64_t k0 = 0; k0 < T; k0 += kKTile) {
        const int64_t nk = std::min<int64_t>(kKTile, T - k0);
        std::fill(dkT.begin(), dkT.end(), 0.f);
        std::fill(dvT.begin(), dvT.end(), 0.f);
        const int64_t qstart = causal ? (k0 / kQTile) * kQTile : 0;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t h = h0 + g;
          const float* lse_bh = lse + (b * NH + h) * T;
          const float* qTg = qT.data() + g * HS * Tp;
          const float* doTg = doT.data() + g * HS * Tp;
          for (int64_t q0 = qstart; q0 < T; q0 += kQTile) {
            const int64_t nq = std::min<int64_t>(kQTile, T - q0);
            // Keys of the block this query tile can see (all of them unless causal).
            const int64_t nv = causal ? std::min(nk, q0 + nq - k0) : nk, nc = product_cols(nv);
            // p = q kT (scores), ds = dout vT (dp), both (nq x nc).
            tile::gemm_set(p.data(), kKTile, row(q, b, h, q0), q.st, kT.data() + k0, Tp, nq, nc,
                           HS);
            tile::gemm_set(ds.data(), kKTile, row(dout, b, h, q0), dout.st, vT.data() + k0, Tp, nq,
                           nc, HS);
            // p = softmax probabilities, ds = p (dp - D) * scale (the score scale folded in).
            for (int64_t i = 0; i < nq; ++i) {
              simd::softmax_backward_row<kKTile>(p.data() + i * kKTile, ds.data() + i * kKTile,
                                                 visible(q0 + i, k0, nv, causal), scale,
                                                 lse_bh[q0 + i], D[g * T + q0 + i]);
            }
            // dvT (HS x nc) += doutT (HS x nq) @ p (nq x nc); dkT += qT @ ds;
            // dq (nq x HS) += ds (nq x nk) @ k (nk x HS)
            tile::gemm_acc(dvT.data(), kKTile, doTg + q0, Tp, p.data(), kKTile, HS, nc, nq);
            tile::gemm_acc(dkT.data(), kKTile, qTg + q0, Tp, ds.data(), kKTile, HS, nc, nq);
            tile::gemm_acc(row(dq, b, h, q0), dq.st, ds.data(), kKTile, row(k, b, kvh, k0), k.st,
                           nq, HS, nv);
          }
        }
        for (int64_t j = 0; j < nk; ++j) {
          float* dkr = row(dk, b, kvh, k0 + j);
          float* dvr = row(dv, b, kvh, k0 + j);
          for (int64_t d = 0; d < HS; ++d) {
            dkr[d] = dkT[d * kKTile + j];
            dvr[d] = dvT[d * kKTile + j];
          }
        }
      }
    }
  });
}

}  // namespace acc::kernels

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
// Every product inside a tile goes through tile::gemm_acc (register-blocked FMA micro-kernel).

#include <algorithm>
#include <cmath>
#include <vector>

#include "acc/tensor/kernels.hpp"
#include "acc/tensor/threading.hpp"
#include "tile_gemm.hpp"
#include "vec_math.hpp"

namespace acc::kernels {
namespace {

constexpr int64_t kTile = 64;  // query and key tile size

inline const float* row(const AttnOperand& a, int64_t b, int64_t h, int64_t t) {
  return a.ptr + b * a.sb + h * a.sh + t * a.st;
}
inline float* row(const AttnGrad& a, int64_t b, int64_t h, int64_t t) {
  return a.ptr + b * a.sb + h * a.sh + t * a.st;
}

// dst (HS x kTile) = rows [t0, t0 + n) of `a` transposed, zero-padded to kTile columns.
void load_transposed(float* dst, const AttnOperand& a, int64_t b, int64_t h, int64_t t0, int64_t n,
                     int64_t HS) {
  for (int64_t j = 0; j < n; ++j) {
    const float* r = row(a, b, h, t0 + j);
    for (int64_t d = 0; d < HS; ++d) dst[d * kTile + j] = r[d];
  }
  for (int64_t d = 0; d < HS; ++d) {
    for (int64_t j = n; j < kTile; ++j) dst[d * kTile + j] = 0.f;
  }
}

// dst (cols x rows, stride kTile) = src (rows x cols, stride kTile) transposed.
void transpose_tile(float* dst, const float* src, int64_t rows, int64_t cols) {
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) dst[j * kTile + i] = src[i * kTile + j];
  }
}

// Number of keys of tile [k0, k0 + nk) that query t may attend to.
inline int64_t visible(int64_t t, int64_t k0, int64_t nk, bool causal) {
  return causal ? std::clamp<int64_t>(t - k0 + 1, 0, nk) : nk;
}

}  // namespace

void attention_forward(AttnGrad out, float* lse, AttnOperand q, AttnOperand k, AttnOperand v,
                       int64_t B, int64_t NH, int64_t NKV, int64_t T, int64_t HS, float scale,
                       bool causal) {
  const int64_t group = NH / NKV;
  const int64_t ntiles = (T + kTile - 1) / kTile;
  parallel_for(B * NH * ntiles, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> kT(static_cast<size_t>(HS * kTile));
    std::vector<float> s(static_cast<size_t>(kTile * kTile));
    std::vector<float> acc(static_cast<size_t>(kTile * HS));
    float m[kTile], l[kTile];
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t qt = w % ntiles, h = (w / ntiles) % NH, b = w / (ntiles * NH);
      const int64_t kvh = h / group;
      const int64_t q0 = qt * kTile, nq = std::min(kTile, T - q0);
      for (int64_t i = 0; i < nq; ++i) {
        m[i] = -INFINITY;
        l[i] = 0.f;
      }
      std::fill(acc.begin(), acc.begin() + nq * HS, 0.f);
      const int64_t kend = causal ? q0 + nq : T;
      for (int64_t k0 = 0; k0 < kend; k0 += kTile) {
        const int64_t nk = std::min(kTile, kend - k0);
        load_transposed(kT.data(), k, b, kvh, k0, nk, HS);
        // s (nq x kTile) = q (nq x HS) @ kT (HS x kTile)
        std::fill(s.begin(), s.begin() + nq * kTile, 0.f);
        tile::gemm_acc(s.data(), kTile, row(q, b, h, q0), q.st, kT.data(), kTile, nq, kTile, HS);
        for (int64_t i = 0; i < nq; ++i) {
          float* srow = s.data() + i * kTile;
          const int64_t jmax = visible(q0 + i, k0, nk, causal);
          if (jmax == 0) {
            std::fill(srow, srow + nk, 0.f);
            continue;
          }
          for (int64_t j = 0; j < jmax; ++j) srow[j] *= scale;
          const float mx = std::max(m[i], vec::max(srow, jmax));
          const float alpha = vec::exp(m[i] - mx);
          for (int64_t j = 0; j < jmax; ++j) srow[j] = vec::exp(srow[j] - mx);
          for (int64_t j = jmax; j < nk; ++j) srow[j] = 0.f;
          l[i] = l[i] * alpha + vec::sum(srow, jmax);
          m[i] = mx;
          float* a = acc.data() + i * HS;
          for (int64_t d = 0; d < HS; ++d) a[d] *= alpha;
        }
        // acc (nq x HS) += p (nq x nk) @ v (nk x HS)
        tile::gemm_acc(acc.data(), HS, s.data(), kTile, row(v, b, kvh, k0), v.st, nq, HS, nk);
      }
      for (int64_t i = 0; i < nq; ++i) {
        float* o = row(out, b, h, q0 + i);
        const float inv = 1.f / l[i];
        const float* a = acc.data() + i * HS;
        for (int64_t d = 0; d < HS; ++d) o[d] = a[d] * inv;
        lse[(b * NH + h) * T + q0 + i] = m[i] + std::log(l[i]);
      }
    }
  });
}

void attention_backward(AttnGrad dq, AttnGrad dk, AttnGrad dv, AttnOperand dout, AttnOperand q,
                        AttnOperand k, AttnOperand v, AttnOperand out, const float* lse, int64_t B,
                        int64_t NH, int64_t NKV, int64_t T, int64_t HS, float scale, bool causal) {
  const int64_t group = NH / NKV;
  parallel_for(B * NKV, 1, [&](int64_t w0, int64_t w1) {
    const size_t tile_sq = static_cast<size_t>(kTile * kTile);
    std::vector<float> kT(static_cast<size_t>(HS * kTile)), vT(kT.size());
    std::vector<float> p(tile_sq), ds(tile_sq), pT(tile_sq), dsT(tile_sq);
    std::vector<float> dk_acc(static_cast<size_t>(kTile * HS)), dv_acc(dk_acc.size());
    std::vector<float> D(static_cast<size_t>(group * T));
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t kvh = w % NKV, b = w / NKV, h0 = kvh * group;
      // D[h][t] = dout . out (the row term of the softmax backward); dq starts at zero.
      for (int64_t g = 0; g < group; ++g) {
        for (int64_t t = 0; t < T; ++t) {
          D[g * T + t] = vec::dot(row(out, b, h0 + g, t), row(dout, b, h0 + g, t), HS);
          std::fill(row(dq, b, h0 + g, t), row(dq, b, h0 + g, t) + HS, 0.f);
        }
      }
      for (int64_t k0 = 0; k0 < T; k0 += kTile) {
        const int64_t nk = std::min(kTile, T - k0);
        load_transposed(kT.data(), k, b, kvh, k0, nk, HS);
        load_transposed(vT.data(), v, b, kvh, k0, nk, HS);
        std::fill(dk_acc.begin(), dk_acc.end(), 0.f);
        std::fill(dv_acc.begin(), dv_acc.end(), 0.f);
        const int64_t qstart = causal ? (k0 / kTile) * kTile : 0;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t h = h0 + g;
          const float* lse_bh = lse + (b * NH + h) * T;
          for (int64_t q0 = qstart; q0 < T; q0 += kTile) {
            const int64_t nq = std::min(kTile, T - q0);
            const float* qi = row(q, b, h, q0);
            const float* doi = row(dout, b, h, q0);
            // p = q kT (scores), ds = dout vT (dp), both (nq x kTile).
            std::fill(p.begin(), p.begin() + nq * kTile, 0.f);
            std::fill(ds.begin(), ds.begin() + nq * kTile, 0.f);
            tile::gemm_acc(p.data(), kTile, qi, q.st, kT.data(), kTile, nq, kTile, HS);
            tile::gemm_acc(ds.data(), kTile, doi, dout.st, vT.data(), kTile, nq, kTile, HS);
            for (int64_t i = 0; i < nq; ++i) {
              float* prow = p.data() + i * kTile;
              float* dsrow = ds.data() + i * kTile;
              const int64_t jmax = visible(q0 + i, k0, nk, causal);
              const float l = lse_bh[q0 + i], Di = D[g * T + q0 + i];
              for (int64_t j = 0; j < kTile; ++j) {
                const float pij = j < jmax ? vec::exp(prow[j] * scale - l) : 0.f;
                prow[j] = pij;
                dsrow[j] = pij * (dsrow[j] - Di) * scale;  // dS with the score scale folded in
              }
            }
            transpose_tile(pT.data(), p.data(), nq, nk);
            transpose_tile(dsT.data(), ds.data(), nq, nk);
            // dv (nk x HS) += pT (nk x nq) @ dout (nq x HS); dk += dsT @ q; dq (nq x HS) += ds @ k
            tile::gemm_acc(dv_acc.data(), HS, pT.data(), kTile, doi, dout.st, nk, HS, nq);
            tile::gemm_acc(dk_acc.data(), HS, dsT.data(), kTile, qi, q.st, nk, HS, nq);
            tile::gemm_acc(row(dq, b, h, q0), dq.st, ds.data(), kTile, row(k, b, kvh, k0), k.st, nq,
                           HS, nk);
          }
        }
        for (int64_t j = 0; j < nk; ++j) {
          std::copy(dk_acc.begin() + j * HS, dk_acc.begin() + (j + 1) * HS,
                    row(dk, b, kvh, k0 + j));
          std::copy(dv_acc.begin() + j * HS, dv_acc.begin() + (j + 1) * HS,
                    row(dv, b, kvh, k0 + j));
        }
      }
    }
  });
}

}  // namespace acc::kernels

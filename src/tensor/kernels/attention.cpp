// Fused causal attention, flash-attention style, for the CPU.
//
// Forward: for each (batch, head, query tile) the key tiles are visited once; scores for a tile
// are computed into a small buffer, folded into a running max / running sum (online softmax) and
// the output accumulator is rescaled. Only the output and the log-sum-exp per row are stored.
// Backward: for each (batch, kv head) the probabilities are recomputed tile by tile from q, k and
// the saved log-sum-exp; dk/dv for that kv head are owned by one task, so there are no races and
// the result does not depend on the thread count.

#include <algorithm>
#include <cmath>
#include <vector>

#include "acc/tensor/kernels.hpp"
#include "acc/tensor/threading.hpp"

namespace acc::kernels {
namespace {

constexpr int64_t kTileQ = 64;
constexpr int64_t kTileK = 64;

inline const float* row(const AttnOperand& a, int64_t b, int64_t h, int64_t t) {
  return a.ptr + b * a.sb + h * a.sh + t * a.st;
}
inline float* row(const AttnGrad& a, int64_t b, int64_t h, int64_t t) {
  return a.ptr + b * a.sb + h * a.sh + t * a.st;
}

// s[i][j] = scale * q_i . k_j for a (nq x nk) tile, via kT (HS x kTileK) so the inner loop runs
// over j with unit stride.
inline void tile_scores(float* s, const float* const* qrows, int64_t nq, const float* kT,
                        int64_t nk, int64_t HS, float scale) {
  for (int64_t i = 0; i < nq; ++i) {
    float* srow = s + i * kTileK;
    for (int64_t j = 0; j < nk; ++j) srow[j] = 0.f;
    const float* q = qrows[i];
    for (int64_t d = 0; d < HS; ++d) {
      const float qd = q[d] * scale;
      const float* kd = kT + d * kTileK;
      for (int64_t j = 0; j < nk; ++j) srow[j] += qd * kd[j];
    }
  }
}

inline void load_transposed(float* dst, const AttnOperand& a, int64_t b, int64_t h, int64_t t0,
                            int64_t n, int64_t HS) {
  for (int64_t j = 0; j < n; ++j) {
    const float* r = row(a, b, h, t0 + j);
    for (int64_t d = 0; d < HS; ++d) dst[d * kTileK + j] = r[d];
  }
}

}  // namespace

void attention_forward(AttnGrad out, float* lse, AttnOperand q, AttnOperand k, AttnOperand v,
                       int64_t B, int64_t NH, int64_t NKV, int64_t T, int64_t HS, float scale,
                       bool causal) {
  const int64_t group = NH / NKV;
  const int64_t ntiles = (T + kTileQ - 1) / kTileQ;
  parallel_for(B * NH * ntiles, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> kT(static_cast<size_t>(HS * kTileK));
    std::vector<float> s(static_cast<size_t>(kTileQ * kTileK));
    std::vector<float> acc(static_cast<size_t>(kTileQ * HS));
    float m[kTileQ], l[kTileQ];
    const float* qrows[kTileQ];
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t qt = w % ntiles, h = (w / ntiles) % NH, b = w / (ntiles * NH);
      const int64_t kvh = h / group;
      const int64_t q0 = qt * kTileQ, nq = std::min(kTileQ, T - q0);
      for (int64_t i = 0; i < nq; ++i) {
        m[i] = -INFINITY;
        l[i] = 0.f;
        qrows[i] = row(q, b, h, q0 + i);
      }
      std::fill(acc.begin(), acc.begin() + nq * HS, 0.f);
      const int64_t kend = causal ? q0 + nq : T;
      for (int64_t k0 = 0; k0 < kend; k0 += kTileK) {
        const int64_t nk = std::min(kTileK, kend - k0);
        load_transposed(kT.data(), k, b, kvh, k0, nk, HS);
        tile_scores(s.data(), qrows, nq, kT.data(), nk, HS, scale);
        for (int64_t i = 0; i < nq; ++i) {
          float* srow = s.data() + i * kTileK;
          // Causal: query q0+i sees keys up to and including its own position.
          const int64_t jmax = causal ? std::min(nk, q0 + i - k0 + 1) : nk;
          if (jmax <= 0) continue;
          float mx = m[i];
          for (int64_t j = 0; j < jmax; ++j) mx = std::max(mx, srow[j]);
          const float alpha = std::exp(m[i] - mx);
          float sum = 0.f;
          for (int64_t j = 0; j < jmax; ++j) {
            srow[j] = std::exp(srow[j] - mx);
            sum += srow[j];
          }
          l[i] = l[i] * alpha + sum;
          m[i] = mx;
          float* a = acc.data() + i * HS;
          for (int64_t d = 0; d < HS; ++d) a[d] *= alpha;
          for (int64_t j = 0; j < jmax; ++j) {
            const float p = srow[j];
            const float* vr = row(v, b, kvh, k0 + j);
            for (int64_t d = 0; d < HS; ++d) a[d] += p * vr[d];
          }
        }
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
    std::vector<float> kT(static_cast<size_t>(HS * kTileK));
    std::vector<float> vT(static_cast<size_t>(HS * kTileK));
    std::vector<float> p(static_cast<size_t>(kTileQ * kTileK));
    std::vector<float> dp(static_cast<size_t>(kTileQ * kTileK));
    std::vector<float> dqacc(static_cast<size_t>(kTileQ * HS));
    std::vector<float> D(static_cast<size_t>(T));
    const float* qrows[kTileQ];
    const float* dorows[kTileQ];
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t kvh = w % NKV, b = w / NKV;
      for (int64_t t = 0; t < T; ++t) {
        float* dkr = row(dk, b, kvh, t);
        float* dvr = row(dv, b, kvh, t);
        for (int64_t d = 0; d < HS; ++d) dkr[d] = dvr[d] = 0.f;
      }
      for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
        for (int64_t t = 0; t < T; ++t) {
          const float* o = row(out, b, h, t);
          const float* g = row(dout, b, h, t);
          float s = 0.f;
          for (int64_t d = 0; d < HS; ++d) s += o[d] * g[d];
          D[t] = s;
        }
        const float* lse_bh = lse + (b * NH + h) * T;
        for (int64_t q0 = 0; q0 < T; q0 += kTileQ) {
          const int64_t nq = std::min(kTileQ, T - q0);
          for (int64_t i = 0; i < nq; ++i) {
            qrows[i] = row(q, b, h, q0 + i);
            dorows[i] = row(dout, b, h, q0 + i);
          }
          std::fill(dqacc.begin(), dqacc.begin() + nq * HS, 0.f);
          const int64_t kend = causal ? q0 + nq : T;
          for (int64_t k0 = 0; k0 < kend; k0 += kTileK) {
            const int64_t nk = std::min(kTileK, kend - k0);
            load_transposed(kT.data(), k, b, kvh, k0, nk, HS);
            load_transposed(vT.data(), v, b, kvh, k0, nk, HS);
            tile_scores(p.data(), qrows, nq, kT.data(), nk, HS, scale);
            tile_scores(dp.data(), dorows, nq, vT.data(), nk, HS, 1.f);
            for (int64_t i = 0; i < nq; ++i) {
              float* prow = p.data() + i * kTileK;
              float* dprow = dp.data() + i * kTileK;
              const int64_t jmax = causal ? std::min(nk, q0 + i - k0 + 1) : nk;
              const float l = lse_bh[q0 + i], Di = D[q0 + i];
              for (int64_t j = 0; j < nk; ++j) {
                const float pij = j < jmax ? std::exp(prow[j] - l) : 0.f;
                prow[j] = pij;
                dprow[j] = pij * (dprow[j] - Di) * scale;  // dS, with the score scale folded in
              }
              // dv_j += p_ij dout_i ; dk_j += dS_ij q_i ; dq_i += dS_ij k_j
              float* dqi = dqacc.data() + i * HS;
              const float* qi = qrows[i];
              const float* doi = dorows[i];
              for (int64_t j = 0; j < jmax; ++j) {
                const float pij = prow[j], dsij = dprow[j];
                float* dvj = row(dv, b, kvh, k0 + j);
                float* dkj = row(dk, b, kvh, k0 + j);
                const float* kj = row(k, b, kvh, k0 + j);
                for (int64_t d = 0; d < HS; ++d) {
                  dvj[d] += pij * doi[d];
                  dkj[d] += dsij * qi[d];
                  dqi[d] += dsij * kj[d];
                }
              }
            }
          }
          for (int64_t i = 0; i < nq; ++i) {
            float* dqr = row(dq, b, h, q0 + i);
            const float* a = dqacc.data() + i * HS;
            for (int64_t d = 0; d < HS; ++d) dqr[d] = a[d];
          }
        }
      }
    }
  });
}

}  // namespace acc::kernels

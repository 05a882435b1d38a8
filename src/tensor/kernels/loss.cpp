#include <cmath>
#include <cstdint>

#include "acc/tensor/kernels.hpp"
#include "acc/tensor/threading.hpp"
#include "simd.hpp"
#include "vec_math.hpp"

namespace acc::kernels {

template <class Index>
void embedding_forward(float* out, const Index* idx, const float* w, int64_t N, int64_t C) {
  parallel_for(N, std::max<int64_t>(1, 8192 / std::max<int64_t>(C, 1)), [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      const float* src = w + static_cast<int64_t>(idx[n]) * C;
      float* dst = out + n * C;
      for (int64_t i = 0; i < C; ++i) dst[i] = src[i];
    }
  });
}

template <class Index>
void embedding_backward(float* dw, const Index* idx, const float* dout, int64_t N, int64_t C,
                        int64_t V) {
  // Partition the vocabulary rows among threads: each thread scans all tokens and adds only the
  // rows it owns, so there are no races and the summation order is fixed.
  const int64_t threads = get_num_threads();
  if (threads <= 1 || N * C < (1 << 16)) {
    for (int64_t n = 0; n < N; ++n) {
      float* dst = dw + static_cast<int64_t>(idx[n]) * C;
      const float* src = dout + n * C;
      for (int64_t i = 0; i < C; ++i) dst[i] += src[i];
    }
    return;
  }
  parallel_for(threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t lo = V * t / threads, hi = V * (t + 1) / threads;
      for (int64_t n = 0; n < N; ++n) {
        const int64_t row = static_cast<int64_t>(idx[n]);
        if (row < lo || row >= hi) continue;
        float* dst = dw + row * C;
        const float* src = dout + n * C;
        for (int64_t i = 0; i < C; ++i) dst[i] += src[i];
      }
    }
  });
}

template <class Index>
void cross_entropy_forward(float* losses, float* lse, const float* logits, const Index* targets,
                           int64_t N, int64_t V, int64_t ignore_index) {
  parallel_for(N, std::max<int64_t>(1, 16384 / std::max<int64_t>(V, 1)), [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      const float* x = logits + n * V;
      const float mx = vec::max(x, V);
      const float l = mx + std::log(vec::sum_exp(x, mx, V, n + 1 < e ? x + V : nullptr));
      lse[n] = l;
      const int64_t t = static_cast<int64_t>(targets[n]);
      losses[n] = t == ignore_index ? 0.f : l - x[t];
    }
  });
}

template <class Index>
void cross_entropy_backward(float* dlogits, const float* logits, const float* lse,
                            const Index* targets, const float* dloss, int64_t N, int64_t V,
                            int64_t ignore_index) {
  parallel_for(N, std::max<int64_t>(1, 16384 / std::max<int64_t>(V, 1)), [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      const float* x = logits + n * V;
      float* d = dlogits + n * V;
      const int64_t t = static_cast<int64_t>(targets[n]);
      if (t == ignore_index) {
        for (int64_t i = 0; i < V; ++i) d[i] = 0.f;
        continue;
      }
      const float g = dloss[n], l = lse[n];
      // Fetch the next row while this one is computed (as in the forward's sum_exp).
      const float* next = n + 1 < e ? x + V : nullptr;
      int64_t i = 0;
      // The gradient (N x V, the largest tensor of a language model's step: 64 MiB for the 17M
      // GPT) is written once here and read next by the LM head's backward GEMMs, and it does not
      // stay in the caches in between: from the first vector-aligned element on, streaming stores
      // write it without first reading every line of it from memory. The target's -g is folded
      // into its vector before the store.
      for (; i < V && reinterpret_cast<uintptr_t>(d + i) % simd::kStreamAlign != 0; ++i) {
        d[i] = vec::exp(x[i] - l) * g;
      }
      alignas(64) float buf[simd::kWidth];
      const int64_t i0 = i;  // first streamed element
      for (; i + simd::kWidth <= V; i += simd::kWidth) {
        if (next != nullptr && (i - i0) % 16 == 0) __builtin_prefetch(next + i, 0, 3);
        for (int64_t j = 0; j < simd::kWidth; ++j) buf[j] = vec::exp(x[i + j] - l) * g;
        if (t >= i && t < i + simd::kWidth) buf[t - i] -= g;
        simd::stream(d + i, simd::load(buf));
      }
      const int64_t i1 = i;  // end of the streamed elements
      for (; i < V; ++i) d[i] = vec::exp(x[i] - l) * g;
      // The target's element, unless it went out with a streaming store.
      if (t < i0 || t >= i1) d[t] -= g;
    }
    simd::stream_fence();
  });
}

void vocab_ce_max(float* mx, const float* logits, int64_t N, int64_t Vl, int64_t valid) {
  parallel_for(N, std::max<int64_t>(1, 16384 / std::max<int64_t>(Vl, 1)),
               [&](int64_t b, int64_t e) {
                 for (int64_t n = b; n < e; ++n) {
                   mx[n] = valid > 0 ? vec::max(logits + n * Vl, valid) : -3.0e38f;
                 }
               });
}

void vocab_ce_sums(float* sums, const float* logits, const float* mx, const int64_t* tl, int64_t N,
                   int64_t Vl, int64_t valid) {
  parallel_for(
      N, std::max<int64_t>(1, 16384 / std::max<int64_t>(Vl, 1)), [&](int64_t b, int64_t e) {
        for (int64_t n = b; n < e; ++n) {
          const float* x = logits + n * Vl;
          sums[n] = valid > 0 ? vec::sum_exp(x, mx[n], valid, n + 1 < e ? x + Vl : nullptr) : 0.f;
          sums[N + n] = tl[n] >= 0 ? x[tl[n]] - mx[n] : 0.f;
        }
      });
}

void vocab_ce_backward(float* dlogits, const float* logits, const float* lse, const int64_t* tl,
                       const float* dloss, int64_t N, int64_t Vl, int64_t valid) {
  parallel_for(N, std::max<int64_t>(1, 16384 / std::max<int64_t>(Vl, 1)),
               [&](int64_t b, int64_t e) {
                 for (int64_t n = b; n < e; ++n) {
                   const float* x = logits + n * Vl;
                   float* d = dlogits + n * Vl;
                   const float g = dloss[n], l = lse[n];
                   if (g == 0.f) {  // an ignored row
                     for (int64_t i = 0; i < Vl; ++i) d[i] = 0.f;
                     continue;
                   }
                   for (int64_t i = 0; i < valid; ++i) d[i] = vec::exp(x[i] - l) * g;
                   for (int64_t i = valid; i < Vl; ++i)
                     d[i] = 0.f;  // padding: in no loss, no gradient
                   if (tl[n] >= 0) d[tl[n]] -= g;
                 }
               });
}

void rope_forward(float* out, const float* x, const float* cos, const float* sin, int64_t R,
                  int64_t T, int64_t HS, bool inverse) {
  const int64_t half = HS / 2;
  const float sgn = inverse ? -1.f : 1.f;
  // The backward is the transpose of the forward: x[i] reaches out[i -/+ half] through the sin
  // of that partner position, so the inverse reads sin there (the same value when the two halves
  // of the table are equal, as rope_cache makes them, but not for arbitrary tables).
  const int64_t so = inverse ? half : 0;
  parallel_for(R * T, std::max<int64_t>(1, 4096 / std::max<int64_t>(HS, 1)),
               [&](int64_t b, int64_t e) {
                 for (int64_t rt = b; rt < e; ++rt) {
                   const int64_t t = rt % T;
                   const float* xr = x + rt * HS;
                   const float* c = cos + t * HS;
                   const float* s = sin + t * HS;
                   float* o = out + rt * HS;
                   // rotate_half(x)[i] = -x[i + half] for i < half, x[i - half] otherwise.
                   for (int64_t i = 0; i < half; ++i)
                     o[i] = xr[i] * c[i] - sgn * xr[i + half] * s[i + so];
                   for (int64_t i = half; i < HS; ++i)
                     o[i] = xr[i] * c[i] + sgn * xr[i - half] * s[i - so];
                 }
               });
}

#define ACC_INSTANTIATE(Index)                                                                    \
  template void embedding_forward<Index>(float*, const Index*, const float*, int64_t, int64_t);   \
  template void embedding_backward<Index>(float*, const Index*, const float*, int64_t, int64_t,   \
                                          int64_t);                                               \
  template void cross_entropy_forward<Index>(float*, float*, const float*, const Index*, int64_t, \
                                             int64_t, int64_t);                                   \
  template void cross_entropy_backward<Index>(float*, const float*, const float*, const Index*,   \
                                              const float*, int64_t, int64_t, int64_t);
ACC_INSTANTIATE(int32_t)
ACC_INSTANTIATE(int64_t)
#undef ACC_INSTANTIATE

}  // namespace acc::kernels

#pragma once
// Explicit SIMD for the few hot loops the compiler does not vectorise well on its own (the row
// softmax inside fused attention): AVX-512 where the build targets it, AVX2+FMA otherwise, and a
// scalar fallback. Semantics match vec_math.hpp (same exp polynomial), so fused and unfused paths
// agree to rounding.

#include <cmath>
#include <cstdint>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "vec_math.hpp"

namespace acc::kernels::simd {

#if defined(__AVX512F__)
using vreg = __m512;
constexpr int kWidth = 16;
inline vreg load(const float* p) {
  return _mm512_loadu_ps(p);
}
inline void store(float* p, vreg v) {
  _mm512_storeu_ps(p, v);
}
inline vreg set1(float x) {
  return _mm512_set1_ps(x);
}
inline vreg fma(vreg a, vreg b, vreg c) {
  return _mm512_fmadd_ps(a, b, c);
}
inline vreg add(vreg a, vreg b) {
  return _mm512_add_ps(a, b);
}
inline vreg sub(vreg a, vreg b) {
  return _mm512_sub_ps(a, b);
}
inline vreg mul(vreg a, vreg b) {
  return _mm512_mul_ps(a, b);
}
// max/min as compare + blend: GCC 12's _mm512_max_ps/_mm512_min_ps expand through
// _mm512_undefined_ps and trip -Wmaybe-uninitialized when inlined.
inline vreg max(vreg a, vreg b) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(b, a, _CMP_GT_OQ), a, b);
}
inline vreg min(vreg a, vreg b) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(b, a, _CMP_LT_OQ), a, b);
}
// Horizontal reductions through memory (GCC 12's _mm512_reduce_* trip -Wmaybe-uninitialized).
inline float hmax(vreg a) {
  alignas(64) float t[16];
  _mm512_store_ps(t, a);
  float m = t[0];
  for (int i = 1; i < 16; ++i) m = m > t[i] ? m : t[i];
  return m;
}
inline float hsum(vreg a) {
  alignas(64) float t[16];
  _mm512_store_ps(t, a);
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += t[i];
  return s;
}
inline vreg exp(vreg x) {
  const vreg xc = min(max(x, set1(-87.33654f)), set1(88.72283f));
  const vreg t = fma(xc, set1(1.44269504088896341f), set1(12582912.0f));
  const vreg n = sub(t, set1(12582912.0f));
  // Integer part with GCC vector arithmetic (_mm512_slli_epi32 trips -Wmaybe-uninitialized).
  typedef int32_t v16si __attribute__((vector_size(64)));
  const v16si ni = (v16si)t - 0x4B400000;
  vreg r = _mm512_fnmadd_ps(n, set1(0.693359375f), xc);
  r = _mm512_fnmadd_ps(n, set1(-2.12194440e-4f), r);
  vreg p = set1(1.9875691500E-4f);
  p = fma(p, r, set1(1.3981999507E-3f));
  p = fma(p, r, set1(8.3334519073E-3f));
  p = fma(p, r, set1(4.1665795894E-2f));
  p = fma(p, r, set1(1.6666665459E-1f));
  p = fma(p, r, set1(5.0000001201E-1f));
  p = add(fma(mul(p, r), r, r), set1(1.0f));
  const v16si bits = (ni + 127) << 23;
  const vreg scale = (vreg)bits;
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, set1(-87.33654f), _CMP_LT_OQ);
  return _mm512_mask_blend_ps(underflow, mul(p, scale), _mm512_setzero_ps());
}
#elif defined(__AVX2__) && defined(__FMA__)
using vreg = __m256;
constexpr int kWidth = 8;
inline vreg load(const float* p) {
  return _mm256_loadu_ps(p);
}
inline void store(float* p, vreg v) {
  _mm256_storeu_ps(p, v);
}
inline vreg set1(float x) {
  return _mm256_set1_ps(x);
}
inline vreg fma(vreg a, vreg b, vreg c) {
  return _mm256_fmadd_ps(a, b, c);
}
inline vreg add(vreg a, vreg b) {
  return _mm256_add_ps(a, b);
}
inline vreg sub(vreg a, vreg b) {
  return _mm256_sub_ps(a, b);
}
inline vreg mul(vreg a, vreg b) {
  return _mm256_mul_ps(a, b);
}
inline vreg max(vreg a, vreg b) {
  return _mm256_max_ps(a, b);
}
inline vreg min(vreg a, vreg b) {
  return _mm256_min_ps(a, b);
}
inline float hmax(vreg a) {
  float t[8];
  _mm256_storeu_ps(t, a);
  float m = t[0];
  for (int i = 1; i < 8; ++i) m = m > t[i] ? m : t[i];
  return m;
}
inline float hsum(vreg a) {
  float t[8];
  _mm256_storeu_ps(t, a);
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += t[i];
  return s;
}
inline vreg exp(vreg x) {
  const vreg xc = min(max(x, set1(-87.33654f)), set1(88.72283f));
  const vreg t = fma(xc, set1(1.44269504088896341f), set1(12582912.0f));
  const vreg n = sub(t, set1(12582912.0f));
  const __m256i ni = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_set1_epi32(0x4B400000));
  vreg r = _mm256_fnmadd_ps(n, set1(0.693359375f), xc);
  r = _mm256_fnmadd_ps(n, set1(-2.12194440e-4f), r);
  vreg p = set1(1.9875691500E-4f);
  p = fma(p, r, set1(1.3981999507E-3f));
  p = fma(p, r, set1(8.3334519073E-3f));
  p = fma(p, r, set1(4.1665795894E-2f));
  p = fma(p, r, set1(1.6666665459E-1f));
  p = fma(p, r, set1(5.0000001201E-1f));
  p = add(fma(mul(p, r), r, r), set1(1.0f));
  const vreg scale =
      _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(ni, _mm256_set1_epi32(127)), 23));
  const vreg underflow = _mm256_cmp_ps(x, set1(-87.33654f), _CMP_LT_OQ);
  return _mm256_andnot_ps(underflow, mul(p, scale));
}
#else
#define ACC_SIMD_SCALAR 1
using vreg = float;
constexpr int kWidth = 1;
inline vreg load(const float* p) {
  return *p;
}
inline void store(float* p, vreg v) {
  *p = v;
}
inline vreg set1(float x) {
  return x;
}
inline vreg fma(vreg a, vreg b, vreg c) {
  return a * b + c;
}
inline vreg add(vreg a, vreg b) {
  return a + b;
}
inline vreg sub(vreg a, vreg b) {
  return a - b;
}
inline vreg mul(vreg a, vreg b) {
  return a * b;
}
inline vreg max(vreg a, vreg b) {
  return a > b ? a : b;
}
inline vreg min(vreg a, vreg b) {
  return a < b ? a : b;
}
inline float hmax(vreg a) {
  return a;
}
inline float hsum(vreg a) {
  return a;
}
inline vreg exp(vreg x) {
  return vec::exp(x);
}
#endif

/// Online-softmax step for one score row of N (a multiple of kWidth) entries, the first `valid`
/// of which are real (the rest are hidden keys): s <- exp(scale * s - m_new) (0 for hidden keys),
/// m and l updated; returns alpha = exp(m_old - m_new), the factor for the output accumulator.
template <int N>
inline float online_softmax_row(float* s, int64_t valid, float scale, float& m, float& l) {
  static_assert(N % kWidth == 0);
  constexpr int V = N / kWidth;
  for (int64_t j = valid; j < N; ++j) s[j] = -INFINITY;
  vreg x[V];
  vreg mx = set1(m);
  for (int v = 0; v < V; ++v) {
    x[v] = mul(load(s + v * kWidth), set1(scale));
    mx = max(mx, x[v]);
  }
  const float m_new = hmax(mx);
  vreg sum = set1(0.f);
  for (int v = 0; v < V; ++v) {
    const vreg p = exp(sub(x[v], set1(m_new)));
    store(s + v * kWidth, p);
    sum = add(sum, p);
  }
  const float alpha = vec::exp(m - m_new);
  l = l * alpha + hsum(sum);
  m = m_new;
  return alpha;
}

/// Backward probabilities and score gradients for one row of N entries, `valid` of them real:
/// p = exp(scale * s - lse), ds = p * (dp - D) * scale (0 for hidden keys).
template <int N>
inline void softmax_backward_row(float* s, float* dp, int64_t valid, float scale, float lse,
                                 float D) {
  static_assert(N % kWidth == 0);
  for (int64_t j = valid; j < N; ++j) s[j] = -INFINITY;
  const vreg vscale = set1(scale), vlse = set1(lse), vD = set1(D);
  for (int v = 0; v < N / kWidth; ++v) {
    const vreg p = exp(sub(mul(load(s + v * kWidth), vscale), vlse));
    store(s + v * kWidth, p);
    store(dp + v * kWidth, mul(mul(p, sub(load(dp + v * kWidth), vD)), vscale));
  }
}

}  // namespace acc::kernels::simd

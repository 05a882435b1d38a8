#pragma once
// Explicit SIMD for the few hot loops the compiler does not vectorise well on its own (the
// softmax inside fused attention, the tile micro-kernel of tile_gemm.hpp): AVX-512 where the
// build targets it, AVX2+FMA otherwise, and a scalar fallback. Semantics match vec_math.hpp (same
// exp polynomial), so fused and unfused paths agree to rounding.

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
// Non-temporal store (bypasses the caches; p aligned to kStreamAlign bytes).
constexpr int kStreamAlign = 64;
inline void stream(float* p, vreg v) {
  _mm512_stream_ps(p, v);
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
// Lane indices 0, 1, ..., kWidth - 1.
inline vreg iota() {
  return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
// a < b ? x : y, lane by lane.
inline vreg select_lt(vreg a, vreg b, vreg x, vreg y) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), y, x);
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
constexpr int kStreamAlign = 32;
inline void stream(float* p, vreg v) {
  _mm256_stream_ps(p, v);
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
inline vreg iota() {
  return _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
}
inline vreg select_lt(vreg a, vreg b, vreg x, vreg y) {
  return _mm256_blendv_ps(y, x, _mm256_cmp_ps(a, b, _CMP_LT_OQ));
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
constexpr int kStreamAlign = alignof(float);
inline void stream(float* p, vreg v) {
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
inline vreg iota() {
  return 0.f;
}
inline vreg select_lt(vreg a, vreg b, vreg x, vreg y) {
  return a < b ? x : y;
}
inline vreg exp(vreg x) {
  return vec::exp(x);
}
#endif

// Orders streaming stores before the ordinary ones that follow (they are weakly ordered): call
// it before the streamed data is read, or handed to another thread.
inline void stream_fence() {
#if defined(__SSE__)
  _mm_sfence();
#endif
}

}  // namespace acc::kernels::simd

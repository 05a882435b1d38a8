#pragma once
// A register-blocked micro-kernel for the small matrix products inside fused kernels (attention
// tiles of 64 x 64 x HS). OpenBLAS is faster on large products but is a poor fit here: its calls
// may spawn threads inside our TBB tasks, and packing dominates at this size. Per step of k the
// kernel loads one row of B into registers and broadcasts R elements of A, keeping an R x (V*W)
// block of C in registers (AVX-512: 6 x 64, AVX2: 3 x 32), so it runs close to the FMA peak.

#include <cstdint>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace acc::kernels::tile {

#if defined(__AVX512F__)
using vreg = __m512;
constexpr int kWidth = 16;
inline vreg vload(const float* p) {
  return _mm512_loadu_ps(p);
}
inline void vstore(float* p, vreg v) {
  _mm512_storeu_ps(p, v);
}
inline vreg vset1(float x) {
  return _mm512_set1_ps(x);
}
inline vreg vfma(vreg a, vreg b, vreg c) {
  return _mm512_fmadd_ps(a, b, c);
}
constexpr int kRows = 6;  // 6 x 4 accumulators + 4 B registers of the 32
#elif defined(__AVX2__) && defined(__FMA__)
using vreg = __m256;
constexpr int kWidth = 8;
inline vreg vload(const float* p) {
  return _mm256_loadu_ps(p);
}
inline void vstore(float* p, vreg v) {
  _mm256_storeu_ps(p, v);
}
inline vreg vset1(float x) {
  return _mm256_set1_ps(x);
}
inline vreg vfma(vreg a, vreg b, vreg c) {
  return _mm256_fmadd_ps(a, b, c);
}
constexpr int kRows = 3;  // 3 x 4 accumulators + 4 B registers of the 16
#else
#define ACC_TILE_SCALAR 1
constexpr int kWidth = 1;
constexpr int kRows = 1;
#endif

#ifndef ACC_TILE_SCALAR
// C[R rows][V*W cols] (+)= A[R rows][K] * B[K][V*W cols]
template <int R, int V, bool Acc>
inline void block(float* C, int64_t ldc, const float* A, int64_t lda, const float* B, int64_t ldb,
                  int64_t K) {
  vreg acc[R][V];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) acc[r][v] = Acc ? vload(C + r * ldc + v * kWidth) : vset1(0.f);
  }
  for (int64_t k = 0; k < K; ++k) {
    vreg b[V];
    for (int v = 0; v < V; ++v) b[v] = vload(B + k * ldb + v * kWidth);
    for (int r = 0; r < R; ++r) {
      const vreg a = vset1(A[r * lda + k]);
      for (int v = 0; v < V; ++v) acc[r][v] = vfma(a, b[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) vstore(C + r * ldc + v * kWidth, acc[r][v]);
  }
}

template <int V, bool Acc>
inline void column_panel(float* C, int64_t ldc, const float* A, int64_t lda, const float* B,
                         int64_t ldb, int64_t M, int64_t K) {
  int64_t i = 0;
  for (; i + kRows <= M; i += kRows) {
    block<kRows, V, Acc>(C + i * ldc, ldc, A + i * lda, lda, B, ldb, K);
  }
  // Remainder rows in the largest blocks that fit, so B is not reloaded once per row.
  if (kRows > 4 && i + 4 <= M) {
    block<4, V, Acc>(C + i * ldc, ldc, A + i * lda, lda, B, ldb, K);
    i += 4;
  }
  if (kRows > 2 && i + 2 <= M) {
    block<2, V, Acc>(C + i * ldc, ldc, A + i * lda, lda, B, ldb, K);
    i += 2;
  }
  for (; i < M; ++i) block<1, V, Acc>(C + i * ldc, ldc, A + i * lda, lda, B, ldb, K);
}
#endif

/// C (M x N, row stride ldc) (+)= A (M x K, row stride lda) @ B (K x N, row stride ldb); all
/// row-major with unit column stride. Without Acc, C is overwritten (it need not be initialised).
template <bool Acc>
inline void gemm(float* C, int64_t ldc, const float* A, int64_t lda, const float* B, int64_t ldb,
                 int64_t M, int64_t N, int64_t K) {
  int64_t j = 0;
#ifndef ACC_TILE_SCALAR
  for (; j + 4 * kWidth <= N; j += 4 * kWidth) {
    column_panel<4, Acc>(C + j, ldc, A, lda, B + j, ldb, M, K);
  }
  for (; j + kWidth <= N; j += kWidth) column_panel<1, Acc>(C + j, ldc, A, lda, B + j, ldb, M, K);
#endif
  if (j < N) {
    for (int64_t i = 0; i < M; ++i) {
      if (!Acc) {
        for (int64_t jj = j; jj < N; ++jj) C[i * ldc + jj] = 0.f;
      }
      for (int64_t k = 0; k < K; ++k) {
        const float a = A[i * lda + k];
        for (int64_t jj = j; jj < N; ++jj) C[i * ldc + jj] += a * B[k * ldb + jj];
      }
    }
  }
}

inline void gemm_acc(float* C, int64_t ldc, const float* A, int64_t lda, const float* B,
                     int64_t ldb, int64_t M, int64_t N, int64_t K) {
  gemm<true>(C, ldc, A, lda, B, ldb, M, N, K);
}

inline void gemm_set(float* C, int64_t ldc, const float* A, int64_t lda, const float* B,
                     int64_t ldb, int64_t M, int64_t N, int64_t K) {
  gemm<false>(C, ldc, A, lda, B, ldb, M, N, K);
}

}  // namespace acc::kernels::tile

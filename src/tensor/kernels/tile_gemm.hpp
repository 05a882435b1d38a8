#pragma once
// A register-blocked micro-kernel for the small matrix products inside fused kernels (attention
// tiles of 64 x 64 x HS). OpenBLAS is faster on large products but is a poor fit here: its calls
// may spawn threads inside our TBB tasks, and packing dominates at this size. Per step of k the
// kernel loads one row of B into registers and broadcasts R elements of A, keeping an R x (V*W)
// block of C in registers (AVX-512: 6 x 64, AVX2: 3 x 32), so it runs close to the FMA peak when
// its operands sit in L1 (callers pack them: rows a power of two apart map onto the same L1 sets).
//
// A is read either row-major (A[r * lda + k]) or, with TransA, from its transpose stored
// row-major (A[k * lda + r]); both broadcast one element per row and step of k.

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "simd.hpp"

namespace acc::kernels::tile {

using simd::kWidth;
using simd::vreg;

// Rows of C a block keeps in registers, next to its 4 accumulator columns and 4 B registers:
// AVX-512 has 32 vector registers (6 x 4 + 4 + 1), AVX2 16 (3 x 4 + 4).
#if defined(__AVX512F__)
constexpr int kRows = 6;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kRows = 3;
#else
constexpr int kRows = 4;
#endif

// C[R rows][V*W cols] (+)= A[R rows][K] * B[K][V*W cols]. With K == 0 and !Acc, C is zeroed.
template <int R, int V, bool Acc, bool TransA>
inline void block(float* C, int64_t ldc, const float* A, int64_t lda, const float* B, int64_t ldb,
                  int64_t K) {
  vreg acc[R][V];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v)
      acc[r][v] = Acc ? simd::load(C + r * ldc + v * kWidth) : simd::set1(0.f);
  }
  for (int64_t k = 0; k < K; ++k) {
    vreg b[V];
    for (int v = 0; v < V; ++v) b[v] = simd::load(B + k * ldb + v * kWidth);
    for (int r = 0; r < R; ++r) {
      const vreg a = simd::set1(TransA ? A[k * lda + r] : A[r * lda + k]);
      for (int v = 0; v < V; ++v) acc[r][v] = simd::fma(a, b[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) simd::store(C + r * ldc + v * kWidth, acc[r][v]);
  }
}

// R rows of C, columns [c0, N): panels of 4 vectors, then 3/2/1 vectors, then scalar columns.
template <int R, bool Acc, bool TransA>
inline void row_block(float* C, int64_t ldc, const float* A, int64_t lda, const float* B,
                      int64_t ldb, int64_t c0, int64_t N, int64_t K) {
  int64_t j = c0;
  for (; j + 4 * kWidth <= N; j += 4 * kWidth) {
    block<R, 4, Acc, TransA>(C + j, ldc, A, lda, B + j, ldb, K);
  }
  switch ((N - j) / kWidth) {
    case 3:
      block<R, 3, Acc, TransA>(C + j, ldc, A, lda, B + j, ldb, K);
      j += 3 * kWidth;
      break;
    case 2:
      block<R, 2, Acc, TransA>(C + j, ldc, A, lda, B + j, ldb, K);
      j += 2 * kWidth;
      break;
    case 1:
      block<R, 1, Acc, TransA>(C + j, ldc, A, lda, B + j, ldb, K);
      j += kWidth;
      break;
    default:
      break;
  }
  for (int r = 0; r < R; ++r) {
    for (int64_t jj = j; jj < N; ++jj) {
      float s = Acc ? C[r * ldc + jj] : 0.f;
      for (int64_t k = 0; k < K; ++k)
        s += (TransA ? A[k * lda + r] : A[r * lda + k]) * B[k * ldb + jj];
      C[r * ldc + jj] = s;
    }
  }
}

/// What a row block computes: columns [col0, N) and the K range [k0, k1) of the product.
struct BlockRange {
  int64_t col0, k0, k1;
};

/// C (M x N, row stride ldc) (+)= op(A) (M x K) @ B (K x N, row stride ldb), row block by row
/// block: blocks of kRows rows, then 4, 2 and 1 (so B is not reloaded once per row).
/// range(s, R) gives, for the block of rows [s, s + R), the first column and the K range it
/// computes; the rest of the block's row stays untouched. That is how a causal tile skips what
/// the mask hides. Without Acc, the computed part of C is overwritten.
template <bool Acc, bool TransA, class Range>
inline void gemm_blocks(float* C, int64_t ldc, const float* A, int64_t lda, const float* B,
                        int64_t ldb, int64_t M, int64_t N, Range range) {
  auto run = [&](auto rows, int64_t s) {
    constexpr int R = decltype(rows)::value;
    const BlockRange br = range(s, R);
    const float* a = TransA ? A + br.k0 * lda + s : A + s * lda + br.k0;
    row_block<R, Acc, TransA>(C + s * ldc, ldc, a, lda, B + br.k0 * ldb, ldb, br.col0, N,
                              br.k1 - br.k0);
  };
  int64_t i = 0;
  for (; i + kRows <= M; i += kRows) run(std::integral_constant<int, kRows>(), i);
  if constexpr (kRows > 4) {
    if (i + 4 <= M) {
      run(std::integral_constant<int, 4>(), i);
      i += 4;
    }
  }
  if constexpr (kRows > 2) {
    if (i + 2 <= M) {
      run(std::integral_constant<int, 2>(), i);
      i += 2;
    }
  }
  for (; i < M; ++i) run(std::integral_constant<int, 1>(), i);
}

/// C (M x N, row stride ldc) (+)= op(A) (M x K) @ B (K x N, row stride ldb); all row-major with
/// unit column stride; op(A) = A (row stride lda) or, with TransA, the transpose of a K x M
/// matrix with row stride lda. Without Acc, C is overwritten (it need not be initialised).
template <bool Acc, bool TransA = false>
inline void gemm(float* C, int64_t ldc, const float* A, int64_t lda, const float* B, int64_t ldb,
                 int64_t M, int64_t N, int64_t K) {
  gemm_blocks<Acc, TransA>(C, ldc, A, lda, B, ldb, M, N, [K](int64_t, int) {
    return BlockRange{0, 0, K};
  });
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

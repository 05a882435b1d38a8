#include <cblas.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "acc/tensor/kernels.hpp"
#include "acc/tensor/threading.hpp"
#include "simd.hpp"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/partitioner.h>

namespace acc::kernels {

namespace {

// Below this many floats C is left to the caches (a following GEMM finds it there).
constexpr int64_t kStreamingFill = int64_t{1} << 18;

// dst[0, n) = row[0, n) (or 0), non-temporal stores where dst is vector-aligned.
void fill_streaming(float* dst, int64_t n, const float* row) {
  int64_t i = 0;
  for (; i < n && reinterpret_cast<uintptr_t>(dst + i) % simd::kStreamAlign != 0; ++i) {
    dst[i] = row ? row[i] : 0.f;
  }
  for (; i + simd::kWidth <= n; i += simd::kWidth) {
    simd::stream(dst + i, row ? simd::load(row + i) : simd::set1(0.f));
  }
  for (; i < n; ++i) dst[i] = row ? row[i] : 0.f;
}

// With `streaming` false, ordinary stores (C small enough to stay in cache for the GEMM).
void fill_rows_serial(float* C, int64_t M, int64_t N, int64_t ldc, const float* row,
                      bool streaming) {
  if (!streaming) {
    for (int64_t m = 0; m < M; ++m) {
      float* c = C + m * ldc;
      if (row) {
        std::copy(row, row + N, c);
      } else {
        std::fill(c, c + N, 0.f);
      }
    }
    return;
  }
  for (int64_t m = 0; m < M; ++m) fill_streaming(C + m * ldc, N, row);
  simd::stream_fence();
}

void sgemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
           int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  // OpenBLAS clears C for beta = 0 with ordinary stores, which first read C from memory;
  // zeroing a large C with streaming stores and accumulating (beta = 1) is the same product
  // without that read (one-off timings of the 17M GPT's backward GEMMs: -2% to +8% per GEMM,
  // mostly faster; in the step profile clearing fell from 1.2% to 0.7% of the step).
  if (beta == 0.f && M * N >= kStreamingFill) {
    fill_rows_serial(C, M, N, ldc, nullptr, true);
    beta = 1.f;
  }
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(M), static_cast<blasint>(N), static_cast<blasint>(K), alpha, A,
              static_cast<blasint>(lda), B, static_cast<blasint>(ldb), beta, C,
              static_cast<blasint>(ldc));
}

}  // namespace

void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
          int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    // BLAS leaves C untouched for K = 0 only when beta = 1; make beta's meaning explicit.
    for (int64_t i = 0; i < M; ++i) {
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.f ? 0.f : beta * C[i * ldc + j];
    }
    return;
  }
  const int threads = get_num_threads();
  if (gemm_threading() == GemmThreading::kOpenBlas || threads == 1 || M * N * K < (1 << 21)) {
    sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  // One thread pool: split the larger of M and N into one block per thread (multiples of 64) and
  // run single-threaded sgemm calls as TBB tasks.
  const bool split_m = M >= N;
  const int64_t extent = split_m ? M : N;
  const int64_t block = (extent / threads + 63) / 64 * 64;
  const int64_t nblocks = (extent + block - 1) / block;
  tbb::parallel_for(
      tbb::blocked_range<int64_t>(0, nblocks, 1),
      [&](const tbb::blocked_range<int64_t>& r) {
        for (int64_t bi = r.begin(); bi < r.end(); ++bi) {
          const int64_t s0 = bi * block, n = std::min(block, extent - s0);
          if (split_m) {
            const float* a = ta ? A + s0 : A + s0 * lda;
            sgemm(ta, tb, n, N, K, alpha, a, lda, B, ldb, beta, C + s0 * ldc, ldc);
          } else {
            const float* b = tb ? B + s0 * ldb : B + s0;
            sgemm(ta, tb, M, n, K, alpha, A, lda, b, ldb, beta, C + s0, ldc);
          }
        }
      },
      tbb::simple_partitioner());
}

void fill_rows(float* C, int64_t M, int64_t N, int64_t ldc, const float* row) {
  parallel_for(M, std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(N, 1)),
               [&, streaming = M * N >= kStreamingFill](int64_t b, int64_t e) {
                 fill_rows_serial(C + b * ldc, e - b, N, ldc, row, streaming);
               });
}

void add_column_sums(float* out, const float* x, int64_t M, int64_t N, int64_t ldx) {
  // Rows are read in memory order, four at a time. Summing a block of columns down all rows
  // instead reads each row's segment a row stride apart, a page or more for a linear's gradient,
  // where the hardware prefetchers do not follow: one-off timing of 2048 rows, pinned, data just
  // written and evicted from L2: 7.3-9.4 GB/s by column blocks, 12.6-13.9 GB/s this way.
  // Row chunks of a fixed size (not one per thread) are summed separately, the first into `out`,
  // the others into private partials added in chunk order, so the result does not depend on the
  // thread count.
  constexpr int64_t kChunkRows = 256;
  const int64_t nchunks = (M + kChunkRows - 1) / kChunkRows;
  std::vector<float> part(static_cast<size_t>(std::max<int64_t>(nchunks - 1, 0) * N), 0.f);
  parallel_for(nchunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      float* __restrict o = c == 0 ? out : part.data() + (c - 1) * N;
      const int64_t r1 = std::min(M, (c + 1) * kChunkRows);
      int64_t r = c * kChunkRows;
      for (; r + 4 <= r1; r += 4) {
        const float* __restrict x0 = x + r * ldx;
        const float* __restrict x1 = x0 + ldx;
        const float* __restrict x2 = x1 + ldx;
        const float* __restrict x3 = x2 + ldx;
        for (int64_t j = 0; j < N; ++j) o[j] += (x0[j] + x1[j]) + (x2[j] + x3[j]);
      }
      for (; r < r1; ++r) {
        const float* __restrict xr = x + r * ldx;
        for (int64_t j = 0; j < N; ++j) o[j] += xr[j];
      }
    }
  });
  for (int64_t c = 1; c < nchunks; ++c) {
    const float* p = part.data() + (c - 1) * N;
    for (int64_t j = 0; j < N; ++j) out[j] += p[j];
  }
}

void axpy(int64_t n, float a, const float* x, float* y) {
  parallel_for(n, 1 << 15, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) y[i] += a * x[i];
  });
}

void scale(int64_t n, float a, float* x) {
  parallel_for(n, 1 << 15, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) x[i] *= a;
  });
}

namespace {

// Blocks of 1024: 16 float lane sums (vectorised), each block combined in double.
template <bool Square>
double blocked_sum(const float* x, int64_t n) {
  double total = 0;
  constexpr int64_t kBlock = 1024;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t e = std::min(n, b + kBlock);
    float part[16] = {0};
    int64_t i = b;
    for (; i + 16 <= e; i += 16) {
      for (int j = 0; j < 16; ++j) part[j] += Square ? x[i + j] * x[i + j] : x[i + j];
    }
    double s = 0;
    for (int j = 0; j < 16; ++j) s += part[j];
    for (; i < e; ++i) {
      const double v = x[i];
      s += Square ? v * v : v;
    }
    total += s;
  }
  return total;
}

}  // namespace

double sum(const float* x, int64_t n) {
  return blocked_sum<false>(x, n);
}

double sum_squares(const float* x, int64_t n) {
  return blocked_sum<true>(x, n);
}

}  // namespace acc::kernels

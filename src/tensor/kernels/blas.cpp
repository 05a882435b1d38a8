#include <cblas.h>

#include "acc/tensor/kernels.hpp"
#include "acc/tensor/threading.hpp"

namespace acc::kernels {

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
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(M), static_cast<blasint>(N), static_cast<blasint>(K), alpha, A,
              static_cast<blasint>(lda), B, static_cast<blasint>(ldb), beta, C,
              static_cast<blasint>(ldc));
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

double sum(const float* x, int64_t n) {
  // Blocks of float partial sums (vectorised) combined in double.
  double total = 0;
  constexpr int64_t kBlock = 1024;
  for (int64_t b = 0; b < n; b += kBlock) {
    int64_t e = std::min(n, b + kBlock);
    float part[16] = {0};
    int64_t i = b;
    for (; i + 16 <= e; i += 16) {
      for (int j = 0; j < 16; ++j) part[j] += x[i + j];
    }
    double s = 0;
    for (int j = 0; j < 16; ++j) s += part[j];
    for (; i < e; ++i) s += x[i];
    total += s;
  }
  return total;
}

double sum_squares(const float* x, int64_t n) {
  double total = 0;
  constexpr int64_t kBlock = 1024;
  for (int64_t b = 0; b < n; b += kBlock) {
    int64_t e = std::min(n, b + kBlock);
    float part[16] = {0};
    int64_t i = b;
    for (; i + 16 <= e; i += 16) {
      for (int j = 0; j < 16; ++j) part[j] += x[i + j] * x[i + j];
    }
    double s = 0;
    for (int j = 0; j < 16; ++j) s += part[j];
    for (; i < e; ++i) s += static_cast<double>(x[i]) * x[i];
    total += s;
  }
  return total;
}

}  // namespace acc::kernels

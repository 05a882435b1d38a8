#include <utility>

#include "acc/autograd/flops.hpp"
#include "acc/autograd/ops.hpp"
#include "acc/autograd/saved.hpp"
#include "acc/tensor/kernels.hpp"
#include "acc/util/checked.hpp"
#include "op_util.hpp"

namespace acc {
namespace {

// A logical (rows x cols) matrix in memory, as sgemm sees it: either row-major with leading
// dimension ld, or the transpose of a row-major (cols x rows) matrix.
struct Mat {
  const float* p;
  int64_t rows, cols;
  bool trans;
  int64_t ld;
  Mat t() const { return {p, cols, rows, !trans, ld}; }
};

// Reads the last two dimensions of `x` (batch offset applied by the caller). Returns false when
// neither dimension has unit stride and the caller must make the tensor contiguous.
bool as_mat(const Tensor& x, const float* base, Mat* m) {
  const int64_t r = x.size(-2), c = x.size(-1);
  const int64_t sr = x.strides()[x.dim() - 2], sc = x.strides()[x.dim() - 1];
  if ((sc == 1 || c == 1) && sr >= std::max<int64_t>(c, 1)) {
    *m = {base, r, c, false, std::max<int64_t>(sr, 1)};
    return true;
  }
  if ((sr == 1 || r == 1) && sc >= std::max<int64_t>(r, 1)) {
    *m = {base, r, c, true, std::max<int64_t>(sc, 1)};
    return true;
  }
  return false;
}

// C (M,N), row-major with leading dimension ldc, = A @ B + beta * C.
void mm_into(float* C, int64_t ldc, const Mat& A, const Mat& B, float beta) {
  kernels::gemm(A.trans, B.trans, A.rows, B.cols, A.cols, 1.f, A.p, A.ld, B.p, B.ld, beta, C, ldc);
}

Mat contiguous_mat(const float* p, int64_t rows, int64_t cols) {
  return {p, rows, cols, false, cols};
}

// Batched matmul over L = a.shape[0]: a (L,M,K), b (L,K,N) -> (L,M,N).
Tensor bmm(const Tensor& a_in, const Tensor& b_in) {
  Mat probe;
  Tensor a = as_mat(a_in, nullptr, &probe) ? a_in : a_in.contiguous();
  Tensor b = as_mat(b_in, nullptr, &probe) ? b_in : b_in.contiguous();
  const int64_t L = a.size(0), M = a.size(1), K = a.size(2), N = b.size(2);
  Tensor out = empty({L, M, N}, a.options());
  autograd::detail::add_flops(autograd::matmul_flops("bmm", L, M, K, N), false);
  if (!out.is_meta()) {
    for (int64_t l = 0; l < L; ++l) {
      Mat A, B;
      as_mat(a, a.data<float>() + l * a.strides()[0], &A);
      as_mat(b, b.data<float>() + l * b.strides()[0], &B);
      mm_into(out.data<float>() + l * M * N, N, A, B, 0.f);
    }
  }
  autograd::record_op(
      "BmmBackward", {a_in, b_in}, {out},
      [a, b, L, M, K, N](const std::vector<Tensor>& g, const std::vector<bool>& need) {
        Tensor gc = g[0].contiguous();
        Tensor da, db;
        if (need[0]) da = empty({L, M, K}, a.options());
        if (need[1]) db = empty({L, K, N}, b.options());
        autograd::detail::add_flops(
            checked_mul(autograd::matmul_flops("bmm backward", L, M, K, N),
                        int64_t{need[0]} + int64_t{need[1]}, "bmm backward FLOPs"),
            true);
        if (!gc.is_meta()) {
          for (int64_t l = 0; l < L; ++l) {
            Mat A, B;
            as_mat(a, a.data<float>() + l * a.strides()[0], &A);
            as_mat(b, b.data<float>() + l * b.strides()[0], &B);
            Mat G = contiguous_mat(gc.data<float>() + l * M * N, M, N);
            if (need[0]) mm_into(da.data<float>() + l * M * K, K, G, B.t(), 0.f);  // dA = G B^T
            if (need[1]) mm_into(db.data<float>() + l * K * N, N, A.t(), G, 0.f);  // dB = A^T G
          }
        }
        return std::vector<Tensor>{da, db};
      });
  return out;
}

}  // namespace

Tensor matmul(const Tensor& a, const Tensor& b) {
  detail::check_f32(a, "matmul", "a");
  detail::check_f32(b, "matmul", "b");
  detail::check_same_device("matmul", {&a, &b});
  ACC_CHECK_SHAPE(a.dim() >= 2 && b.dim() >= 2, "matmul: expects tensors of at least 2 ",
                  "dimensions, got ", a.shape(), " and ", b.shape());
  ACC_CHECK_SHAPE(a.size(-1) == b.size(-2), "matmul: inner dimensions differ: ", a.shape(), " @ ",
                  b.shape());
  if (b.dim() == 2) {
    // Fold a's batch dimensions into M: one large GEMM.
    Shape out_shape(a.shape().begin(), a.shape().end() - 1);
    out_shape.push_back(b.size(1));
    Tensor a2 = a.dim() == 2 ? a : a.reshape({-1, a.size(-1)});
    return bmm(a2.unsqueeze(0), b.unsqueeze(0)).view(out_shape);
  }
  ACC_CHECK_SHAPE(
      a.dim() == b.dim() && std::equal(a.shape().begin(), a.shape().end() - 2, b.shape().begin()),
      "matmul: batch dimensions must match, got ", a.shape(), " @ ", b.shape());
  Shape out_shape(a.shape().begin(), a.shape().end() - 1);
  out_shape.push_back(b.size(-1));
  if (a.dim() == 2) return bmm(a.unsqueeze(0), b.unsqueeze(0)).view(out_shape);
  Tensor a3 = a.reshape({-1, a.size(-2), a.size(-1)});
  Tensor b3 = b.reshape({-1, b.size(-2), b.size(-1)});
  return bmm(a3, b3).view(out_shape);
}

Tensor linear(const Tensor& x, const Tensor& w, const Tensor& bias) {
  detail::check_f32(x, "linear", "input");
  detail::check_f32(w, "linear", "weight");
  detail::check_same_device("linear", {&x, &w, &bias});
  ACC_CHECK_SHAPE(w.dim() == 2, "linear: weight must be (out, in), got ", w.shape());
  ACC_CHECK_SHAPE(x.dim() >= 1 && x.size(-1) == w.size(1), "linear: input ", x.shape(),
                  " does not match weight ", w.shape(), " (expects last dimension ", w.size(1),
                  ")");
  const bool has_bias = bias.defined();
  if (has_bias) {
    detail::check_f32(bias, "linear", "bias");
    ACC_CHECK_SHAPE(bias.dim() == 1 && bias.size(0) == w.size(0), "linear: bias ", bias.shape(),
                    " does not match weight ", w.shape());
  }
  const int64_t IN = w.size(1), OUT = w.size(0), M = x.numel() / std::max<int64_t>(IN, 1);
  // x and the incoming gradient may be views whose rows lie further apart than their width (a
  // narrowed or split tensor): the GEMMs take their row strides, so they are not copied.
  const auto x_rows = detail::rows_of_matrix(x);
  const Tensor xc = x_rows.first;
  const int64_t ldx = x_rows.second;
  Tensor wc = w.contiguous(), bc = has_bias ? bias.contiguous() : Tensor();
  Shape out_shape(x.shape().begin(), x.shape().end() - 1);
  out_shape.push_back(OUT);
  Tensor out = empty(out_shape, x.options());
  if (!out.is_meta() && M > 0) {
    float* y = out.data<float>();
    if (has_bias) kernels::fill_rows(y, M, OUT, OUT, bc.data<float>());
    // y (M,OUT) = x (M,IN) @ w^T (IN,OUT)
    kernels::gemm(false, true, M, OUT, IN, 1.f, xc.data<float>(), ldx, wc.data<float>(), IN,
                  has_bias ? 1.f : 0.f, y, OUT);
  }
  std::vector<Tensor> inputs{x, w};
  if (has_bias) inputs.push_back(bias);
  // The input as backward will read it: itself (with its row stride), or a contiguous bf16 copy
  // under amp's activation storage.
  const autograd::SavedTensor sx(xc, autograd::will_record({&x, &w, &bias}));
  const int64_t ldx_saved = sx.packed() ? IN : ldx;
  auto backward = [sx, ldx_saved, wc, M, IN, OUT, has_bias](const std::vector<Tensor>& g,
                                                            const std::vector<bool>& need) {
    const Tensor xc = sx.get();
    const int64_t ldx = ldx_saved;
    const auto rows = detail::rows_of_matrix(g[0]);
    const Tensor& gc = rows.first;
    const int64_t ldg = rows.second;
    Tensor dx, dw, db;
    if (need[0]) dx = empty(xc.shape(), xc.options());
    if (need[1]) dw = empty(wc.shape(), wc.options());
    if (has_bias && need[2]) db = zeros({OUT}, wc.options());
    autograd::detail::add_flops(
        autograd::matmul_flops("linear backward", int64_t{need[0]} + int64_t{need[1]}, M, IN, OUT),
        true);
    if (!gc.is_meta()) {
      const float* pg = gc.data<float>();
      // The bias gradient first: g was just written by the op before, so part of it is still in
      // cache; after the two GEMMs it is not.
      if (db.defined()) kernels::add_column_sums(db.data<float>(), pg, M, OUT, ldg);
      // dx (M,IN) = g (M,OUT) @ w (OUT,IN)
      if (need[0]) {
        kernels::gemm(false, false, M, IN, OUT, 1.f, pg, ldg, wc.data<float>(), IN, 0.f,
                      dx.data<float>(), IN);
      }
      // dw (OUT,IN) = g^T (OUT,M) @ x (M,IN)
      if (need[1]) {
        kernels::gemm(true, false, OUT, IN, M, 1.f, pg, ldg, xc.data<float>(), ldx, 0.f,
                      dw.data<float>(), IN);
      }
    }
    std::vector<Tensor> grads{dx, dw};
    if (has_bias) grads.push_back(db);
    return grads;
  };
  // The FLOPs go to the op recorded next (the tracer's vertex): reported here, after the saved
  // input's bf16 copy under amp (an op of its own), so that they are the Linear's, not the copy's.
  autograd::detail::add_flops(autograd::matmul_flops("linear", 1, M, IN, OUT), false);
  autograd::record_op("LinearBackward", inputs, {out}, std::move(backward));
  return out;
}

}  // namespace acc

#pragma once
// CPU kernels, llm.c style: plain functions over contiguous f32 buffers, a forward/backward pair
// per layer, a shape comment on every pointer. GEMMs go to OpenBLAS (cblas_sgemm); everything else
// is a vectorisable loop, parallel over rows with TBB (acc::parallel_for). Backward kernels write
// (=) their outputs unless the comment says they accumulate (+=).
//
// These functions do not check their arguments: the differentiable ops in acc/autograd/ops.hpp
// validate shapes and dtypes and then call them.

#include <cstdint>

#include "acc/tensor/tensor.hpp"

namespace acc::kernels {

// ---- BLAS ----
// C (M,N) = alpha * op(A) (M,K) @ op(B) (K,N) + beta * C; row-major, op = transpose when ta/tb.
void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
          int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);
// Every row of C (M,N; row stride ldc) = row (N floats), or 0 when row is null. Large fills
// (>= 1 MiB) use streaming stores: the caller's GEMM (beta = 1) reads C next, and ordinary
// stores would first read every line of C from memory.
void fill_rows(float* C, int64_t M, int64_t N, int64_t ldc, const float* row);
// out[n] += sum over rows m of x[m, n] (x is M x N, row stride ldx >= N). Rows are summed in
// fixed chunks combined in a fixed order, so the result does not depend on the thread count.
void add_column_sums(float* out, const float* x, int64_t M, int64_t N, int64_t ldx);
// y += a * x
void axpy(int64_t n, float a, const float* x, float* y);
// x *= a
void scale(int64_t n, float a, float* x);
// sum of x (double accumulation)
double sum(const float* x, int64_t n);
// sum of x*x (double accumulation)
double sum_squares(const float* x, int64_t n);

// ---- broadcasting ----
/// The broadcast of two shapes (numpy rules); throws acc::ShapeError when they do not broadcast.
Shape broadcast_shapes(const Shape& a, const Shape& b);
/// Sums g over the dimensions that were broadcast to reach g's shape from `shape`.
Tensor sum_to(const Tensor& g, const Shape& shape);

enum class BinaryOp { kAdd, kSub, kMul, kDiv };
/// out = a op b with broadcasting (f32).
Tensor binary(BinaryOp op, const Tensor& a, const Tensor& b);

// ---- activations (n elements) ----
void gelu_forward(float* out, const float* x, int64_t n, bool tanh_approx);
void gelu_backward(float* dx, const float* x, const float* dout, int64_t n, bool tanh_approx);
void silu_forward(float* out, const float* x, int64_t n);
void silu_backward(float* dx, const float* x, const float* dout, int64_t n);
void relu_forward(float* out, const float* x, int64_t n);
void relu_backward(float* dx, const float* x, const float* dout, int64_t n);
// out = silu(gate) * up
void swiglu_forward(float* out, const float* gate, const float* up, int64_t n);
void swiglu_backward(float* dgate, float* dup, const float* gate, const float* up,
                     const float* dout, int64_t n);

// ---- normalisation over the last dimension; N rows of C ----
// out (N,C), mean (N), rstd (N), x (N,C), w (C), b (C) or null
void layernorm_forward(float* out, float* mean, float* rstd, const float* x, const float* w,
                       const float* b, int64_t N, int64_t C, float eps);
// dx (N,C) =; dw (C), db (C) accumulate (+=) when not null
void layernorm_backward(float* dx, float* dw, float* db, const float* dout, const float* x,
                        const float* w, const float* mean, const float* rstd, int64_t N, int64_t C);
// out (N,C), rstd (N)
void rmsnorm_forward(float* out, float* rstd, const float* x, const float* w, int64_t N, int64_t C,
                     float eps);
// dx (N,C) =; dw (C) accumulates (+=) when not null
void rmsnorm_backward(float* dx, float* dw, const float* dout, const float* x, const float* w,
                      const float* rstd, int64_t N, int64_t C);

// ---- softmax over the last dimension ----
void softmax_forward(float* out, const float* x, int64_t N, int64_t C);
// dx = y * (dy - sum(dy * y))
void softmax_backward(float* dx, const float* y, const float* dy, int64_t N, int64_t C);
void log_softmax_forward(float* out, const float* x, int64_t N, int64_t C);
// dx = dy - exp(y) * sum(dy)
void log_softmax_backward(float* dx, const float* y, const float* dy, int64_t N, int64_t C);

// ---- attention ----
// Strided view of a (B, H, T, HS) operand whose HS dimension is contiguous.
struct AttnOperand {
  const float* ptr;
  int64_t sb, sh, st;  // element strides of the B, H and T dimensions
};
struct AttnGrad {
  float* ptr;
  int64_t sb, sh, st;
};
// Fused scaled-dot-product attention with an online softmax over key tiles (flash-attention
// style): memory beyond the output is the log-sum-exp per row, O(T) per head, never (T,T).
// q (B,NH,T,HS), k/v (B,NKV,T,HS) with NH % NKV == 0 (grouped-query attention: query head h reads
// kv head h / (NH/NKV)); out (B,NH,T,HS) strided; lse (B,NH,T) contiguous.
void attention_forward(AttnGrad out, float* lse, AttnOperand q, AttnOperand k, AttnOperand v,
                       int64_t B, int64_t NH, int64_t NKV, int64_t T, int64_t HS, float scale,
                       bool causal);
// Recomputes the probabilities tile by tile from q, k and lse. dq/dk/dv are written (=).
void attention_backward(AttnGrad dq, AttnGrad dk, AttnGrad dv, AttnOperand dout, AttnOperand q,
                        AttnOperand k, AttnOperand v, AttnOperand out, const float* lse, int64_t B,
                        int64_t NH, int64_t NKV, int64_t T, int64_t HS, float scale, bool causal);

// ---- rotary embeddings (Hugging Face rotate_half convention) ----
// out[..., i] = x[..., i] * cos[t, i] + rotate_half(x)[..., i] * sin[t, i], where rotate_half(x) =
// cat(-x[HS/2:], x[:HS/2]). x/out (R, T, HS) contiguous with R = B*NH, cos/sin (T, HS).
// The backward is the same map with -sin.
void rope_forward(float* out, const float* x, const float* cos, const float* sin, int64_t R,
                  int64_t T, int64_t HS, bool inverse);

// ---- embedding ----
// out (N,C) = w[idx[n]]; idx i64 or i32 values in [0, V)
template <class Index>
void embedding_forward(float* out, const Index* idx, const float* w, int64_t N, int64_t C);
// dw (V,C) += scatter of dout (N,C); deterministic (rows of dw are owned by one thread each).
template <class Index>
void embedding_backward(float* dw, const Index* idx, const float* dout, int64_t N, int64_t C,
                        int64_t V);

// ---- cross-entropy fused with log-softmax ----
// losses (N) = lse(logits[n]) - logits[n, target[n]]; lse (N); rows with target == ignore_index
// get loss 0. logits (N,V).
template <class Index>
void cross_entropy_forward(float* losses, float* lse, const float* logits, const Index* targets,
                           int64_t N, int64_t V, int64_t ignore_index);
// dlogits (N,V) = (softmax(logits) - onehot(target)) * dloss[n]
template <class Index>
void cross_entropy_backward(float* dlogits, const float* logits, const float* lse,
                            const Index* targets, const float* dloss, int64_t N, int64_t V,
                            int64_t ignore_index);

// ---- vocabulary-parallel cross-entropy: one rank's Vl columns of the logits (N, Vl), the first
// `valid` of them real (the rest padding) ----
// mx (N) = the row maxima over the valid columns (-3e38 when there are none).
void vocab_ce_max(float* mx, const float* logits, int64_t N, int64_t Vl, int64_t valid);
// sums (2N): [n] = sum over the valid columns of exp(x - mx[n]); [N + n] = x[tl[n]] - mx[n] when
// the target's local column tl[n] >= 0 (on this rank), else 0.
void vocab_ce_sums(float* sums, const float* logits, const float* mx, const int64_t* tl, int64_t N,
                   int64_t Vl, int64_t valid);
// dlogits (N, Vl) = (exp(x - lse[n]) - onehot(tl[n])) * dloss[n] on the valid columns, 0 on the
// padding and on rows with dloss[n] == 0 (ignored targets).
void vocab_ce_backward(float* dlogits, const float* logits, const float* lse, const int64_t* tl,
                       const float* dloss, int64_t N, int64_t Vl, int64_t valid);

}  // namespace acc::kernels

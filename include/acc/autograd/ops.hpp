#pragma once
// Differentiable operations. Each validates its inputs (throwing acc::ShapeError / acc::TypeError /
// acc::ValueError with the offending values), runs the kernel (or, on meta tensors, only computes
// the output shape), and records its backward when an input requires grad.
//
// Floating-point ops compute in f32; bf16 inputs are rejected with a TypeError naming the op (cast
// with .to(DType::kFloat32)); the amp strategy does its casts explicitly.

#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "acc/tensor/node.hpp"
#include "acc/tensor/random.hpp"
#include "acc/tensor/tensor.hpp"

namespace acc {

// ---- elementwise with broadcasting ----
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
/// a * s
Tensor scale(const Tensor& a, double s);
/// a + s
Tensor add_scalar(const Tensor& a, double s);
Tensor neg(const Tensor& a);
Tensor exp(const Tensor& a);
Tensor log(const Tensor& a);
Tensor tanh(const Tensor& a);
Tensor square(const Tensor& a);

inline Tensor operator+(const Tensor& a, const Tensor& b) {
  return add(a, b);
}
inline Tensor operator-(const Tensor& a, const Tensor& b) {
  return sub(a, b);
}
inline Tensor operator*(const Tensor& a, const Tensor& b) {
  return mul(a, b);
}
inline Tensor operator/(const Tensor& a, const Tensor& b) {
  return div(a, b);
}
inline Tensor operator*(const Tensor& a, double s) {
  return scale(a, s);
}
inline Tensor operator*(double s, const Tensor& a) {
  return scale(a, s);
}
inline Tensor operator/(const Tensor& a, double s) {
  return scale(a, 1.0 / s);
}
inline Tensor operator+(const Tensor& a, double s) {
  return add_scalar(a, s);
}
inline Tensor operator-(const Tensor& a, double s) {
  return add_scalar(a, -s);
}
inline Tensor operator-(const Tensor& a) {
  return neg(a);
}

// ---- linear algebra ----
/// (..., M, K) @ (..., K, N): 2-D @ 2-D, N-D @ 2-D (batch dims folded into M), and batched N-D @
/// N-D with equal batch dims. Transposed views are passed to sgemm as transposes, not copied.
Tensor matmul(const Tensor& a, const Tensor& b);
/// x (..., IN) @ w (OUT, IN)^T + b (OUT): torch.nn.functional.linear. x and the incoming
/// gradient may have rows with a stride larger than IN / OUT (unit column stride); they are
/// handed to sgemm with that stride, not copied.
Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b = Tensor());

// ---- activations ----
enum class GeluApprox { kNone, kTanh };
Tensor gelu(const Tensor& x, GeluApprox approximate = GeluApprox::kTanh);
Tensor silu(const Tensor& x);
Tensor relu(const Tensor& x);
/// silu(gate) * up, fused.
Tensor swiglu(const Tensor& gate, const Tensor& up);
/// Elementwise x * (mask / (1 - p)) with mask ~ Bernoulli(1 - p); identity when !training or p ==
/// 0.
Tensor dropout(const Tensor& x, double p, bool training, Generator& gen = default_generator());
/// Dropout of x, the part `chunk` of a larger tensor: each element's mask is the one dropout of
/// the whole would give it (uniform_ over a chunk), so sequence-parallel ranks together draw one
/// process's masks.
Tensor dropout(const Tensor& x, double p, bool training, Generator& gen, const TensorChunk& chunk);

// ---- normalisation (over the last dimension) ----
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps = 1e-5);
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps = 1e-6);
Tensor softmax(const Tensor& x, int64_t dim = -1);
Tensor log_softmax(const Tensor& x, int64_t dim = -1);

// ---- attention ----
/// Fused scaled-dot-product attention: q (B,NH,T,HS), k/v (B,NKV,T,HS) with NH % NKV == 0
/// (grouped-query attention). Flash-style: O(T) memory per head, (T,T) is never materialised.
/// scale defaults to 1/sqrt(HS). The result is (B,NH,T,HS), stored as (B,T,NH,HS), so
/// out.transpose(1, 2).reshape({B, T, C}) is free.
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    bool causal = true,
                                    double scale = std::numeric_limits<double>::quiet_NaN());
/// Reference attention through matmul and softmax (materialises (B,NH,T,T)); kept for testing the
/// fused kernel and for finding regressions.
Tensor attention_reference(const Tensor& q, const Tensor& k, const Tensor& v, bool causal = true);

/// cos and sin tables (T, HS) for rotary embeddings, as Hugging Face Llama computes them in f32:
/// inv_freq[i] = 1 / theta^(2i/HS), emb = cat(t * inv_freq, t * inv_freq).
std::pair<Tensor, Tensor> rope_cache(int64_t T, int64_t HS, double theta,
                                     Device device = Device::kCPU);
/// x * cos + rotate_half(x) * sin for x (B, NH, T, HS) and tables (T, HS) from rope_cache.
Tensor rotary_embedding(const Tensor& x, const Tensor& cos, const Tensor& sin);

// ---- embedding and loss ----
/// weight (V, C) rows picked by idx (any shape, i32 or i64) -> (..., C). Throws acc::ValueError
/// naming the first index outside [0, V).
Tensor embedding(const Tensor& idx, const Tensor& weight);
/// Mean over non-ignored rows of -log softmax(logits)[target]; logits (..., V), targets (...)
/// i32/i64. Fused: log-softmax is never stored, backward recomputes it from the saved row
/// log-sum-exp. Throws acc::ValueError naming the first target outside [0, V).
Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index = -100);

// ---- reductions and shape ops ----
Tensor sum(const Tensor& x);
Tensor sum(const Tensor& x, int64_t dim, bool keepdim = false);
Tensor mean(const Tensor& x);
Tensor mean(const Tensor& x, int64_t dim, bool keepdim = false);
Tensor cat(const std::vector<Tensor>& tensors, int64_t dim);
/// Splits dimension `dim` into pieces of the given sizes (they must add up to its size).
std::vector<Tensor> split(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim);
/// Splits into `chunks` equal pieces (the size must divide).
std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim);

}  // namespace acc

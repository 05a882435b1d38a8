// Every differentiable op in acc/autograd/ops.hpp (and the tensor views) checked by the harness in
// gradcheck.hpp: gradients against central finite differences, forward values against closed
// forms or a reference built from other ops, and the same graph run on meta tensors.
//
// Tolerances (per element, |analytic - numeric| <= atol + rtol |numeric|): inputs are O(1) and
// the step is eps = 1e-2 (1e-2 relative). In f32 the rounding of L = sum(f(x) R) is ~1e-7 |L|,
// i.e. ~1e-5 after dividing by 2 eps, and the truncation error is ~eps^2 |f'''| / 6 ~ 2e-5 for
// the smooth ops here, so rtol = 1e-2, atol = 1e-3 (kSmooth) leaves a wide margin (the worst case
// uses ~5% of it) while a gradient that is off by 2% of its value or by one dropped term still
// fails (see the Gradcheck tests). Ops that are linear in the checked input (matmul, linear,
// views, sums, embedding, dropout) have no truncation error and use atol = 1e-4 (kLinearMap);
// cross_entropy's gradients are O(1/N), so it uses atol = 1e-4 as well.

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "acc/autograd/engine.hpp"
#include "acc/autograd/ops.hpp"
#include "acc/tensor/random.hpp"
#include "acc/tensor/threading.hpp"
#include "acc/util/error.hpp"
#include "autograd/gradcheck.hpp"

namespace acc {
namespace {

using test::compare_with_reference;
using test::gradcheck;
using test::GradcheckOptions;
using test::TensorFn;

// ---- inputs ----

Tensor randn_t(Shape shape, uint64_t seed, double std = 1.0, double mean = 0.0) {
  Generator gen(seed);
  Tensor t = randn(std::move(shape), gen);
  NoGradGuard ng;
  return add_scalar(scale(t, std), mean);
}

Tensor uniform_t(Shape shape, double lo, double hi, uint64_t seed) {
  Generator gen(seed);
  Tensor t = empty(std::move(shape));
  uniform_(t, lo, hi, gen);
  return t;
}

// Values with |x| in [0.2, 1.2] and random signs: no kink of relu within eps of any of them.
Tensor away_from_zero(Shape shape, uint64_t seed) {
  std::vector<float> v = uniform_t(shape, -1.0, 1.0, seed).to_vector<float>();
  for (float& x : v) x = x < 0 ? x - 0.2f : x + 0.2f;
  return from_vector(v, shape);
}

Tensor i64(std::vector<int64_t> v, Shape shape) {
  return from_vector(v, std::move(shape));
}
Tensor i32(std::vector<int32_t> v, Shape shape) {
  return from_vector(v, std::move(shape));
}

// Inputs of a case are made when its test runs (not at registration).
using Input = std::function<Tensor()>;
Input rn(Shape s, uint64_t seed, double std = 1.0, double mean = 0.0) {
  return [=] { return randn_t(s, seed, std, mean); };
}
Input un(Shape s, double lo, double hi, uint64_t seed) {
  return [=] { return uniform_t(s, lo, hi, seed); };
}
Input afz(Shape s, uint64_t seed) {
  return [=] { return away_from_zero(s, seed); };
}
Input ix64(std::vector<int64_t> v, Shape s) {
  return [=] { return i64(v, s); };
}
Input ix32(std::vector<int32_t> v, Shape s) {
  return [=] { return i32(v, s); };
}

// ---- the case table ----

struct OpCase {
  std::string name;
  std::vector<Input> inputs;
  GradcheckOptions opt;
  TensorFn fn;
  std::vector<Tensor> make_inputs() const {
    std::vector<Tensor> out;
    for (const Input& in : inputs) out.push_back(in());
    return out;
  }
};

void PrintTo(const OpCase& c, std::ostream* os) {
  *os << c.name;
}

const GradcheckOptions kSmooth{};
const GradcheckOptions kLinearMap = [] {
  GradcheckOptions o;
  o.atol = 1e-4;
  return o;
}();

GradcheckOptions checks(int64_t max_checks) {
  GradcheckOptions o;
  o.max_checks = max_checks;
  return o;
}

using V = std::vector<Tensor>;

std::vector<OpCase> op_cases() {
  std::vector<OpCase> c;
  auto def = [&](std::string name, std::vector<Input> in, GradcheckOptions o, TensorFn fn) {
    c.push_back({std::move(name), std::move(in), std::move(o), std::move(fn)});
  };

  // ---- elementwise with broadcasting ----
  def("add_2x3_plus_3", {rn({2, 3}, 1), rn({3}, 2)}, kLinearMap,
      [](const V& v) { return add(v[0], v[1]); });
  def("add_scalar_shaped", {rn({2, 3}, 1), rn({}, 2)}, kLinearMap,
      [](const V& v) { return add(v[1], v[0]); });
  def("sub_2x1x4_minus_3x1", {rn({2, 1, 4}, 3), rn({3, 1}, 4)}, kLinearMap,
      [](const V& v) { return sub(v[0], v[1]); });
  def("sub_1_minus_2x3", {rn({1}, 3), rn({2, 3}, 4)}, kLinearMap,
      [](const V& v) { return sub(v[0], v[1]); });
  def("mul_2x1x4_times_3x1", {rn({2, 1, 4}, 5), rn({3, 1}, 6)}, kSmooth,
      [](const V& v) { return mul(v[0], v[1]); });
  def("mul_scalar_shaped", {rn({}, 5), rn({2, 3}, 6)}, kSmooth,
      [](const V& v) { return mul(v[0], v[1]); });
  def("mul_shared_input", {rn({2, 3}, 7)}, kSmooth, [](const V& v) { return mul(v[0], v[0]); });
  def("div_2x3_by_3", {rn({2, 3}, 8), un({3}, 0.5, 1.5, 9)}, kSmooth,
      [](const V& v) { return div(v[0], v[1]); });
  def("div_3_by_2x1x3", {rn({3}, 8), un({2, 1, 3}, 0.5, 1.5, 9)}, kSmooth,
      [](const V& v) { return div(v[0], v[1]); });
  def("div_2x1x4_by_3x1", {rn({2, 1, 4}, 10), un({3, 1}, 0.5, 1.5, 11)}, kSmooth,
      [](const V& v) { return div(v[0], v[1]); });
  def("scale", {rn({3, 5}, 12)}, kLinearMap, [](const V& v) { return scale(v[0], -2.5); });
  def("add_scalar", {rn({3, 5}, 13)}, kLinearMap,
      [](const V& v) { return add_scalar(v[0], 0.75); });
  def("neg", {rn({3, 5}, 14)}, kLinearMap, [](const V& v) { return neg(v[0]); });
  def("exp", {rn({3, 5}, 15)}, kSmooth, [](const V& v) { return exp(v[0]); });
  def("log", {un({3, 5}, 0.5, 2.0, 16)}, kSmooth, [](const V& v) { return log(v[0]); });
  def("tanh", {rn({3, 5}, 17)}, kSmooth, [](const V& v) { return tanh(v[0]); });
  def("square", {rn({3, 5}, 18)}, kSmooth, [](const V& v) { return square(v[0]); });
  def("operators_chain", {rn({2, 3}, 19), un({3}, 0.5, 1.5, 20)}, kSmooth,
      [](const V& v) { return (v[0] * 2.0 + 1.0) / v[1] - v[0] * v[1]; });

  // ---- linear algebra ----
  def("matmul_2d", {rn({3, 4}, 21), rn({4, 5}, 22)}, kLinearMap,
      [](const V& v) { return matmul(v[0], v[1]); });
  def("matmul_3d_2d", {rn({2, 3, 4}, 23), rn({4, 5}, 24)}, kLinearMap,
      [](const V& v) { return matmul(v[0], v[1]); });
  def("matmul_4d_4d", {rn({2, 2, 3, 4}, 25), rn({2, 2, 4, 5}, 26)}, kLinearMap,
      [](const V& v) { return matmul(v[0], v[1]); });
  def("matmul_transposed_a", {rn({4, 3}, 27), rn({4, 5}, 28)}, kLinearMap,
      [](const V& v) { return matmul(v[0].transpose(-2, -1), v[1]); });
  def("matmul_transposed_b", {rn({3, 4}, 29), rn({5, 4}, 30)}, kLinearMap,
      [](const V& v) { return matmul(v[0], v[1].transpose(0, 1)); });
  def("matmul_4d_both_transposed", {rn({2, 2, 4, 3}, 31), rn({2, 2, 5, 4}, 32)}, kLinearMap,
      [](const V& v) { return matmul(v[0].transpose(-2, -1), v[1].transpose(-2, -1)); });
  def("matmul_3d_transposed_2d", {rn({2, 4, 3}, 33), rn({4, 5}, 34)}, kLinearMap,
      [](const V& v) { return matmul(v[0].transpose(1, 2), v[1]); });
  def("matmul_strided_slices", {rn({3, 8}, 35), rn({4, 10}, 36)}, kLinearMap,
      [](const V& v) { return matmul(v[0].slice(1, 0, 8, 2), v[1].narrow(1, 3, 5)); });
  def("matmul_expanded_batch", {rn({2, 3, 4}, 37), rn({4, 5}, 38)}, kLinearMap, [](const V& v) {
    return matmul(v[0], v[1].expand({2, 4, 5}));
  });
  def("matmul_permuted_batch", {rn({3, 2, 2, 4}, 39), rn({2, 2, 4, 3}, 40)}, kLinearMap,
      [](const V& v) {
        return matmul(v[0].permute({1, 2, 0, 3}), v[1]);
      });
  def("matmul_nonlinear_use", {rn({3, 4}, 41)}, kSmooth,
      [](const V& v) { return matmul(v[0], v[0].transpose(0, 1)); });
  def("linear_bias", {rn({3, 4}, 42), rn({5, 4}, 43), rn({5}, 44)}, kLinearMap,
      [](const V& v) { return linear(v[0], v[1], v[2]); });
  def("linear_no_bias", {rn({3, 4}, 45), rn({5, 4}, 46)}, kLinearMap,
      [](const V& v) { return linear(v[0], v[1]); });
  def("linear_3d_bias", {rn({2, 3, 4}, 47), rn({5, 4}, 48), rn({5}, 49)}, kLinearMap,
      [](const V& v) { return linear(v[0], v[1], v[2]); });
  def("linear_transposed_input", {rn({4, 3}, 50), rn({5, 4}, 51), rn({5}, 52)}, kLinearMap,
      [](const V& v) { return linear(v[0].transpose(0, 1), v[1], v[2]); });

  // ---- activations ----
  def("gelu_tanh", {rn({4, 5}, 53, 1.5)}, kSmooth,
      [](const V& v) { return gelu(v[0], GeluApprox::kTanh); });
  def("gelu_erf", {rn({4, 5}, 54, 1.5)}, kSmooth,
      [](const V& v) { return gelu(v[0], GeluApprox::kNone); });
  def("silu", {rn({4, 5}, 55, 1.5)}, kSmooth, [](const V& v) { return silu(v[0]); });
  def("relu", {afz({4, 5}, 56)}, kSmooth, [](const V& v) { return relu(v[0]); });
  def("swiglu", {rn({3, 6}, 57, 1.5), rn({3, 6}, 58)}, kSmooth,
      [](const V& v) { return swiglu(v[0], v[1]); });
  def("swiglu_strided_halves", {rn({3, 8}, 59, 1.5)}, kSmooth,
      [](const V& v) { return swiglu(v[0].narrow(1, 0, 4), v[0].narrow(1, 4, 4)); });
  def("dropout_train", {rn({4, 6}, 60)}, kLinearMap, [](const V& v) {
    Generator gen(42);  // the same mask on every call
    return dropout(v[0], 0.3, true, gen);
  });
  def("dropout_p0", {rn({4, 6}, 61)}, kLinearMap,
      [](const V& v) { return dropout(v[0], 0.0, true); });
  def("dropout_eval", {rn({4, 6}, 62)}, kLinearMap,
      [](const V& v) { return dropout(v[0], 0.5, false); });

  // ---- normalisation and softmax ----
  def("layer_norm_bias", {rn({3, 8}, 63, 2.0, 0.5), rn({8}, 64, 0.5, 1.0), rn({8}, 65)}, kSmooth,
      [](const V& v) { return layer_norm(v[0], v[1], v[2]); });
  def("layer_norm_no_bias_3d", {rn({2, 3, 8}, 66), rn({8}, 67, 0.5, 1.0)}, kSmooth,
      [](const V& v) { return layer_norm(v[0], v[1], Tensor()); });
  def("layer_norm_transposed_input", {rn({8, 3}, 68), rn({8}, 69, 0.5, 1.0), rn({8}, 70)}, kSmooth,
      [](const V& v) { return layer_norm(v[0].transpose(0, 1), v[1], v[2]); });
  // More rows than one backward chunk (2048 at C = 8): dw/db are summed over chunks.
  def("layer_norm_many_rows", {rn({3000, 8}, 71), rn({8}, 72, 0.5, 1.0), rn({8}, 73)}, checks(48),
      [](const V& v) { return layer_norm(v[0], v[1], v[2]); });
  def("rms_norm", {rn({2, 3, 8}, 74), rn({8}, 75, 0.5, 1.0)}, kSmooth,
      [](const V& v) { return rms_norm(v[0], v[1]); });
  def("rms_norm_many_rows", {rn({3000, 8}, 76), rn({8}, 77, 0.5, 1.0)}, checks(48),
      [](const V& v) { return rms_norm(v[0], v[1]); });
  def("softmax_last_dim", {rn({3, 7}, 78, 2.0)}, kSmooth,
      [](const V& v) { return softmax(v[0], -1); });
  def("softmax_middle_dim", {rn({2, 5, 3}, 79, 2.0)}, kSmooth,
      [](const V& v) { return softmax(v[0], 1); });
  def("softmax_first_dim", {rn({4, 3}, 80, 2.0)}, kSmooth,
      [](const V& v) { return softmax(v[0], 0); });
  def("log_softmax_last_dim", {rn({3, 7}, 81, 2.0)}, kSmooth,
      [](const V& v) { return log_softmax(v[0], -1); });
  def("log_softmax_middle_dim", {rn({2, 5, 3}, 82, 2.0)}, kSmooth,
      [](const V& v) { return log_softmax(v[0], 1); });

  // ---- attention ----
  // q (B,NH,T,HS), k/v (B,NKV,T,HS); T = 70 leaves a partial second 64-row tile.
  auto sdpa = [&](std::string name, int64_t B, int64_t NH, int64_t NKV, int64_t T, bool causal) {
    const int64_t HS = 4;
    def(std::move(name), {rn({B, NH, T, HS}, 83), rn({B, NKV, T, HS}, 84), rn({B, NKV, T, HS}, 85)},
        checks(96),
        [causal](const V& v) { return scaled_dot_product_attention(v[0], v[1], v[2], causal); });
  };
  sdpa("sdpa_causal_mha_T5", 2, 2, 2, 5, true);
  sdpa("sdpa_noncausal_mha_T5", 2, 2, 2, 5, false);
  sdpa("sdpa_causal_gqa_4_2_T5", 1, 4, 2, 5, true);
  sdpa("sdpa_noncausal_gqa_4_2_T5", 1, 4, 2, 5, false);
  sdpa("sdpa_causal_gqa_4_2_T70", 1, 4, 2, 70, true);
  sdpa("sdpa_noncausal_gqa_4_2_T70", 1, 4, 2, 70, false);
  sdpa("sdpa_noncausal_mqa_2_1_T70", 1, 2, 1, 70, false);
  def("sdpa_strided_qkv_from_B_T_3_NH_HS", {rn({2, 5, 3, 2, 4}, 86)}, checks(128), [](const V& v) {
    // (B,T,3,NH,HS) -> three (B,NH,T,HS) views with T stride 3*NH*HS.
    auto part = [&](int64_t i) { return v[0].narrow(2, i, 1).squeeze(2).transpose(1, 2); };
    return scaled_dot_product_attention(part(0), part(1), part(2), true);
  });
  def("sdpa_strided_gqa_packed_heads", {rn({1, 66, 4 + 2 + 2, 4}, 87)}, checks(160),
      [](const V& v) {
        // (B,T,NH+2*NKV,HS) with NH = 4, NKV = 2.
        Tensor q = v[0].narrow(2, 0, 4).transpose(1, 2);
        Tensor k = v[0].narrow(2, 4, 2).transpose(1, 2);
        Tensor w = v[0].narrow(2, 6, 2).transpose(1, 2);
        return scaled_dot_product_attention(q, k, w, true);
      });
  def("sdpa_q_without_unit_inner_stride",
      {rn({1, 2, 4, 5}, 88), rn({1, 2, 5, 4}, 89), rn({1, 2, 5, 4}, 90)}, kSmooth, [](const V& v) {
        return scaled_dot_product_attention(v[0].transpose(-2, -1), v[1], v[2], false);
      });
  def("sdpa_explicit_scale", {rn({1, 2, 6, 4}, 91), rn({1, 2, 6, 4}, 92), rn({1, 2, 6, 4}, 93)},
      kSmooth,
      [](const V& v) { return scaled_dot_product_attention(v[0], v[1], v[2], true, 0.9); });
  def("sdpa_output_merged_heads_then_linear",
      {rn({2, 2, 5, 4}, 94), rn({2, 2, 5, 4}, 95), rn({2, 2, 5, 4}, 96), rn({3, 8}, 97)},
      checks(128), [](const V& v) {
        // (B,NH,T,HS) -> (B,T,C) is a free view of the (B,T,NH,HS) storage, and the gradient
        // comes back in that layout.
        Tensor y = scaled_dot_product_attention(v[0], v[1], v[2], true);
        return linear(y.transpose(1, 2).reshape({2, 5, 8}), v[3]);
      });
  def("attention_reference_causal_gqa",
      {rn({1, 4, 5, 4}, 98), rn({1, 2, 5, 4}, 99), rn({1, 2, 5, 4}, 100)}, kSmooth,
      [](const V& v) { return attention_reference(v[0], v[1], v[2], true); });
  def("rotary_embedding", {rn({2, 2, 5, 8}, 101)}, kLinearMap, [](const V& v) {
    auto [cos, sin] = rope_cache(9, 8, 10000.0, v[0].device());  // longer than T
    return rotary_embedding(v[0], cos, sin);
  });
  // Tables whose two halves differ: the backward must be the exact transpose of the forward.
  GradcheckOptions x_only = kLinearMap;
  x_only.wrt = {true, false, false};
  def("rotary_embedding_arbitrary_tables",
      {rn({1, 2, 5, 8}, 102), rn({5, 8}, 103), rn({5, 8}, 104)}, x_only,
      [](const V& v) { return rotary_embedding(v[0], v[1], v[2]); });

  // ---- embedding and loss ----
  def("embedding_i64_repeated_indices", {ix64({0, 2, 2, 1, 0, 2}, {2, 3}), rn({4, 3}, 105)},
      kLinearMap, [](const V& v) { return embedding(v[0], v[1]); });
  def("embedding_i32_repeated_indices", {ix32({3, 3, 1, 3}, {4}), rn({5, 2}, 106)}, kLinearMap,
      [](const V& v) { return embedding(v[0], v[1]); });
  def("cross_entropy_i64", {rn({4, 5}, 107, 2.0), ix64({1, 0, 4, 2}, {4})}, kLinearMap,
      [](const V& v) { return cross_entropy(v[0], v[1]); });
  def("cross_entropy_i32_ignore_rows", {rn({4, 5}, 108, 2.0), ix32({1, -100, 4, -100}, {4})},
      kLinearMap, [](const V& v) { return cross_entropy(v[0], v[1]); });
  def("cross_entropy_i64_ignore_valid_class",
      {rn({2, 3, 5}, 109, 2.0), ix64({2, 0, 2, 4, 1, 3}, {2, 3})}, kLinearMap,
      [](const V& v) { return cross_entropy(v[0], v[1], /*ignore_index=*/2); });
  def("cross_entropy_transposed_logits", {rn({5, 3}, 110, 2.0), ix64({4, 0, 3}, {3})}, kLinearMap,
      [](const V& v) { return cross_entropy(v[0].transpose(0, 1), v[1]); });

  // ---- reductions ----
  def("sum_all", {rn({3, 4}, 111)}, kLinearMap, [](const V& v) { return sum(v[0]); });
  def("sum_dim0", {rn({3, 4}, 112)}, kLinearMap, [](const V& v) { return sum(v[0], 0); });
  def("sum_middle_dim_keepdim", {rn({2, 3, 4}, 113)}, kLinearMap,
      [](const V& v) { return sum(v[0], 1, true); });
  def("sum_last_dim_of_view", {rn({4, 3}, 114)}, kSmooth,
      [](const V& v) { return sum(square(v[0].transpose(0, 1)), -1); });
  def("mean_all", {rn({3, 4}, 115)}, kLinearMap, [](const V& v) { return mean(v[0]); });
  def("mean_dim_keepdim", {rn({2, 3, 4}, 116)}, kLinearMap,
      [](const V& v) { return mean(v[0], -1, true); });
  def("mean_dim0", {rn({3, 4}, 117)}, kSmooth, [](const V& v) { return mean(square(v[0]), 0); });

  // ---- cat / split / chunk ----
  def("cat_dim0", {rn({2, 3}, 118), rn({1, 3}, 119)}, kSmooth, [](const V& v) {
    return cat({v[0], square(v[1])}, 0);
  });
  def("cat_dim1_three_with_repeat", {rn({2, 3}, 120), rn({2, 1}, 121)}, kLinearMap, [](const V& v) {
    return cat({v[0], v[1], v[0]}, -1);
  });
  def("split_all_outputs", {rn({5, 4}, 122)}, kSmooth, [](const V& v) {
    auto s = split(v[0], {2, 3}, 0);
    return cat({square(s[1]), s[0]}, 0);
  });
  def("split_one_output_used", {rn({3, 5}, 123)}, kSmooth, [](const V& v) {
    return square(split(v[0], {1, 2, 2}, 1)[1]);
  });
  def("chunk_some_outputs_used", {rn({6, 2}, 124)}, kSmooth, [](const V& v) {
    auto ch = chunk(v[0], 3, 0);
    return mul(ch[0], ch[2]);
  });

  // ---- views ----
  def("reshape", {rn({2, 6}, 125)}, kSmooth, [](const V& v) {
    return square(v[0].reshape({3, 4}));
  });
  def("reshape_of_transposed_copies", {rn({2, 6}, 126)}, kSmooth, [](const V& v) {
    return square(v[0].transpose(0, 1).reshape({3, 4}));
  });
  def("view_flatten", {rn({2, 3, 2}, 127)}, kSmooth, [](const V& v) {
    return square(v[0].view({-1, 2}).flatten());
  });
  def("transpose", {rn({2, 3, 4}, 128)}, kSmooth,
      [](const V& v) { return square(v[0].transpose(0, 2)); });
  def("permute", {rn({2, 3, 4}, 129)}, kSmooth, [](const V& v) {
    return square(v[0].permute({2, 0, 1}));
  });
  def("slice_with_step", {rn({3, 8}, 130)}, kSmooth,
      [](const V& v) { return square(v[0].slice(1, 1, 7, 2)); });
  def("slice_negative_bounds", {rn({6, 2}, 131)}, kSmooth,
      [](const V& v) { return square(v[0].slice(0, -5, -1, 3)); });
  def("narrow", {rn({4, 5}, 132)}, kSmooth,
      [](const V& v) { return square(v[0].narrow(1, 1, 3)); });
  def("expand", {rn({3, 1}, 133)}, kSmooth, [](const V& v) {
    return square(v[0].expand({2, 3, 4}));
  });
  def("unsqueeze_squeeze", {rn({3, 4}, 134)}, kSmooth,
      [](const V& v) { return square(v[0].unsqueeze(1).squeeze(-1).squeeze(1)); });
  def("contiguous_and_clone", {rn({3, 4}, 135)}, kSmooth,
      [](const V& v) { return square(v[0].transpose(0, 1).contiguous().clone()); });
  return c;
}

class OpGradcheck : public ::testing::TestWithParam<OpCase> {};

TEST_P(OpGradcheck, AnalyticGradientMatchesFiniteDifferences) {
  const OpCase& c = GetParam();
  auto r = gradcheck(c.fn, c.make_inputs(), c.opt);
  EXPECT_TRUE(r.ok) << r.report;
  EXPECT_GT(r.checked, 0);
  RecordProperty("worst_error_over_tolerance", std::to_string(r.worst_ratio));
}

// The same op on meta tensors: no data, the same output shape and dtype as on the cpu, and a
// backward with a meta gradient gives meta gradients of the inputs' shapes.
TEST_P(OpGradcheck, RunsOnMetaTensorsWithMetaGradients) {
  const OpCase& c = GetParam();
  const std::vector<Tensor> cpu = c.make_inputs();
  const std::vector<bool> wrt = test::detail::resolve_wrt(cpu, c.opt.wrt);
  Tensor expected;
  {
    NoGradGuard ng;
    expected = c.fn(cpu);
  }
  std::vector<Tensor> meta;
  for (size_t i = 0; i < cpu.size(); ++i) {
    meta.push_back(empty(cpu[i].shape(), {cpu[i].dtype(), Device::kMeta, false}));
    if (wrt[i]) meta.back().set_requires_grad(true);
  }
  Tensor y = c.fn(meta);
  ASSERT_TRUE(y.is_meta());
  EXPECT_EQ(y.shape(), expected.shape());
  EXPECT_EQ(y.dtype(), expected.dtype());
  ASSERT_TRUE(y.requires_grad());
  y.backward(empty(y.shape(), {DType::kFloat32, Device::kMeta, false}));
  for (size_t i = 0; i < meta.size(); ++i) {
    if (!wrt[i]) continue;
    Tensor g = meta[i].grad();
    ASSERT_TRUE(g.defined()) << "input " << i;
    EXPECT_TRUE(g.is_meta()) << "input " << i;
    EXPECT_EQ(g.shape(), cpu[i].shape()) << "input " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, OpGradcheck, ::testing::ValuesIn(op_cases()),
                         [](const ::testing::TestParamInfo<OpCase>& info) {
                           return info.param.name;
                         });

// ---------------------------------------------------------------------------------------------
// the harness can fail

// y = x * x with a backward of factor * 2x, or with element `drop` of the gradient zeroed.
Tensor square_with_bad_backward(const Tensor& x, double factor, int64_t drop = -1) {
  Tensor out;
  {
    NoGradGuard ng;
    out = square(x.detach());
  }
  autograd::record_op(
      "BadSquareBackward", {x}, {out},
      [x = x.detach(), factor, drop](const std::vector<Tensor>& g, const std::vector<bool>&) {
        Tensor d = scale(mul(g[0], x), 2.0 * factor).contiguous();
        if (drop >= 0) d.data<float>()[drop] = 0.f;
        return std::vector<Tensor>{d};
      });
  return out;
}

TEST(Gradcheck, AcceptsACorrectCustomBackward) {
  auto r =
      gradcheck([](const std::vector<Tensor>& v) { return square_with_bad_backward(v[0], 1.0); },
                {randn_t({3, 4}, 200)});
  EXPECT_TRUE(r.ok) << r.report;
  EXPECT_EQ(r.checked, 12);
  EXPECT_LT(r.worst_ratio, 0.1);  // a correct gradient sits far inside the tolerance
}

TEST(Gradcheck, ReportsABackwardOffByTwoPercent) {
  auto r =
      gradcheck([](const std::vector<Tensor>& v) { return square_with_bad_backward(v[0], 1.02); },
                {away_from_zero({3, 4}, 201)});
  EXPECT_FALSE(r.ok);
  EXPECT_GT(r.mismatches, 0);
  EXPECT_NE(r.report.find("analytic"), std::string::npos) << r.report;
}

TEST(Gradcheck, ReportsExactlyTheOneWrongElement) {
  auto r =
      gradcheck([](const std::vector<Tensor>& v) { return square_with_bad_backward(v[0], 1.0, 5); },
                {away_from_zero({3, 4}, 202)});
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(r.mismatches, 1);
  EXPECT_NE(r.report.find("element 5"), std::string::npos) << r.report;
}

TEST(Gradcheck, ReportsAMissingGradient) {
  // b's gradient never flows: the op records only a.
  auto f = [](const std::vector<Tensor>& v) {
    Tensor out;
    {
      NoGradGuard ng;
      out = mul(v[0].detach(), v[1].detach());
    }
    autograd::record_op(
        "HalfMulBackward", {v[0]}, {out},
        [b = v[1].detach()](const std::vector<Tensor>& g, const std::vector<bool>&) {
          return std::vector<Tensor>{mul(g[0], b)};
        });
    return out;
  };
  auto r = gradcheck(f, {randn_t({4}, 203), away_from_zero({4}, 204)});
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(r.mismatches, 4);  // the four elements of b
  EXPECT_NE(r.report.find("input 1"), std::string::npos) << r.report;
}

TEST(Gradcheck, ReportsAForwardThatDependsOnGradMode) {
  auto f = [](const std::vector<Tensor>& v) {
    return GradMode::is_enabled() ? scale(v[0], 2.0) : scale(v[0], 2.5);
  };
  auto r = gradcheck(f, {randn_t({3}, 205)});
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.report.find("grad mode"), std::string::npos) << r.report;
}

TEST(Gradcheck, SubsetKeepsFirstAndLastElementAndIsDeterministic) {
  auto a = test::detail::pick_elements(1000, 16, 7), b = test::detail::pick_elements(1000, 16, 7);
  ASSERT_EQ(a.size(), 16u);
  EXPECT_EQ(a, b);
  EXPECT_EQ(a.front(), 0);
  EXPECT_EQ(a.back(), 999);
  EXPECT_TRUE(std::adjacent_find(a.begin(), a.end()) == a.end());  // no repeats (sorted)
  EXPECT_EQ(test::detail::pick_elements(5, 16, 7).size(), 5u);
}

// ---------------------------------------------------------------------------------------------
// forward values against closed forms and references

void expect_values(const Tensor& t, const std::vector<float>& want, double tol) {
  auto got = t.to_vector<float>();
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], tol) << "element " << i;
}

TEST(OpValues, SoftmaxSumsToOneAlongItsDimension) {
  Tensor x = randn_t({2, 5, 3}, 300, 3.0);
  for (int64_t dim : {0, 1, 2, -1}) {
    Tensor s = sum(softmax(x, dim), dim);
    for (float v : s.to_vector<float>()) EXPECT_NEAR(v, 1.f, 1e-6) << "dim " << dim;
    Tensor ls = sum(exp(log_softmax(x, dim)), dim);
    for (float v : ls.to_vector<float>()) EXPECT_NEAR(v, 1.f, 1e-6) << "dim " << dim;
  }
  // Large logits do not overflow (max subtraction).
  expect_values(softmax(from_vector({1000.f, 1000.f}, {2})), {0.5f, 0.5f}, 1e-7);
  expect_values(log_softmax(from_vector({0.f, 0.f, 0.f, 0.f}, {4})),
                std::vector<float>(4, -std::log(4.f)), 1e-6);
}

TEST(OpValues, ActivationsMatchClosedForms) {
  Tensor x = from_vector({0.f, 1.f, -1.f, 10.f}, {4});
  // gelu(1) = 0.5 (1 + erf(1/sqrt2)) = 0.8413447; tanh approximation 0.8411920.
  expect_values(gelu(x, GeluApprox::kNone), {0.f, 0.8413447f, -0.1586553f, 10.f}, 1e-6);
  expect_values(gelu(x, GeluApprox::kTanh), {0.f, 0.8411920f, -0.1588080f, 10.f}, 1e-6);
  expect_values(silu(x), {0.f, 0.7310586f, -0.2689414f, 9.999546f}, 1e-5);
  expect_values(relu(x), {0.f, 1.f, 0.f, 10.f}, 0);
  expect_values(swiglu(x, full({4}, 2.0)), {0.f, 1.4621172f, -0.5378828f, 19.999092f}, 1e-4);
  expect_values(tanh(x), {0.f, std::tanh(1.f), -std::tanh(1.f), 1.f}, 1e-6);
  expect_values(exp(x), {1.f, std::exp(1.f), std::exp(-1.f), std::exp(10.f)}, 1e-2);
  expect_values(log(from_vector({1.f, std::exp(2.f)}, {2})), {0.f, 2.f}, 1e-6);
}

TEST(OpValues, BroadcastingArithmetic) {
  Tensor a = from_vector({1.f, 2.f, 3.f, 4.f, 5.f, 6.f}, {2, 1, 3});
  Tensor b = from_vector({10.f, 20.f}, {2, 1});
  Tensor y = add(a, b);  // (2,2,3)
  EXPECT_EQ(y.shape(), (Shape{2, 2, 3}));
  expect_values(y, {11, 12, 13, 21, 22, 23, 14, 15, 16, 24, 25, 26}, 0);
  expect_values(div(a, b),
                {0.1f, 0.2f, 0.3f, 0.05f, 0.1f, 0.15f, 0.4f, 0.5f, 0.6f, 0.2f, 0.25f, 0.3f}, 1e-7);
  expect_values(sub(scalar_tensor(1.0), from_vector({1.f, 2.f}, {2})), {0.f, -1.f}, 0);
}

TEST(OpValues, MatmulAndLinearMatchBroadcastReference) {
  // Reference: (..., M, K, 1) * (..., 1, K, N) summed over K.
  auto ref_mm = [](const std::vector<Tensor>& v) {
    return sum(mul(v[0].unsqueeze(-1), v[1].unsqueeze(-3)), -2);
  };
  auto mm = [](const std::vector<Tensor>& v) { return matmul(v[0], v[1]); };
  for (auto [sa, sb] : std::vector<std::pair<Shape, Shape>>{
           {{3, 4}, {4, 5}}, {{2, 3, 4}, {4, 5}}, {{2, 2, 3, 4}, {2, 2, 4, 5}}}) {
    auto r = compare_with_reference(mm, ref_mm, {randn_t(sa, 301), randn_t(sb, 302)});
    EXPECT_TRUE(r.report.empty()) << r.report;
    EXPECT_LT(r.forward_err, 1e-5) << to_string(sa);
    EXPECT_LT(test::max_grad_err(r), 1e-5) << to_string(sa);
  }
  auto lin = [](const std::vector<Tensor>& v) { return linear(v[0], v[1], v[2]); };
  auto ref_lin = [&](const std::vector<Tensor>& v) {
    return add(ref_mm({v[0], v[1].transpose(0, 1)}), v[2]);
  };
  auto r = compare_with_reference(
      lin, ref_lin, {randn_t({2, 3, 4}, 303), randn_t({5, 4}, 304), randn_t({5}, 305)});
  EXPECT_LT(r.forward_err, 1e-5);
  EXPECT_LT(test::max_grad_err(r), 1e-5);
}

TEST(OpValues, LayerNormWithUnitWeightHasZeroMeanUnitVariance) {
  Tensor x = randn_t({4, 64}, 306, 3.0, 2.0);
  Tensor y = layer_norm(x, ones({64}), zeros({64}), 1e-12);
  Tensor m = mean(y, -1);
  Tensor var = mean(square(y), -1);
  for (float v : m.to_vector<float>()) EXPECT_NEAR(v, 0.f, 1e-6);
  for (float v : var.to_vector<float>()) EXPECT_NEAR(v, 1.f, 1e-5);
  // Bias shifts, weight scales.
  Tensor yb = layer_norm(x, full({64}, 2.0), full({64}, 0.5), 1e-12);
  EXPECT_LT(max_abs_diff(yb, add_scalar(scale(y, 2.0), 0.5)), 1e-5);
  EXPECT_LT(max_abs_diff(layer_norm(x, full({64}, 2.0), Tensor(), 1e-12), scale(y, 2.0)), 1e-5);
  // rms_norm: unit mean square.
  Tensor r = rms_norm(x, ones({64}), 1e-12);
  for (float v : mean(square(r), -1).to_vector<float>()) EXPECT_NEAR(v, 1.f, 1e-5);
}

TEST(OpValues, RotaryIsIdentityAtPositionZeroAndPreservesPairNorms) {
  const int64_t HS = 8, T = 6;
  auto [cos, sin] = rope_cache(T, HS, 10000.0);
  Tensor x = randn_t({1, 2, T, HS}, 307);
  Tensor y = rotary_embedding(x, cos, sin);
  EXPECT_LT(max_abs_diff(y.narrow(2, 0, 1), x.narrow(2, 0, 1)), 1e-7);
  // Each (i, i + HS/2) pair is rotated: its norm is unchanged.
  auto pair_norms = [&](const Tensor& t) {
    Tensor lo = t.narrow(3, 0, HS / 2), hi = t.narrow(3, HS / 2, HS / 2);
    return add(square(lo), square(hi));
  };
  EXPECT_LT(max_abs_diff(pair_norms(y), pair_norms(x)), 1e-5);
  // Position 1, frequency 0 (inv_freq = 1): a rotation by 1 radian.
  const float x0 = x.to_vector<float>()[HS], xh = x.to_vector<float>()[HS + HS / 2];
  EXPECT_NEAR(y.to_vector<float>()[HS], x0 * std::cos(1.f) - xh * std::sin(1.f), 1e-6);
}

TEST(OpValues, EmbeddingPicksRowsAndCrossEntropyMatchesLogSoftmax) {
  Tensor w = randn_t({4, 3}, 308);
  Tensor e = embedding(i32({3, 0}, {2}), w);
  expect_values(e.narrow(0, 0, 1), w.narrow(0, 3, 1).to_vector<float>(), 0);
  expect_values(e.narrow(0, 1, 1), w.narrow(0, 0, 1).to_vector<float>(), 0);

  Tensor logits = randn_t({3, 5}, 309, 2.0);
  Tensor ls = log_softmax(logits, -1);
  auto lv = ls.to_vector<float>();
  // Targets 4, ignored, 1: mean over the two counted rows.
  const double want = -(lv[0 * 5 + 4] + lv[2 * 5 + 1]) / 2.0;
  EXPECT_NEAR(cross_entropy(logits, i64({4, -100, 1}, {3})).item(), want, 1e-6);
  EXPECT_NEAR(cross_entropy(logits, i32({4, 7, 1}, {3}), 7).item(), want, 1e-6);
}

// Rows of 77 classes start at every alignment, so each row's gradient is written partly with
// ordinary stores (up to the first vector-aligned element and after the last whole vector) and
// partly with streaming stores; the targets fall in each of those parts.
TEST(OpValues, CrossEntropyGradientIsSoftmaxMinusOneHotAtAnyRowAlignment) {
  const int64_t N = 8, V = 77;
  Tensor logits = randn_t({N, V}, 310, 2.0);
  logits.set_requires_grad(true);
  const std::vector<int64_t> t{0, 3, 40, 76, 10, -100, 64, 75};
  cross_entropy(logits, i64(t, {N})).backward();
  const auto x = logits.to_vector<float>(), g = logits.grad().to_vector<float>();
  const double count = 7;  // one row ignored
  for (int64_t n = 0; n < N; ++n) {
    double mx = -1e300, z = 0;
    for (int64_t i = 0; i < V; ++i) mx = std::max<double>(mx, x[n * V + i]);
    for (int64_t i = 0; i < V; ++i) z += std::exp(x[n * V + i] - mx);
    for (int64_t i = 0; i < V; ++i) {
      const double p = std::exp(x[n * V + i] - mx) / z;
      const double want = t[n] == -100 ? 0.0 : (p - (i == t[n] ? 1.0 : 0.0)) / count;
      ASSERT_NEAR(g[n * V + i], want, 1e-7) << "row " << n << " class " << i;
    }
  }
}

// Padded rows here: x and the incoming gradient are views whose rows lie further apart than their
// width (a narrowed tensor); linear hands them to sgemm with that row stride.
TEST(OpValues, LinearTakesPaddedRowsWithoutChangingResults) {
  const int64_t R = 70, IN = 24, OUT = 40;
  Tensor w = randn_t({OUT, IN}, 314), b = randn_t({OUT}, 315);
  Tensor dy = randn_t({2, R / 2, OUT}, 316);
  // Reference: contiguous input, contiguous gradient.
  Tensor x = randn_t({2, R / 2, IN}, 317);
  auto run = [&](const Tensor& xin, const Tensor& g) {
    Tensor xl = xin.detach(), wl = w.detach(), bl = b.detach();
    xl.set_requires_grad(true);
    wl.set_requires_grad(true);
    bl.set_requires_grad(true);
    Tensor y = linear(xl, wl, bl);
    y.backward(g);
    return std::vector<std::vector<float>>{y.to_vector<float>(), xl.grad().to_vector<float>(),
                                           wl.grad().to_vector<float>(),
                                           bl.grad().to_vector<float>()};
  };
  const auto want = run(x, dy);
  // The same values in buffers whose rows are 7 floats longer (x) and 5 longer (the gradient).
  Tensor xp = empty({R, IN + 7}).narrow(1, 0, IN).view({2, R / 2, IN});
  Tensor dyp = empty({R, OUT + 5}).narrow(1, 0, OUT).view({2, R / 2, OUT});
  {
    NoGradGuard ng;
    xp.copy_(x);
    dyp.copy_(dy);
  }
  ASSERT_FALSE(xp.is_contiguous());
  ASSERT_FALSE(dyp.is_contiguous());
  const auto got = run(xp, dyp);
  // Another row stride is another GEMM layout: OpenBLAS may block or dispatch it differently (it
  // does on AMD EPYC), so the sums of <= 70 products of O(1) values may round differently, by
  // ~1e-6. A row stride the kernels ignore reads the wrong rows (errors of O(1)), far above this
  // tolerance.
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(got[i].size(), want[i].size()) << "output " << i;
    for (size_t j = 0; j < want[i].size(); ++j) {
      ASSERT_NEAR(got[i][j], want[i][j], 1e-4 * (1.0 + std::abs(want[i][j])))
          << "output " << i << ", element " << j;
    }
  }
  // Every other row block of a larger tensor (x[:, ::2]): a size-1 dimension whose stride does
  // not step over whole rows must not pass for one row stride. Such an x is copied to a
  // contiguous tensor, so the GEMMs see the reference's layout and the results are equal bit for
  // bit by construction.
  Tensor big = empty({2, 2, R / 2, IN});
  {
    NoGradGuard ng;
    big.narrow(1, 0, 1).copy_(x.view({2, 1, R / 2, IN}));
    big.narrow(1, 1, 1).fill_(7.0);
  }
  const auto sliced = run(big.slice(1, 0, 2, 2), dy.view({2, 1, R / 2, OUT}));
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(sliced[i], want[i]) << "output " << i;
}

TEST(OpValues, SumMeanCatSplitValues) {
  Tensor x = from_vector({1.f, 2.f, 3.f, 4.f, 5.f, 6.f}, {2, 3});
  EXPECT_EQ(sum(x).item(), 21.0);
  EXPECT_EQ(mean(x).item(), 3.5);
  expect_values(sum(x, 0), {5, 7, 9}, 0);
  EXPECT_EQ(sum(x, 1, true).shape(), (Shape{2, 1}));
  expect_values(mean(x, 1), {2, 5}, 0);
  expect_values(cat({x, x.narrow(1, 0, 1)}, 1), {1, 2, 3, 1, 4, 5, 6, 4}, 0);
  auto parts = split(x, {1, 2}, 1);
  ASSERT_EQ(parts.size(), 2u);
  expect_values(parts[1], {2, 3, 5, 6}, 0);
  auto ch = chunk(x, 2, 0);
  expect_values(ch[1], {4, 5, 6}, 0);
  // A 0-d tensor reduces over its only "dimension" to itself, as in PyTorch.
  EXPECT_EQ(sum(scalar_tensor(3.0), 0).item(), 3.0);
  EXPECT_EQ(mean(scalar_tensor(3.0), -1).item(), 3.0);
}

TEST(OpValues, TransposeOfA0dTensorIsItself) {
  // As in PyTorch, dimensions 0 and -1 of a 0-d tensor may be named; nothing moves.
  Tensor s = scalar_tensor(2.0, {.requires_grad = true});
  Tensor t = s.transpose(0, -1);
  EXPECT_EQ(t.dim(), 0);
  EXPECT_EQ(t.item(), 2.0);
  scale(t, 3.0).backward();
  EXPECT_EQ(s.grad().item(), 3.0);
  EXPECT_THROW(s.transpose(0, 1), ShapeError);
}

TEST(OpValues, AttentionWithOneKeyReturnsTheValue) {
  Tensor q = randn_t({1, 2, 1, 4}, 310), k = randn_t({1, 1, 1, 4}, 311),
         v = randn_t({1, 1, 1, 4}, 312);
  Tensor y = scaled_dot_product_attention(q, k, v, true);
  EXPECT_LT(max_abs_diff(y, v.expand({1, 2, 1, 4})), 1e-7);
  // Uniform scores (q = 0): the output is the running mean of the values.
  Tensor vals = randn_t({1, 1, 3, 2}, 313);
  Tensor y0 = scaled_dot_product_attention(zeros({1, 1, 3, 2}), randn_t({1, 1, 3, 2}, 314), vals);
  auto vv = vals.to_vector<float>();
  expect_values(y0.narrow(2, 2, 1), {(vv[0] + vv[2] + vv[4]) / 3, (vv[1] + vv[3] + vv[5]) / 3},
                1e-6);
}

// ---------------------------------------------------------------------------------------------
// dropout: the mask is the generator's uniform draw thresholded at p

TEST(Dropout, MatchesMaskRecomputedFromTheGenerator) {
  const double p = 0.25;
  Tensor x = randn_t({8, 16}, 400);
  x.set_requires_grad(true);
  Generator gen(77);
  Tensor y = dropout(x, p, true, gen);
  Generator replay(77);
  auto u = rand({8, 16}, replay).to_vector<float>();
  auto xv = x.to_vector<float>(), yv = y.to_vector<float>();
  const float keep = static_cast<float>(1.0 / (1.0 - p));
  int dropped = 0;
  for (size_t i = 0; i < u.size(); ++i) {
    const bool drop = u[i] < static_cast<float>(p);
    dropped += drop;
    EXPECT_EQ(yv[i], drop ? 0.f : xv[i] * keep) << "element " << i;
  }
  EXPECT_GT(dropped, 16);  // ~32 of 128 expected
  EXPECT_LT(dropped, 52);
  EXPECT_EQ(gen.offset(), replay.offset());  // the op consumed exactly one draw
  // The gradient is the same mask.
  Tensor R = randn_t({8, 16}, 401);
  y.backward(R);
  auto gv = x.grad().to_vector<float>(), rv = R.to_vector<float>();
  for (size_t i = 0; i < u.size(); ++i) {
    EXPECT_EQ(gv[i], u[i] < static_cast<float>(p) ? 0.f : rv[i] * keep) << "element " << i;
  }
}

TEST(Dropout, IsTheIdentityWhenPIsZeroOrInEval) {
  Tensor x = randn_t({4, 4}, 402);
  Generator gen(1);
  EXPECT_TRUE(dropout(x, 0.0, true, gen).is_same(x));
  EXPECT_TRUE(dropout(x, 0.9, false, gen).is_same(x));
  EXPECT_EQ(gen.offset(), 0u);  // no randomness consumed
  Generator a(5), b(5);
  EXPECT_EQ(dropout(x, 0.5, true, a).to_vector<float>(),
            dropout(x, 0.5, true, b).to_vector<float>());
}

// ---------------------------------------------------------------------------------------------
// thread-count independence of the kernels whose reductions are split across threads. Equal bit
// for bit by construction: these kernels (no GEMM among them) split their reductions into chunks
// of a fixed size, or embedding's among vocabulary rows, and combine them in a fixed order, so
// the thread count changes who adds, never what is added in which order.

struct Grads {
  std::vector<float> loss, dx, dw, dtable;
};

Grads run_reductions(int threads) {
  set_num_threads(threads);
  EXPECT_EQ(get_num_threads(), threads);
  Generator gen(604);
  Tensor idx = randint(0, 300, {4096}, gen), targets = randint(0, 64, {4096}, gen);
  Tensor x = randn_t({4096, 64}, 600), table = randn_t({300, 64}, 601);
  Tensor w = randn_t({64}, 602, 0.5, 1.0), b = randn_t({64}, 603);
  for (Tensor* t : {&x, &w, &b, &table}) t->set_requires_grad(true);
  // embedding_backward partitions the vocabulary among threads when N*C >= 2^16; layer_norm and
  // rms_norm reduce dw/db over row chunks; cross_entropy runs rows in parallel.
  Tensor h = add(layer_norm(x, w, b), embedding(idx, table));
  Tensor loss = cross_entropy(rms_norm(h, w), targets);
  loss.backward();
  return {loss.to_vector<float>(), x.grad().to_vector<float>(), w.grad().to_vector<float>(),
          table.grad().to_vector<float>()};
}

TEST(ThreadCount, NormEmbeddingAndLossGradientsAreIdenticalWithOneAndTwoThreads) {
  const int prev = get_num_threads();
  const Grads one = run_reductions(1);
  const Grads two = run_reductions(2);
  set_num_threads(prev);
  EXPECT_EQ(one.loss, two.loss);
  EXPECT_EQ(one.dx, two.dx);
  EXPECT_EQ(one.dw, two.dw);
  EXPECT_EQ(one.dtable, two.dtable);
  EXPECT_FALSE(one.dtable.empty());
}

// ---------------------------------------------------------------------------------------------
// dtype round trip

TEST(CastGradient, Bf16RoundTripPassesTheGradientRoundedToBf16) {
  // d/dx of x.to(bf16).to(f32) is a cast of the gradient through bf16 (as in PyTorch); the
  // forward is piecewise constant, so finite differences do not apply.
  Tensor x = randn_t({3, 5}, 500);
  x.set_requires_grad(true);
  Tensor y = x.to(DType::kBFloat16).to(DType::kFloat32);
  EXPECT_EQ(y.dtype(), DType::kFloat32);
  auto xv = x.to_vector<float>(), yv = y.to_vector<float>();
  for (size_t i = 0; i < xv.size(); ++i) {
    EXPECT_EQ(yv[i], static_cast<float>(BFloat16(xv[i])));
    EXPECT_NEAR(yv[i], xv[i], std::abs(xv[i]) * 4e-3);
  }
  Tensor R = randn_t({3, 5}, 501);
  y.backward(R);
  ASSERT_TRUE(x.grad().defined());
  EXPECT_EQ(x.grad().dtype(), DType::kFloat32);
  auto gv = x.grad().to_vector<float>(), rv = R.to_vector<float>();
  for (size_t i = 0; i < gv.size(); ++i) EXPECT_EQ(gv[i], static_cast<float>(BFloat16(rv[i])));
  // Through a real op downstream: d sum(2 * cast(x)) / dx = 2 exactly (representable).
  Tensor x2 = randn_t({4}, 502);
  x2.set_requires_grad(true);
  sum(scale(x2.to(DType::kBFloat16).to(DType::kFloat32), 2.0)).backward();
  expect_values(x2.grad(), {2, 2, 2, 2}, 0);
}

// ---------------------------------------------------------------------------------------------
// a whole block on meta tensors

TEST(MetaGraph, TransformerBlockBackwardGivesMetaGradientsOfTheRightShapes) {
  const int64_t B = 2, T = 1024, C = 64, NH = 4, NKV = 2, HS = C / NH, V = 50000;
  const TensorOptions meta{DType::kFloat32, Device::kMeta, true};
  Tensor wte = empty({V, C}, meta), ln_w = empty({C}, meta), ln_b = empty({C}, meta);
  Tensor w_qkv = empty({(NH + 2 * NKV) * HS, C}, meta), w_o = empty({C, C}, meta);
  Tensor w_up = empty({2 * 4 * C, C}, meta), w_down = empty({C, 4 * C}, meta);
  Tensor idx = empty({B, T}, {DType::kInt64, Device::kMeta, false});
  Tensor targets = empty({B, T}, {DType::kInt32, Device::kMeta, false});

  Tensor h = embedding(idx, wte);                         // (B,T,C)
  Tensor qkv = linear(layer_norm(h, ln_w, ln_b), w_qkv);  // (B,T,(NH+2NKV)HS)
  auto parts = split(qkv.view({B, T, NH + 2 * NKV, HS}), {NH, NKV, NKV}, 2);
  auto [cos, sin] = rope_cache(T, HS, 10000.0, Device::kMeta);
  Tensor q = rotary_embedding(parts[0].transpose(1, 2), cos, sin);
  Tensor k = rotary_embedding(parts[1].transpose(1, 2), cos, sin);
  Tensor att = scaled_dot_product_attention(q, k, parts[2].transpose(1, 2), true);
  h = add(h, linear(att.transpose(1, 2).reshape({B, T, C}), w_o));
  auto gu = chunk(linear(rms_norm(h, ln_w), w_up), 2, -1);
  h = add(h, dropout(linear(swiglu(gu[0], gu[1]), w_down), 0.1, true));
  Tensor logits = matmul(h, wte.transpose(0, 1));  // (B,T,V)
  Tensor loss = cross_entropy(logits, targets);
  ASSERT_TRUE(loss.is_meta());
  EXPECT_EQ(loss.dim(), 0);
  EXPECT_EQ(logits.shape(), (Shape{B, T, V}));

  loss.backward(empty({}, {DType::kFloat32, Device::kMeta, false}));
  for (const Tensor& p : {wte, ln_w, ln_b, w_qkv, w_o, w_up, w_down}) {
    ASSERT_TRUE(p.grad().defined()) << to_string(p.shape());
    EXPECT_TRUE(p.grad().is_meta());
    EXPECT_EQ(p.grad().shape(), p.shape());
  }
}

}  // namespace
}  // namespace acc

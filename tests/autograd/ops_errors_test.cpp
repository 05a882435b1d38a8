// Table-driven negative tests: every op given bad shapes, dtypes, devices (meta mixed with cpu),
// arguments or undefined tensors throws the documented acc::Error subclass, and the message
// carries the offending values (lower case, no trailing period).

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "acc/autograd/ops.hpp"
#include "acc/util/error.hpp"

namespace acc {
namespace {

enum class Err { kShape, kType, kValue };

const char* err_name(Err e) {
  switch (e) {
    case Err::kShape:
      return "ShapeError";
    case Err::kType:
      return "TypeError";
    case Err::kValue:
      return "ValueError";
  }
  return "?";
}

struct ErrorCase {
  std::string name;
  Err type;
  std::vector<std::string> substrings;  // each must appear in what()
  std::function<void()> run;
};

void PrintTo(const ErrorCase& c, std::ostream* os) {
  *os << c.name;
}

Tensor f32(Shape s) {
  return zeros(std::move(s));
}
Tensor bf16(Shape s) {
  return zeros(std::move(s), {DType::kBFloat16, Device::kCPU, false});
}
Tensor meta(Shape s) {
  return empty(std::move(s), {DType::kFloat32, Device::kMeta, false});
}
Tensor i64(std::vector<int64_t> v) {
  const int64_t n = static_cast<int64_t>(v.size());
  return from_vector(v, {n});
}
Tensor i32(std::vector<int32_t> v) {
  const int64_t n = static_cast<int64_t>(v.size());
  return from_vector(v, {n});
}

std::vector<ErrorCase> error_cases() {
  const Tensor U;  // undefined
  std::vector<ErrorCase> c;
  auto add_case = [&](std::string name, Err type, std::vector<std::string> subs,
                      std::function<void()> run) {
    c.push_back({std::move(name), type, std::move(subs), std::move(run)});
  };

  // ---- elementwise ----
  add_case("add_shapes_do_not_broadcast", Err::kShape, {"[2, 3]", "[4]"}, [] {
    add(f32({2, 3}), f32({4}));
  });
  add_case("mul_shapes_do_not_broadcast", Err::kShape, {"[2, 3, 4]", "[3, 3]"}, [] {
    mul(f32({2, 3, 4}), f32({3, 3}));
  });
  add_case("add_bf16", Err::kType, {"add", "bf16"}, [] { add(bf16({2}), f32({2})); });
  add_case("div_i64", Err::kType, {"div", "i64"}, [] { div(f32({2}), i64({1, 2})); });
  add_case("sub_meta_and_cpu", Err::kType, {"sub", "different devices", "cpu", "meta"},
           [] { sub(f32({2}), meta({2})); });
  add_case("add_undefined", Err::kValue, {"add", "undefined"}, [=] { add(U, f32({2})); });
  add_case("exp_bf16", Err::kType, {"exp", "bf16"}, [] { exp(bf16({2})); });
  add_case("scale_undefined", Err::kValue, {"scale", "undefined"}, [=] { scale(U, 2.0); });
  add_case("square_i32", Err::kType, {"square", "i32"}, [] { square(i32({1})); });

  // ---- matmul / linear ----
  add_case("matmul_inner_mismatch", Err::kShape, {"[2, 3] @ [4, 5]"}, [] {
    matmul(f32({2, 3}), f32({4, 5}));
  });
  add_case("matmul_batch_mismatch", Err::kShape, {"[2, 3, 4] @ [3, 4, 5]"}, [] {
    matmul(f32({2, 3, 4}), f32({3, 4, 5}));
  });
  add_case("matmul_batch_rank_mismatch", Err::kShape, {"[2, 2, 3, 4] @ [2, 4, 5]"}, [] {
    matmul(f32({2, 2, 3, 4}), f32({2, 4, 5}));
  });
  add_case("matmul_1d", Err::kShape, {"[3]"}, [] { matmul(f32({3}), f32({3, 2})); });
  add_case("matmul_bf16", Err::kType, {"matmul", "bf16"}, [] {
    matmul(f32({2, 2}), bf16({2, 2}));
  });
  add_case("matmul_meta_and_cpu", Err::kType, {"matmul", "different devices"}, [] {
    matmul(meta({2, 2}), f32({2, 2}));
  });
  add_case("matmul_undefined", Err::kValue, {"matmul", "undefined"}, [=] {
    matmul(f32({2, 2}), U);
  });
  add_case("linear_weight_mismatch", Err::kShape, {"[2, 3]", "[5, 4]"}, [] {
    linear(f32({2, 3}), f32({5, 4}));
  });
  add_case("linear_bias_mismatch", Err::kShape, {"bias [4]", "[5, 4]"}, [] {
    linear(f32({2, 4}), f32({5, 4}), f32({4}));
  });
  add_case("linear_weight_not_2d", Err::kShape, {"[4]"}, [] { linear(f32({2, 4}), f32({4})); });
  add_case("linear_bias_bf16", Err::kType, {"linear", "bias", "bf16"}, [] {
    linear(f32({2, 4}), f32({5, 4}), bf16({5}));
  });
  add_case("linear_bias_meta", Err::kType, {"linear", "different devices"}, [] {
    linear(f32({2, 4}), f32({5, 4}), meta({5}));
  });
  add_case("linear_undefined_weight", Err::kValue, {"linear", "weight", "undefined"}, [=] {
    linear(f32({2, 4}), U);
  });

  // ---- activations ----
  add_case("gelu_bf16", Err::kType, {"gelu", "bf16"}, [] { gelu(bf16({3})); });
  add_case("silu_undefined", Err::kValue, {"silu", "undefined"}, [=] { silu(U); });
  add_case("relu_i64", Err::kType, {"relu", "i64"}, [] { relu(i64({1})); });
  add_case("swiglu_shape_mismatch", Err::kShape, {"[2, 3]", "[2, 4]"}, [] {
    swiglu(f32({2, 3}), f32({2, 4}));
  });
  add_case("swiglu_meta_and_cpu", Err::kType, {"swiglu", "different devices"},
           [] { swiglu(f32({2}), meta({2})); });
  add_case("dropout_p_one", Err::kValue, {"dropout", "got 1"},
           [] { dropout(f32({2}), 1.0, true); });
  add_case("dropout_p_negative", Err::kValue, {"dropout", "-0.1"},
           [] { dropout(f32({2}), -0.1, true); });
  add_case("dropout_p_nan", Err::kValue, {"dropout", "nan"},
           [] { dropout(f32({2}), std::numeric_limits<double>::quiet_NaN(), true); });
  add_case("dropout_p_checked_in_eval_too", Err::kValue, {"dropout", "1.5"},
           [] { dropout(f32({2}), 1.5, false); });
  add_case("dropout_bf16", Err::kType, {"dropout", "bf16"}, [] { dropout(bf16({2}), 0.1, true); });

  // ---- normalisation and softmax ----
  add_case("layer_norm_weight_size", Err::kShape, {"weight [4]", "[2, 8]"}, [=] {
    layer_norm(f32({2, 8}), f32({4}), U);
  });
  add_case("layer_norm_bias_size", Err::kShape, {"bias [7]", "[2, 8]"}, [] {
    layer_norm(f32({2, 8}), f32({8}), f32({7}));
  });
  add_case("layer_norm_eps_zero", Err::kValue, {"eps", "0"}, [] {
    layer_norm(f32({2, 8}), f32({8}), f32({8}), 0.0);
  });
  add_case("layer_norm_bf16", Err::kType, {"layer_norm", "bf16"}, [] {
    layer_norm(bf16({2, 8}), f32({8}), f32({8}));
  });
  add_case("layer_norm_weight_meta", Err::kType, {"layer_norm", "different devices"}, [] {
    layer_norm(f32({2, 8}), meta({8}), f32({8}));
  });
  add_case("layer_norm_undefined_weight", Err::kValue, {"layer_norm", "weight", "undefined"}, [=] {
    layer_norm(f32({2, 8}), U, U);
  });
  add_case("layer_norm_0d_input", Err::kShape, {"0-d"},
           [=] { layer_norm(scalar_tensor(1.0), f32({1}), U); });
  add_case("rms_norm_weight_size", Err::kShape, {"weight [3]", "[2, 8]"}, [] {
    rms_norm(f32({2, 8}), f32({3}));
  });
  add_case("rms_norm_0d_input", Err::kShape, {"0-d"},
           [] { rms_norm(scalar_tensor(1.0), f32({1})); });
  add_case("rms_norm_meta_weight", Err::kType, {"rms_norm", "different devices"}, [] {
    rms_norm(f32({2, 8}), meta({8}));
  });
  add_case("softmax_0d", Err::kShape, {"softmax", "[]"}, [] { softmax(scalar_tensor(1.0)); });
  add_case("log_softmax_0d", Err::kShape, {"log_softmax", "[]"},
           [] { log_softmax(scalar_tensor(1.0), 0); });
  add_case("softmax_dim_out_of_range", Err::kShape, {"dimension 2", "2 dimensions"}, [] {
    softmax(f32({2, 3}), 2);
  });
  add_case("softmax_bf16", Err::kType, {"softmax", "bf16"}, [] { softmax(bf16({2, 3})); });
  add_case("softmax_undefined", Err::kValue, {"undefined"}, [=] { softmax(U); });

  // ---- attention and rotary ----
  add_case("sdpa_heads_not_multiple", Err::kShape, {"query heads 3", "key/value heads 2"}, [] {
    scaled_dot_product_attention(f32({1, 3, 4, 8}), f32({1, 2, 4, 8}), f32({1, 2, 4, 8}));
  });
  add_case("sdpa_zero_kv_heads", Err::kShape, {"key/value heads 0"}, [] {
    scaled_dot_product_attention(f32({1, 2, 4, 8}), f32({1, 0, 4, 8}), f32({1, 0, 4, 8}));
  });
  add_case("sdpa_k_v_differ", Err::kShape, {"[1, 2, 4, 8]", "[1, 2, 4, 4]"}, [] {
    scaled_dot_product_attention(f32({1, 2, 4, 8}), f32({1, 2, 4, 8}), f32({1, 2, 4, 4}));
  });
  add_case("sdpa_seq_len_differs", Err::kShape, {"k [1, 2, 5, 8]", "q [1, 2, 4, 8]"}, [] {
    scaled_dot_product_attention(f32({1, 2, 4, 8}), f32({1, 2, 5, 8}), f32({1, 2, 5, 8}));
  });
  add_case("sdpa_head_size_differs", Err::kShape, {"k [1, 2, 4, 4]", "q [1, 2, 4, 8]"}, [] {
    scaled_dot_product_attention(f32({1, 2, 4, 8}), f32({1, 2, 4, 4}), f32({1, 2, 4, 4}));
  });
  add_case("sdpa_not_4d", Err::kShape, {"[2, 4, 8]"}, [] {
    scaled_dot_product_attention(f32({2, 4, 8}), f32({2, 4, 8}), f32({2, 4, 8}));
  });
  add_case("sdpa_bf16", Err::kType, {"scaled_dot_product_attention", "bf16"}, [] {
    scaled_dot_product_attention(bf16({1, 2, 4, 8}), f32({1, 2, 4, 8}), f32({1, 2, 4, 8}));
  });
  add_case("sdpa_meta_and_cpu", Err::kType, {"scaled_dot_product_attention", "different devices"},
           [] {
             scaled_dot_product_attention(f32({1, 2, 4, 8}), meta({1, 2, 4, 8}), f32({1, 2, 4, 8}));
           });
  add_case("sdpa_undefined", Err::kValue, {"scaled_dot_product_attention", "undefined"}, [=] {
    scaled_dot_product_attention(f32({1, 2, 4, 8}), f32({1, 2, 4, 8}), U);
  });
  add_case("attention_reference_heads_not_multiple", Err::kShape, {"query heads 4", "heads 3"}, [] {
    attention_reference(f32({1, 4, 4, 8}), f32({1, 3, 4, 8}), f32({1, 3, 4, 8}));
  });
  add_case("rope_cache_odd_head_size", Err::kValue, {"head size", "got 7"},
           [] { rope_cache(16, 7, 10000.0); });
  add_case("rope_cache_zero_length", Err::kValue, {"T", "got 0"}, [] { rope_cache(0, 8, 1e4); });
  add_case("rope_cache_bad_theta", Err::kValue, {"theta", "-1"}, [] { rope_cache(4, 8, -1.0); });
  add_case("rotary_odd_head_size", Err::kShape, {"got 7"}, [] {
    rotary_embedding(f32({1, 1, 4, 7}), f32({4, 7}), f32({4, 7}));
  });
  add_case("rotary_tables_too_short", Err::kShape, {"[3, 8]", "[1, 1, 4, 8]"}, [] {
    auto [cos, sin] = rope_cache(3, 8, 1e4);
    rotary_embedding(f32({1, 1, 4, 8}), cos, sin);
  });
  add_case("rotary_not_4d", Err::kShape, {"[4, 8]"}, [] {
    auto [cos, sin] = rope_cache(4, 8, 1e4);
    rotary_embedding(f32({4, 8}), cos, sin);
  });
  add_case("rotary_meta_x_cpu_tables", Err::kType, {"rotary_embedding", "different devices"}, [] {
    auto [cos, sin] = rope_cache(4, 8, 1e4);
    rotary_embedding(meta({1, 1, 4, 8}), cos, sin);
  });
  add_case("rotary_cpu_x_meta_tables", Err::kType, {"rotary_embedding", "different devices"}, [] {
    auto [cos, sin] = rope_cache(4, 8, 1e4, Device::kMeta);
    rotary_embedding(f32({1, 1, 4, 8}), cos, sin);
  });
  add_case("rotary_bf16", Err::kType, {"rotary_embedding", "bf16"}, [] {
    auto [cos, sin] = rope_cache(4, 8, 1e4);
    rotary_embedding(bf16({1, 1, 4, 8}), cos, sin);
  });

  // ---- embedding and cross-entropy ----
  add_case("embedding_index_too_large", Err::kValue, {"index 7", "position 1", "[0, 5)"}, [] {
    embedding(i64({0, 7, 1}), f32({5, 3}));
  });
  add_case("embedding_negative_index_i32", Err::kValue, {"index -1", "position 2", "[0, 5)"}, [] {
    embedding(i32({0, 4, -1}), f32({5, 3}));
  });
  add_case("embedding_float_indices", Err::kType, {"embedding", "indices", "f32"}, [] {
    embedding(f32({2}), f32({5, 3}));
  });
  add_case("embedding_weight_not_2d", Err::kShape, {"[5]"}, [] { embedding(i64({0}), f32({5})); });
  add_case("embedding_bf16_weight", Err::kType, {"embedding", "bf16"}, [] {
    embedding(i64({0}), bf16({5, 3}));
  });
  add_case("embedding_meta_weight_cpu_indices", Err::kType, {"embedding", "different devices"}, [] {
    embedding(i64({0}), meta({5, 3}));
  });
  add_case("embedding_undefined_indices", Err::kValue, {"embedding", "undefined"}, [=] {
    embedding(U, f32({5, 3}));
  });
  add_case("cross_entropy_target_too_large", Err::kValue, {"target 5", "[0, 5)"}, [] {
    cross_entropy(f32({3, 5}), i64({0, 5, 1}));
  });
  add_case("cross_entropy_negative_target", Err::kValue, {"target -1", "[0, 5)"}, [] {
    cross_entropy(f32({3, 5}), i32({0, 1, -1}));
  });
  add_case("cross_entropy_ignore_index_is_not_a_wildcard", Err::kValue, {"target -100"}, [] {
    cross_entropy(f32({2, 5}), i64({-100, 1}), /*ignore_index=*/-1);
  });
  add_case("cross_entropy_wrong_target_count", Err::kShape, {"[4, 5]", "4 targets", "[3]"}, [] {
    cross_entropy(f32({4, 5}), i64({0, 1, 2}));
  });
  add_case("cross_entropy_float_targets", Err::kType, {"cross_entropy", "targets", "f32"}, [] {
    cross_entropy(f32({2, 5}), f32({2}));
  });
  add_case("cross_entropy_bf16_logits", Err::kType, {"cross_entropy", "bf16"}, [] {
    cross_entropy(bf16({2, 5}), i64({0, 1}));
  });
  add_case("cross_entropy_meta_logits_cpu_targets", Err::kType,
           {"cross_entropy", "different devices"}, [] {
             cross_entropy(meta({2, 5}), i64({0, 1}));
           });
  add_case("cross_entropy_0d_logits", Err::kShape, {"[]"},
           [] { cross_entropy(scalar_tensor(1.0), i64({0})); });
  add_case("cross_entropy_undefined_targets", Err::kValue, {"cross_entropy", "undefined"}, [=] {
    cross_entropy(f32({2, 5}), U);
  });

  // ---- reductions, cat, split, chunk ----
  add_case("sum_dim_out_of_range", Err::kShape, {"dimension 3", "3 dimensions"}, [] {
    sum(f32({2, 3, 4}), 3);
  });
  add_case("sum_bf16", Err::kType, {"sum", "bf16"}, [] { sum(bf16({2})); });
  add_case("mean_dim_out_of_range", Err::kShape, {"dimension -3"}, [] { mean(f32({2, 3}), -3); });
  add_case("sum_undefined", Err::kValue, {"sum", "undefined"}, [=] { sum(U); });
  add_case("cat_mismatched_shapes", Err::kShape, {"tensor 1", "[2, 4]", "[2, 3]"}, [] {
    cat({f32({2, 3}), f32({2, 4})}, 0);
  });
  add_case("cat_mismatched_rank", Err::kShape, {"tensor 2", "[3]"}, [] {
    cat({f32({2, 3}), f32({1, 3}), f32({3})}, 0);
  });
  add_case("cat_mismatched_dtype", Err::kType, {"tensor 1", "bf16"}, [] {
    cat({f32({2, 3}), bf16({2, 3})}, 0);
  });
  add_case("cat_meta_and_cpu", Err::kType, {"tensor 1", "meta"}, [] {
    cat({f32({2, 3}), meta({2, 3})}, 1);
  });
  add_case("cat_empty_list", Err::kValue, {"cat"}, [] { cat({}, 0); });
  add_case("cat_undefined_tensor", Err::kValue, {"tensor 1", "undefined"}, [=] {
    cat({f32({2}), U}, 0);
  });
  add_case("cat_0d_tensors", Err::kShape, {"cat", "0-d"}, [] {
    cat({scalar_tensor(1.0), scalar_tensor(2.0)}, 0);
  });
  add_case("cat_dim_out_of_range", Err::kShape, {"dimension 2"}, [] {
    cat({f32({2, 3}), f32({2, 3})}, 2);
  });
  add_case("split_sizes_do_not_add_up", Err::kShape, {"[2, 2]", "add up to 4", "[5, 2]", "has 5"},
           [] {
             split(f32({5, 2}), {2, 2}, 0);
           });
  add_case("split_negative_size", Err::kShape, {"[6, -1]"}, [] { split(f32({5, 2}), {6, -1}, 0); });
  add_case("split_dim_out_of_range", Err::kShape, {"dimension 2"}, [] {
    split(f32({5, 2}), {5}, 2);
  });
  add_case("split_0d", Err::kShape, {"0-d"}, [] { split(scalar_tensor(1.0), {1}, 0); });
  add_case("chunk_does_not_divide", Err::kShape, {"size 5", "2 chunks"}, [] {
    chunk(f32({5, 2}), 2, 0);
  });
  add_case("chunk_zero_chunks", Err::kValue, {"chunks", "got 0"}, [] { chunk(f32({4}), 0, 0); });
  add_case("chunk_undefined", Err::kValue, {"undefined"}, [=] { chunk(U, 2, 0); });

  // ---- views ----
  add_case("reshape_wrong_numel", Err::kShape, {"[4, 2]", "[2, 3]"}, [] {
    f32({2, 3}).reshape({4, 2});
  });
  add_case("view_of_transposed", Err::kShape, {"[6]", "reshape"}, [] {
    f32({2, 3}).transpose(0, 1).view({6});
  });
  add_case("expand_incompatible", Err::kShape, {"[2, 3]", "[2, 4]"}, [] {
    f32({2, 3}).expand({2, 4});
  });
  add_case("narrow_out_of_range", Err::kShape, {"[2, 5)", "size 3"}, [] {
    f32({2, 3}).narrow(1, 2, 3);
  });
  add_case("slice_zero_step", Err::kShape, {"step", "got 0"}, [] { f32({4}).slice(0, 0, 4, 0); });
  add_case("permute_repeated_dim", Err::kShape, {"repeated"}, [] { f32({2, 3}).permute({0, 0}); });
  add_case("transpose_dim_out_of_range", Err::kShape, {"dimension 2"}, [] {
    f32({2, 3}).transpose(0, 2);
  });
  add_case("size_of_0d", Err::kShape, {"0-d"}, [] { scalar_tensor(1.0).size(-1); });
  return c;
}

class OpErrors : public ::testing::TestWithParam<ErrorCase> {};

TEST_P(OpErrors, ThrowsTheDocumentedTypeWithTheOffendingValues) {
  const ErrorCase& c = GetParam();
  std::string what;
  Err got = Err::kValue;
  try {
    c.run();
    FAIL() << "no exception; expected " << err_name(c.type);
  } catch (const ShapeError& e) {
    got = Err::kShape;
    what = e.what();
  } catch (const TypeError& e) {
    got = Err::kType;
    what = e.what();
  } catch (const ValueError& e) {
    got = Err::kValue;
    what = e.what();
  } catch (const std::exception& e) {
    FAIL() << "expected " << err_name(c.type) << ", got another exception: " << e.what();
  }
  EXPECT_EQ(err_name(got), std::string(err_name(c.type))) << what;
  for (const std::string& s : c.substrings) {
    EXPECT_NE(what.find(s), std::string::npos) << "'" << s << "' not in: " << what;
  }
  ASSERT_FALSE(what.empty());
  EXPECT_NE(what.back(), '.') << what;
  EXPECT_FALSE(std::isupper(static_cast<unsigned char>(what.front()))) << what;
}

INSTANTIATE_TEST_SUITE_P(Ops, OpErrors, ::testing::ValuesIn(error_cases()),
                         [](const ::testing::TestParamInfo<ErrorCase>& info) {
                           return info.param.name;
                         });

// A failed op leaves its inputs untouched and records nothing.
TEST(OpErrorsState, FailedOpLeavesInputsAndGradientsUntouched) {
  Tensor a = from_vector({1.f, 2.f, 3.f, 4.f, 5.f, 6.f}, {2, 3}, {.requires_grad = true});
  EXPECT_THROW(matmul(a, a), ShapeError);
  EXPECT_THROW(cat({a, a.transpose(0, 1)}, 0), ShapeError);
  EXPECT_EQ(a.to_vector<float>(), (std::vector<float>{1, 2, 3, 4, 5, 6}));
  EXPECT_FALSE(a.grad().defined());
  sum(matmul(a, a.transpose(0, 1))).backward();  // still usable
  ASSERT_TRUE(a.grad().defined());
  EXPECT_EQ(a.grad().shape(), a.shape());
}

}  // namespace
}  // namespace acc

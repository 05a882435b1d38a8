// The fused flash-style scaled_dot_product_attention against attention_reference (matmul +
// softmax, materialises (B,NH,T,T)): forward output and the gradients of q, k and v over a table
// of shapes that covers a single token, partial and exact 64-row tiles, several head sizes and
// grouped-query attention; then the O(T) memory claim and thread-count independence.
//
// Tolerance: 1e-5 absolute (inputs N(0, 1), outputs and gradients O(1)). The two paths sum in
// different orders in f32; the observed differences are ~1e-6.

#include <gtest/gtest.h>

#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "acc/autograd/engine.hpp"
#include "acc/autograd/ops.hpp"
#include "acc/tensor/allocator.hpp"
#include "acc/tensor/observer.hpp"
#include "acc/tensor/random.hpp"
#include "acc/tensor/threading.hpp"
#include "autograd/gradcheck.hpp"

namespace acc {
namespace {

using test::compare_with_reference;
using test::TensorFn;

struct AttnCase {
  int64_t B, NH, NKV, T, HS;
  bool causal;
  bool packed;  // q, k, v given as strided views of one (B, T, NH + 2 NKV, HS) tensor
};

std::string case_name(const AttnCase& c) {
  std::ostringstream os;
  os << "B" << c.B << "_NH" << c.NH << "_NKV" << c.NKV << "_T" << c.T << "_HS" << c.HS
     << (c.causal ? "_causal" : "_full") << (c.packed ? "_packed" : "");
  return os.str();
}

void PrintTo(const AttnCase& c, std::ostream* os) {
  *os << case_name(c);
}

class AttentionVsReference : public ::testing::TestWithParam<AttnCase> {};

TEST_P(AttentionVsReference, ForwardAndAllGradientsMatch) {
  const AttnCase c = GetParam();
  Generator gen(static_cast<uint64_t>(c.T * 1000 + c.HS * 10 + c.NH));
  std::vector<Tensor> inputs;
  std::function<std::vector<Tensor>(const std::vector<Tensor>&)> qkv;
  if (c.packed) {
    inputs = {randn({c.B, c.T, c.NH + 2 * c.NKV, c.HS}, gen)};
    qkv = [c](const std::vector<Tensor>& v) {
      return std::vector<Tensor>{v[0].narrow(2, 0, c.NH).transpose(1, 2),
                                 v[0].narrow(2, c.NH, c.NKV).transpose(1, 2),
                                 v[0].narrow(2, c.NH + c.NKV, c.NKV).transpose(1, 2)};
    };
  } else {
    inputs = {randn({c.B, c.NH, c.T, c.HS}, gen), randn({c.B, c.NKV, c.T, c.HS}, gen),
              randn({c.B, c.NKV, c.T, c.HS}, gen)};
    qkv = [](const std::vector<Tensor>& v) { return v; };
  }
  TensorFn fused = [&](const std::vector<Tensor>& v) {
    auto t = qkv(v);
    return scaled_dot_product_attention(t[0], t[1], t[2], c.causal);
  };
  TensorFn ref = [&](const std::vector<Tensor>& v) {
    auto t = qkv(v);
    return attention_reference(t[0], t[1], t[2], c.causal);
  };
  auto r = compare_with_reference(fused, ref, inputs);
  EXPECT_TRUE(r.report.empty()) << r.report;
  EXPECT_LT(r.forward_err, 1e-5);
  ASSERT_EQ(r.grad_errs.size(), inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    EXPECT_LT(r.grad_errs[i], 1e-5) << "gradient of input " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, AttentionVsReference,
    ::testing::Values(
        AttnCase{1, 1, 1, 1, 8, true, false},     // one token
        AttnCase{2, 2, 2, 1, 16, false, false},   // one token, no mask
        AttnCase{2, 2, 2, 63, 16, true, false},   // one partial tile
        AttnCase{1, 2, 2, 64, 16, true, false},   // exactly one tile
        AttnCase{1, 2, 2, 64, 64, false, false},  // exactly one tile, HS 64
        AttnCase{1, 2, 2, 65, 16, true, false},   // one row past a tile
        AttnCase{1, 2, 2, 65, 8, false, false}, AttnCase{1, 4, 2, 65, 8, true, false},  // GQA
        AttnCase{1, 4, 1, 130, 8, true, false},   // MQA, 3 tiles
        AttnCase{1, 2, 1, 200, 64, true, false},  // HS 64, 4 tiles, last partial
        AttnCase{2, 4, 2, 200, 16, false, false}, AttnCase{2, 4, 2, 200, 16, true, false},
        AttnCase{2, 2, 2, 70, 16, true, true},  // strided views of packed qkv
        AttnCase{1, 4, 2, 129, 8, false, true},
        // Partial last tiles whose rows end in each kind of row block of the tile
        // kernel, head sizes that are not a whole number of vectors or are wider
        // than one panel, and the 17M GPT's head layout.
        AttnCase{1, 2, 1, 253, 24, true, false}, AttnCase{1, 2, 2, 255, 80, true, true},
        AttnCase{1, 1, 1, 250, 128, true, false}, AttnCase{1, 2, 2, 190, 80, false, false},
        AttnCase{1, 8, 8, 256, 64, true, true}),
    [](const ::testing::TestParamInfo<AttnCase>& info) { return case_name(info.param); });

// ---------------------------------------------------------------------------------------------
// memory: the fused op never holds a (T, T) buffer

struct PeakBytes {
  int64_t forward, total;
};

// Tracked bytes above the starting point at the forward's peak and at the backward's peak.
PeakBytes measure(int64_t T, bool fused) {
  const int64_t B = 1, NH = 4, HS = 16;
  Generator gen(5);
  Tensor q = randn({B, NH, T, HS}, gen), k = randn({B, NH, T, HS}, gen),
         v = randn({B, NH, T, HS}, gen), R = randn({B, NH, T, HS}, gen);
  for (Tensor* t : {&q, &k, &v}) t->set_requires_grad(true);
  memory::reset_peak();
  const int64_t base = memory::current_bytes();
  PeakBytes p{};
  {
    Tensor y = fused ? scaled_dot_product_attention(q, k, v, true) : attention_reference(q, k, v);
    p.forward = memory::peak_bytes() - base;
    y.backward(R);
    p.total = memory::peak_bytes() - base;
  }
  EXPECT_TRUE(q.grad().defined() && k.grad().defined() && v.grad().defined());
  return p;
}

TEST(FlashAttention, TrackedMemoryIsLinearInTAndFarBelowTheScoreMatrix) {
  const int64_t B = 1, NH = 4, T = 1024, HS = 16;
  const int64_t scores = B * NH * T * T * 4;  // one f32 (B,NH,T,T) buffer: 16 MiB
  const int64_t out_and_lse = B * NH * T * HS * 4 + B * NH * T * 4;
  const PeakBytes fused = measure(T, true);
  // Forward: the output and the row log-sum-exp are all it stores.
  EXPECT_LE(fused.forward, out_and_lse) << fused.forward;
  // Forward and backward together (dout, dq/dk/dv and the accumulated grads) stay under 10%.
  EXPECT_LT(fused.total, scores / 10) << fused.total;
  // Doubling T doubles the memory (O(T)), it does not quadruple it.
  const PeakBytes half = measure(T / 2, true);
  EXPECT_LE(fused.total, 2 * half.total + 4096) << half.total << " -> " << fused.total;
  EXPECT_GT(fused.total, half.total);
  // The measurement does see a (T,T) buffer when there is one: the reference path needs several.
  const PeakBytes ref = measure(T, false);
  EXPECT_GE(ref.forward, scores) << ref.forward;
}

// ---------------------------------------------------------------------------------------------
// a split qkv: the fused backward writes dq, dk, dv side by side, so the split needs no cat

// Counts the ops named `name` that run while it is installed.
struct OpCounter : detail::OpObserver {
  explicit OpCounter(std::string n) : name(std::move(n)) { prev = detail::set_op_observer(this); }
  ~OpCounter() override { detail::set_op_observer(prev); }
  void on_alloc(uint64_t, size_t, Device) override {}
  void on_free(uint64_t) override {}
  void on_flops(int64_t, bool) override {}
  void on_backward_begin(const std::vector<Tensor>&) override {}
  void on_op(const std::string& op, const std::string&, const std::vector<Tensor>&,
             const std::vector<Tensor>&, bool) override {
    count += op == name;
  }
  std::string name;
  int count = 0;
  detail::OpObserver* prev = nullptr;
};

// Gradient of a (B, T, 3C) qkv through split -> heads -> attention, and the number of
// concatenations its backward ran.
std::pair<std::vector<float>, int> split_qkv_grad(bool fused) {
  const int64_t B = 2, T = 70, NH = 2, HS = 16, C = NH * HS;
  Generator gen(23);
  Tensor qkv = randn({B, T, 3 * C}, gen).set_requires_grad(true);
  Tensor R = randn({B, T, C}, gen);
  auto parts = split(qkv, {C, C, C}, 2);
  auto heads = [&](const Tensor& t) { return t.view({B, T, NH, HS}).transpose(1, 2); };
  Tensor q = heads(parts[0]), k = heads(parts[1]), v = heads(parts[2]);
  Tensor y = fused ? scaled_dot_product_attention(q, k, v) : attention_reference(q, k, v);
  y = y.transpose(1, 2).reshape({B, T, C});
  OpCounter cats("Cat");
  y.backward(R);
  return {qkv.grad().to_vector<float>(), cats.count};
}

TEST(FlashAttention, SplitQkvBackwardNeedsNoConcatenation) {
  const auto [fused, fused_cats] = split_qkv_grad(true);
  const auto [ref, ref_cats] = split_qkv_grad(false);
  EXPECT_EQ(fused_cats, 0);
  EXPECT_EQ(ref_cats, 1);  // separate dq, dk, dv buffers are concatenated
  ASSERT_EQ(fused.size(), ref.size());
  float err = 0.f;
  for (size_t i = 0; i < fused.size(); ++i) err = std::max(err, std::abs(fused[i] - ref[i]));
  EXPECT_LT(err, 1e-5f);
}

// ---------------------------------------------------------------------------------------------
// thread-count independence. Equal bit for bit by construction: the kernels run one task per
// (batch, kv head) with its own tile GEMMs (no OpenBLAS), so the thread count changes which
// thread computes a head, never the order of its additions.

struct AttnRun {
  std::vector<float> out, dq, dk, dv;
};

AttnRun run_attention(int threads) {
  set_num_threads(threads);
  EXPECT_EQ(get_num_threads(), threads);
  Generator gen(17);
  Tensor q = randn({2, 4, 130, 16}, gen), k = randn({2, 2, 130, 16}, gen),
         v = randn({2, 2, 130, 16}, gen), R = randn({2, 4, 130, 16}, gen);
  for (Tensor* t : {&q, &k, &v}) t->set_requires_grad(true);
  Tensor y = scaled_dot_product_attention(q, k, v, true);
  y.backward(R);
  return {y.to_vector<float>(), q.grad().to_vector<float>(), k.grad().to_vector<float>(),
          v.grad().to_vector<float>()};
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(FlashAttention, BitwiseIdenticalWithOneAndTwoThreads) {
  const int prev = get_num_threads();
  const AttnRun one = run_attention(1);
  const AttnRun two = run_attention(2);
  set_num_threads(prev);
  EXPECT_TRUE(bitwise_equal(one.out, two.out));
  EXPECT_TRUE(bitwise_equal(one.dq, two.dq));
  EXPECT_TRUE(bitwise_equal(one.dk, two.dk));
  EXPECT_TRUE(bitwise_equal(one.dv, two.dv));
  EXPECT_FALSE(one.dk.empty());
}

}  // namespace
}  // namespace acc

// acc::recompute over several inputs (the form selective recomputation checkpoints an attention
// core with): the output and every input's gradient equal the plain computation's bitwise (the
// same kernels on the same values, run again), an input that does not require grad gets none,
// dropout replays its mask, and only the inputs stay alive between forward and backward.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "acc/autograd/ops.hpp"
#include "acc/autograd/recompute.hpp"
#include "acc/tensor/allocator.hpp"
#include "acc/tensor/random.hpp"
#include "acc/util/error.hpp"

namespace acc {
namespace {

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape()) return false;
  const auto x = a.contiguous().to_vector<float>(), y = b.contiguous().to_vector<float>();
  return std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
}

// An attention core with dropout on its output: q (B, NH, T, HS), k and v (B, NKV, T, HS).
Tensor core(const std::vector<Tensor>& in) {
  return dropout(attention_reference(in[0], in[1], in[2], /*causal=*/true), 0.25, true);
}

struct Inputs {
  Tensor q, k, v;
};

// q, k, v as strided views of one packed leaf, as GPT's split of c_attn gives them.
Inputs make_inputs(Tensor& packed) {
  Generator gen(3);
  packed = randn({2, 8, 3 * 2 * 4}, gen);  // (B, T, 3C), C = NH * HS = 2 * 4
  packed.set_requires_grad(true);
  auto parts = split(packed, {8, 8, 8}, 2);
  auto heads = [&](size_t i) { return parts[i].view({2, 8, 2, 4}).transpose(1, 2); };
  return {heads(0), heads(1), heads(2)};
}

TEST(RecomputeInputs, OutputAndGradientsEqualThePlainRunBitwise) {
  Tensor packed_a, packed_b;
  Inputs a = make_inputs(packed_a), b = make_inputs(packed_b);
  Generator w(9);
  const Tensor dy = randn({2, 2, 8, 4}, w);

  manual_seed(5);
  Tensor plain = core({a.q, a.k, a.v});
  plain.backward(dy);

  manual_seed(5);
  Tensor again = recompute(core, {b.q, b.k, b.v});
  EXPECT_EQ(again.grad_fn()->name(), "RecomputeBackward");
  manual_seed(77);  // backward restores the forward's generator state for the replay
  again.backward(dy);

  EXPECT_TRUE(bitwise_equal(again, plain));
  EXPECT_TRUE(bitwise_equal(packed_b.grad(), packed_a.grad()));
}

TEST(RecomputeInputs, InputsWithoutGradGetNone) {
  Generator gen(4);
  Tensor q = randn({1, 2, 8, 4}, gen), k = randn({1, 2, 8, 4}, gen), v = randn({1, 2, 8, 4}, gen);
  q.set_requires_grad(true);
  Tensor q2 = q.detach(), k2 = k.detach(), v2 = v.detach();
  q2.set_requires_grad(true);
  v2.set_requires_grad(true);
  auto attn = [](const std::vector<Tensor>& in) {
    return attention_reference(in[0], in[1], in[2], true);
  };
  sum(recompute(attn, {q, k, v})).backward();
  EXPECT_TRUE(q.grad().defined());
  EXPECT_FALSE(k.grad().defined());
  EXPECT_FALSE(v.grad().defined());
  sum(attn({q2, k2, v2})).backward();
  EXPECT_TRUE(bitwise_equal(q.grad(), q2.grad()));
}

TEST(RecomputeInputs, WithoutGradItIsThePlainFunction) {
  Generator gen(4);
  Tensor q = randn({1, 2, 8, 4}, gen);
  auto attn = [](const std::vector<Tensor>& in) {
    return attention_reference(in[0], in[0], in[0], true);
  };
  Tensor y = recompute(attn, {q});
  EXPECT_FALSE(y.requires_grad());
  EXPECT_TRUE(bitwise_equal(y, attn({q})));
  EXPECT_THROW(recompute(attn, std::vector<Tensor>{}), ValueError);
}

// The reference attention keeps its (B, NH, T, T) probabilities for backward; recomputed, only
// the inputs (views of the packed leaf, already alive) and the output are held.
TEST(RecomputeInputs, KeepsOnlyTheInputsAlive) {
  Generator gen(6);
  Tensor x = randn({1, 4, 128, 8}, gen);
  x.set_requires_grad(true);
  auto attn = [](const std::vector<Tensor>& in) {
    return attention_reference(in[0], in[1], in[2], true);
  };
  const int64_t before = memory::current_bytes();
  Tensor plain = attn({x, x, x});
  const int64_t held_plain = memory::current_bytes() - before;
  Tensor recomputed = recompute(attn, {x, x, x});
  const int64_t held_recomputed = memory::current_bytes() - before - held_plain;
  EXPECT_EQ(held_recomputed, x.nbytes());    // the output only
  EXPECT_GT(held_plain, 4 * 128 * 128 * 4);  // the probabilities at least
  sum(recomputed).backward();
}

}  // namespace
}  // namespace acc
